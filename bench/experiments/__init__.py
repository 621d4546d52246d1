"""One-off measurements behind decisions in the code (README.md here), each run from the repo
root as `python -m bench.experiments.NAME`.

bench/'s scripts import each other by bare name (`from server import ...`), as `python
bench/run.py` finds them beside itself; an experiment imports them the same way, through this one
entry, appended so that no installed module is shadowed by theirs.
"""

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parent.parent)
if _BENCH not in sys.path:
    sys.path.append(_BENCH)
