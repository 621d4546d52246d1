"""SIGTERM and SIGINT while the server starts, before uvicorn takes its signals over
(api/server.py): the engine processes started so far end, then the server, with the status a
stopped server has (killed by SIGTERM; 130 after SIGINT).

An engine process ignores both signals (the server drains, then stops it: transport/child.py),
and loading and warming a model can take minutes: a server killed by the default SIGTERM while
it waited for them left its engine process loading for nobody, which only SIGKILL ended. Once
uvicorn stops it restores these handlers and raises the signal again: then no engine process is
left to end, and the server leaves with the same status. An engine process whose server is gone
before it is ready (SIGKILL) ends by itself (transport/child.py)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
from types import FrameType

log = logging.getLogger("omlx_logprobs")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
JOIN_S = 5.0  # a SIGKILLed process is gone at once; this only bounds a wait that cannot hang


def end_on_signal() -> None:
    """From now until uvicorn's handlers replace these: a signal ends the engine processes,
    then the server."""
    for sig in SIGNALS:
        signal.signal(sig, _end)


def _end(sig: int, frame: FrameType | None) -> None:
    children = mp.active_children()
    if children:
        pids = ", ".join(str(c.pid) for c in children)
        log.warning("%s: ending the engine processes (%s)", signal.Signals(sig).name, pids)
    for child in children:  # SIGKILL: it ignores SIGTERM, and holds nothing worth writing yet
        child.kill()
    for child in children:
        child.join(JOIN_S)
    logging.shutdown()
    sys.stderr.flush()
    if sig == signal.SIGINT:
        os._exit(130)  # what a server stopped by Ctrl-C exits with (cli.py)
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)
    os._exit(128 + sig)  # not reached: the default action ends the process
