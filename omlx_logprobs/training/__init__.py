"""Training on the served weights, in the engine's process and on its thread: LoRA adapters
trained beside the adapters the engine serves (training/lora.py), Tinker's built-in losses
(training/losses.py), and the runs a server holds (training/trainer.py), asked for with the
records of training/calls.py (docs/specs/tinker.md)."""
