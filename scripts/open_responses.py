"""Run the published Open Responses compliance suite against this server (`make open-responses`).

The suite is TypeScript in the specification's repository (openresponses/openresponses:
`bin/compliance-test.ts`, its tests in `src/lib/compliance-tests.ts`), run with bun; CI cannot
reach GitHub, so this is a tool, not a test (tests/integration/test_open_responses.py is the
suite's tests re-implemented in Python, in CI). Given a checkout of that repository with its
dependencies installed (`bun install`, or zod and bun from npm in its node_modules), this serves
the scripted model of tests/integration/test_open_responses.py with the real CLI on loopback
(the tool-calling prompt gets a Hermes tool call, the others fitting text), runs the suite
against it, prints the suite's own report and the checkout's commit, and exits with the suite's
status. docs/specs/responses.md records the last result measured."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# The scripted model is the integration test's, imported from the repository's root.
sys.path.insert(0, str(ROOT))

from tests.helpers.scripted import write_description  # noqa: E402
from tests.integration.test_open_responses import KEY, MODEL, SCRIPTS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="a checkout of openresponses/openresponses")
    ap.add_argument("--bun", help="the bun binary (default: on PATH, else the checkout's)")
    ap.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    ap.add_argument("--filter", help="the suite's test ids, comma-separated")
    ap.add_argument("--json", action="store_true", help="the suite's JSON report instead")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    suite = checkout / "bin" / "compliance-test.ts"
    if not suite.is_file():
        sys.exit(f"{checkout}: no bin/compliance-test.ts (not a checkout of the suite)")
    if not (checkout / "node_modules" / "zod").is_dir():
        sys.exit(f"{checkout}: its dependencies are not installed: run `bun install` there")
    bun = args.bun or shutil.which("bun") or str(checkout / "node_modules" / ".bin" / "bun")
    if not Path(bun).is_file() and shutil.which(bun) is None:
        sys.exit("no bun: install it (`npm install bun` ships its binary) or pass --bun")
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    port = args.port or free_port()
    with tempfile.TemporaryDirectory() as tmp, serve(Path(tmp), port):
        command = [bun, str(suite), "--base-url", f"http://127.0.0.1:{port}/v1",
                   "--api-key", KEY, "--model", MODEL]  # fmt: skip
        if args.filter:
            command += ["--filter", args.filter]
        if args.json:
            command.append("--json")
        else:
            print(f"Open Responses compliance suite at {commit or 'an unknown commit'}")
        sys.stdout.flush()
        return subprocess.run(command, cwd=checkout).returncode


class serve:
    """The scripted model served by `omlx_logprobs.cli serve` until the block ends."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.port = tmp, port

    def __enter__(self) -> None:
        model = self.tmp / "model.json"
        added = ["<tool_call>", "</tool_call>", *list(SCRIPTS)[1:]]
        # As the integration test: no temperature is sent (1.0), the script's token alone likely.
        write_description(model, name=MODEL, added_tokens=added, scripts=SCRIPTS,
                          chosen_logit=40.0, chosen_slope=0.0, other_logits=[1.0],
                          rest_logit=0.0)  # fmt: skip
        command = [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--model", str(model),
                   "--port", str(self.port), "--api-key", KEY, "--reasoning-parser", "think",
                   "--tool-call-parser", "hermes", "--log-level", "warning"]  # fmt: skip
        self.log = open(self.tmp / "server.log", "w")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                sys.exit("the server exited:\n" + (self.tmp / "server.log").read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        sys.exit("the server did not answer /health in 120 s")

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
