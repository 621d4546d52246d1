"""Every tested family's tiny random model through the start-up probe in each activation dtype
(runner/probe.py: the batch against each row alone, 16-bit tolerance for 16-bit types): which
families pass, and the worst relative difference. Run on a GPU host, where `--dtype auto`
keeps the stored 16-bit type:

    OMLX_TEST_TOKENIZER_DIR=<SmolLM2 tokenizer dir> python3 -m bench.experiments.probe_dtypes
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omlx_logprobs.cli import mlx_environment

mlx_environment()  # the server's settings (cuDNN's attention off), before MLX starts

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from omlx_logprobs.models.dtype import apply_dtype  # noqa: E402
from omlx_logprobs.models.loader import load_model  # noqa: E402
from omlx_logprobs.runner.batch_cache import UnbatchableCache  # noqa: E402
from omlx_logprobs.runner.probe import probe  # noqa: E402
from tests.helpers.families import FAMILIES, build_family  # noqa: E402


def main() -> None:
    tok = Path(os.environ["OMLX_TEST_TOKENIZER_DIR"])
    print(f"device {mx.default_device()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            path = build_family(name, Path(tmp) / name, tok)
            for dtype in ("float32", "bfloat16", "float16"):
                loaded = load_model(str(path), dtype="float32")
                net = loaded.model
                apply_dtype(net, dtype)
                mx.eval(net.parameters())
                try:
                    probe(net, make_prompt_cache(net))
                    verdict = "passes"
                except UnbatchableCache as exc:
                    verdict = f"REFUSED: {exc}"
                print(f"{name:18s} {dtype:9s} {verdict}", flush=True)


if __name__ == "__main__":
    main()
