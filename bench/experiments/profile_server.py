# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Our server, in-process, with cProfile on both of its threads (the event loop and the engine).

    python bench/experiments/profile_server.py serve --model DIR --port 8101
    # then load it; Ctrl-C prints the profiles

Same arguments as `omlx-logprobs serve`; on exit it prints where each thread spent its time.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys

import omlx_logprobs  # noqa: F401
from omlx_logprobs import cli
from omlx_logprobs.engine.engine import Engine

PROFILES: dict[str, cProfile.Profile] = {"event loop": cProfile.Profile()}
_loop = Engine._loop


def _profiled_loop(self: Engine) -> None:
    PROFILES["engine"] = prof = cProfile.Profile()
    prof.enable()
    try:
        _loop(self)
    finally:
        prof.disable()


def _print_profiles() -> None:
    for name, prof in PROFILES.items():
        prof.disable()
        print(f"===== {name} thread", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    sys.stdout.flush()


def main() -> int:
    # Python 3.12's cProfile is process-wide (sys.monitoring): one profile then covers both.
    if sys.version_info < (3, 12):
        Engine._loop = _profiled_loop  # type: ignore[method-assign]
    # The server ends with os._exit (MLX's stream threads abort interpreter teardown): print
    # the profiles just before it.
    real_exit = os._exit

    def exit_after_printing(code: int) -> None:
        _print_profiles()
        real_exit(code)

    os._exit = exit_after_printing  # type: ignore[assignment]
    PROFILES["event loop"].enable()
    cli.main([*sys.argv[1:], "--engine", "thread"])  # the profiled loop must be in this process
    return 0


if __name__ == "__main__":
    sys.exit(main())
