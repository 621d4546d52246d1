"""The benchmarks (bench/README.md). A package so that `python -m bench.experiments.NAME` runs an
experiment from the repo root with the checkout's omlx_logprobs and tests importable."""
