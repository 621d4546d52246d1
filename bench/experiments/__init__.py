"""One-off measurements behind decisions in the code (README.md here), each run from the repo
root as `python -m bench.experiments.NAME`: the root is then first on sys.path, so the
checkout's omlx_logprobs, tests and bench's own modules (`from bench.server import ...`) import
as packages, with no path patch."""
