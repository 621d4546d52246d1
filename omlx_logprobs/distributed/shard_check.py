"""Whether mlx-lm's tensor-parallel split of a model divided every dimension it cut.

A family's `shard` slices each projection's rows or columns over the group and divides the
layer's head counts with `//`. mlx's slicing of a projection raises when its size does not
divide, but a head count does not: SmolLM2's 9 query heads and 3 KV heads over 2 processes
leave each process 4 heads and 1 KV head over projection slices of 4.5 and 1.5 heads' width,
and the first forward fails inside attention on every rank (or computes something else).

What each family divides is its own mlx-lm code's to say (query and KV heads, MLA heads,
output groups, an indexer's heads, expert MLPs' columns), so the split is checked where it
happens rather than from a table: every integer attribute of the model's modules is read
before and after `shard`, and one that went from v to v // n with a remainder is a dimension
the group size does not divide. A family added to mlx-lm is checked the same way."""

from __future__ import annotations

from typing import Any

# Module attributes named otherwise than the config.json field they come from.
CONFIG_NAMES = {
    "n_heads": "num_attention_heads",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
}
# config.json fields a projection's split cuts (experts' MLPs are cut by their columns, the
# moe_intermediate_size): named when mlx refuses a slice.
_CUT_FIELDS = ("heads", "intermediate_size")


def shard(net: Any, group: Any) -> str | None:
    """Split `net` over `group` with its family's `shard`; why the split is wrong for this
    group size (a sentence naming each dimension), or None when every dimension divided.
    After a refusal `net` is partly split: load it again to use it."""
    n = group.size()
    before = _integers(net)
    try:
        net.shard(group)
    except Exception as exc:  # noqa: BLE001  (mlx's split of a projection, an mlx-lm assert)
        fields = undivided_fields(net, n)
        if fields:
            return f"{needs(n, fields)} (mlx: {exc})"
        return f"tensor parallel over {n} ranks cannot split this model's weights: {exc}"
    after = _integers(net)
    cut: dict[str, int] = {}
    for (path, name), value in before.items():
        if value % n and after.get((path, name)) == value // n:
            cut.setdefault(config_name(net, name), value)
    return needs(n, cut) if cut else None


def needs(n: int, fields: dict[str, int]) -> str:
    """The refusal's sentence: 'tensor parallel over 2 ranks needs num_attention_heads (9) and
    num_key_value_heads (3) divisible by 2'."""
    each = [f"{k} ({v})" for k, v in fields.items()]
    named = ", ".join(each[:-1]) + " and " + each[-1] if len(each) > 1 else each[0]
    return f"tensor parallel over {n} ranks needs {named} divisible by {n}"


def undivided_fields(net: Any, n: int) -> dict[str, int]:
    """The config fields of the kinds a split cuts (heads, MLP widths) that `n` does not
    divide."""
    return {
        k: v
        for k, v in _config(net).items()
        if type(v) is int and v % n and any(f in k for f in _CUT_FIELDS)
    }


def config_name(net: Any, attribute: str) -> str:
    """The config.json field a module's attribute holds (the attribute's own name when the
    config has one so named)."""
    if attribute in _config(net):
        return attribute
    return CONFIG_NAMES.get(attribute, attribute)


def _config(net: Any) -> dict[str, Any]:
    """The model's config fields, a multimodal family's text model's among them."""
    args = getattr(net, "args", None)
    fields = dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}
    text = fields.get("text_config")
    if isinstance(text, dict):
        fields.update(text)
    elif text is not None and hasattr(text, "__dict__"):
        fields.update(vars(text))
    return fields


def _integers(net: Any) -> dict[tuple[str, str], int]:
    # Attributes that are not arrays nor modules live in each module's __dict__.
    return {
        (path, name): value
        for path, module in net.named_modules()
        for name, value in vars(module).items()
        if type(value) is int
    }
