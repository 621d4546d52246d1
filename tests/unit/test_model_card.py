"""A model's card from its files (models/card.py): the GGUF header walk against the `gguf`
package's full parse, the parameter count against the weights themselves, Ollama's size labels."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from gguf import GGUFReader, GGUFValueType

from omlx_logprobs.models.card import ModelCard, read_card
from omlx_logprobs.models.embedded import embedded_gguf_path, ensure_embedded_model
from omlx_logprobs.models.gguf.header import read_keys


def test_header_walk_reads_what_the_gguf_package_reads() -> None:
    path = embedded_gguf_path()
    fields = GGUFReader(path).fields
    scalars = {k for k, f in fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}
    scalars -= {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the header's, not keys
    got = read_keys(path, scalars | {"absent.key"})
    assert set(got) == scalars and len(scalars) > 10
    for key in scalars:
        want = fields[key].contents()
        assert got[key] == pytest.approx(want) if isinstance(want, float) else got[key] == want


def test_header_walk_of_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    assert read_keys(tmp_path / "x.gguf", {"general.file_type"}) == {}


def test_card_of_a_float32_directory(tiny_dir: Path) -> None:
    card = read_card(tiny_dir)
    weights = mx.load(str(tiny_dir / "model.safetensors"))
    assert card.parameters == sum(w.size for w in weights.values())
    assert (card.format, card.quantization, card.family) == ("safetensors", "F32", "llama")
    assert card.size == (tiny_dir / "model.safetensors").stat().st_size


def test_card_of_a_converted_gguf_counts_the_files_tensors() -> None:
    gguf = embedded_gguf_path()
    card = read_card(ensure_embedded_model(), gguf)
    assert card.parameters == sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)
    assert (card.format, card.quantization, card.size) == ("gguf", "Q4_1", gguf.stat().st_size)
    # the directory alone: its own 4-bit weights (8-bit embeddings) and its files' bytes
    alone = read_card(ensure_embedded_model())
    assert (alone.format, alone.quantization, alone.parameters) == (
        "safetensors",
        "Q4",
        card.parameters,
    )


@pytest.mark.parametrize(
    "n, label",
    [(134_515_008, "135M"), (494_032_768, "494M"), (1_543_714_304, "1.54B"),
     (7_615_616_512, "7.62B"), (70_553_706_496, "70.6B"), (950, "950")],
)  # fmt: skip
def test_parameter_size_as_ollama_writes_it(n: int, label: str) -> None:
    assert ModelCard("llama", n, "", "", 0, 0, False).parameter_size == label
