"""`make tinker-example`: tinker-cookbook's own RL recipe (math_rl, its arithmetic environment,
the `importance_sampling` loss) against the embedded SmolLM2-135M-Instruct served here. The
server runs in this venv; the recipe in `.venv-tinker` (`make tinker-venv`: tinker-cookbook's
pins are not the main venv's), through examples/tinker_cookbook/math_rl.py, which changes
only the base URL, the API key, the model name and what a local model needs (docs/specs/tinker.md).

    make tinker-example      # or: .venv/bin/python examples/tinker_cookbook_rl.py --steps 3
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from tinker_rl import start_server

from omlx_logprobs.models.embedded import ensure_embedded_model

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "examples" / "tinker_cookbook" / "math_rl.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument(
        "--python",
        default=str(ROOT / ".venv-tinker" / "bin" / "python"),
        help="the venv tinker-cookbook is installed in",
    )
    ap.add_argument(
        "--invariant",
        action="store_true",
        help="batch-invariant mode: max |ratio - 1| 0, far slower on the CPU",
    )
    # the rest (--groups, --group-size, --learning-rate) goes to the recipe's driver
    a, rest = ap.parse_known_args()
    model_dir = ensure_embedded_model()
    # the served name is the model's directory: the recipe loads its tokenizer by that name
    server = start_server(model_dir, a.port, a.invariant, name=str(model_dir))
    try:
        subprocess.run([a.python, str(DRIVER), "--base-url", f"http://127.0.0.1:{a.port}",
                        "--model", str(model_dir), "--steps", str(a.steps), *rest],
                       check=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
