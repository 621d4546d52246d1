"""What the model lists say of the embedded model (a Q4_1 GGUF file, served converted), read by
the real clients: `openai`'s models.list (the fields beside OpenAI's, in `model_extra`) and
`ollama`'s list and show: context length, capabilities, family, parameters, quantization and
the file's size on disk."""

from __future__ import annotations

import ollama
import openai
from gguf import GGUFReader

from omlx_logprobs.models.embedded import embedded_gguf_path
from tests.helpers.server import MODEL_NAME

CONTEXT = 8192  # SmolLM2-135M's llama.context_length


def test_openai_models_list_sizes_the_context(client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    extra = card.model_extra
    assert card.id == MODEL_NAME and extra is not None
    assert extra["max_model_len"] == extra["context_length"] == CONTEXT
    assert extra["max_context_length"] == CONTEXT
    # SmolLM2's template has no tools and no <think>: the server parses neither
    assert extra["capabilities"] == {
        "tools": False, "reasoning": False, "vision": False, "embeddings": False,
    }  # fmt: skip
    assert extra["loaded"] is True


def test_ollama_list_and_show_read_the_gguf_file(server: str) -> None:
    gguf = embedded_gguf_path()
    reader = GGUFReader(gguf)
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    c = ollama.Client(host=server)
    (listed,) = c.list().models
    assert listed.model == MODEL_NAME
    # the file's bytes: not the memory its weights take once dequantized (/api/ps says that)
    assert listed.size == gguf.stat().st_size
    d = listed.details
    assert d is not None
    assert (d.format, d.family, d.parameter_size, d.quantization_level) == (
        "gguf", "llama", "135M", "Q4_1",
    )  # fmt: skip
    shown = c.show(MODEL_NAME)
    assert shown.capabilities == ["completion"]
    info = shown.modelinfo
    assert info is not None
    assert info["general.architecture"] == reader.fields["general.architecture"].contents()
    assert (
        info["llama.context_length"] == CONTEXT == reader.fields["llama.context_length"].contents()
    )
    assert info["general.parameter_count"] == parameters
    assert shown.details is not None and shown.details.quantization_level == "Q4_1"
