"""Tinker's training and sampling API (the `tinker` SDK's routes under /api/v1/,
docs/specs/tinker.md): thin adapters from its requests to the engine's training calls
(training/) and to its sampling requests."""
