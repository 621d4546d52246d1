"""A tiny sentence-transformers encoder directory: transformers' `BertModel` (or `XLMRobertaModel`)
from a small config with seeded random weights (torch), a WordPiece tokenizer over a small
vocabulary, and the sentence-transformers files of a pooled, normalized model (all-MiniLM's
modules). Its reference is sentence-transformers' own encode (tests/helpers/embedding.py)."""

from __future__ import annotations

import json
import string
from pathlib import Path

WORDS = (
    "the capital of france is paris on seine bananas are rich in potassium which river runs"
    " through long word"
).split()
CONTEXT = 64  # max_position_embeddings


def encoder_model_dir(
    out: Path, pooling: str = "mean_tokens", seed: int = 1234, family: str = "bert"
) -> Path:
    """The directory: `pooling` sentence-transformers' mode (mean_tokens, cls_token), then
    Normalize. `family` xlm-roberta: an XLM-R model (BERT's tokenizer, whose [PAD] is its
    pad_token_id; its positions count from after it, so CONTEXT + 1 of them)."""
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        BertTokenizerFast,
        XLMRobertaConfig,
        XLMRobertaModel,
    )

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*string.ascii_lowercase, *string.digits, *".,!?;:'\"()-"]
    vocab = special + pieces + WORDS + ["##" + c for c in string.ascii_lowercase]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(
        vocab_file=str(out / "vocab.txt"), do_lower_case=True, model_max_length=CONTEXT
    )
    tok.save_pretrained(out)
    shape = {"vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
    torch.manual_seed(seed)
    if family == "xlm-roberta":
        xlmr = XLMRobertaConfig(**shape, max_position_embeddings=CONTEXT + 1, pad_token_id=0)
        XLMRobertaModel(xlmr).eval().save_pretrained(out, safe_serialization=True)
    else:
        bert = BertConfig(**shape, max_position_embeddings=CONTEXT)
        BertModel(bert).eval().save_pretrained(out, safe_serialization=True)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    listed = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{k}"}
              for i, (path, k) in enumerate(modules)]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(listed))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    pool = {f"pooling_mode_{m}": m == pooling for m in modes}
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, **pool})
    )
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": CONTEXT, "do_lower_case": False})
    )
    return out
