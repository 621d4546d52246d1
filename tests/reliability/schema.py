"""The server's own OpenAPI schema as test input: its POST routes, their request-body schemas with
references resolved, and the smallest body each schema accepts. New endpoints are found here, so
fuzzing and limit tests cover them without new test code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import strategies as st


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    body_schema: dict[str, Any] | None  # self-contained (components attached), None: no body

    @property
    def properties(self) -> dict[str, Any]:
        return dict(resolve(self.body_schema or {}, self.body_schema or {}).get("properties", {}))


# The RL control plane (pause, resume, flush, sleep, wake, reload): each changes what every later
# request meets, so fuzzing them would pause the server under the other tests;
# tests/integration/test_control.py and tests/integration/test_sleep.py cover them, their
# refusals included.
CONTROL = frozenset(
    ["/pause", "/resume", "/pause_generation", "/continue_generation", "/flush_cache",
     "/reset_prefix_cache", "/sleep", "/wake_up", "/collective_rpc"]
)  # fmt: skip


def routes(base: str, headers: dict[str, str] | None = None) -> list[Route]:
    """Every (method, path) in the running server's /openapi.json, the control plane's aside."""
    spec = httpx.get(base + "/openapi.json", headers=headers or {}, timeout=30).json()
    components = spec.get("components", {})
    out = []
    for path, methods in sorted(spec["paths"].items()):
        if path in CONTROL:
            continue
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            schema = {**body["schema"], "components": components} if body else None
            out.append(Route(method.upper(), path, schema))
    return out


def resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def minimal_body(route: Route, model_name: str) -> dict[str, Any]:
    """Only the required fields, each with the simplest value its schema allows."""
    assert route.body_schema is not None
    body = _example(route.body_schema, route.body_schema)
    if "model" in route.properties:
        body["model"] = model_name
    return dict(body)


def _example(schema: dict[str, Any], root: dict[str, Any]) -> Any:
    schema = resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [s for s in schema[key] if resolve(s, root).get("type") != "null"]
            return _example(options[0], root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        return {k: _example(props[k], root) for k in schema.get("required", [])}
    if t == "array":
        return [_example(schema.get("items", {}), root)] * max(1, schema.get("minItems", 1))
    if t == "string":
        return "hi"
    if t in ("integer", "number"):
        return max(1, schema.get("minimum", 1))
    if t == "boolean":
        return False
    return None


def accepts_type(schema: dict[str, Any], root: dict[str, Any], type_: str) -> bool:
    """Whether a property's schema allows values of a JSON type (through anyOf)."""
    schema = resolve(schema, root)
    options = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return any(resolve(s, root).get("type") == type_ for s in options)


# ---- hypothesis strategies from a schema --------------------------------------------------------
def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value, NaN and Infinity included (json.dumps writes them as bare literals)."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(
        leaves,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=max_leaves,
    )


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values a JSON schema accepts (the subset pydantic writes: objects, arrays, anyOf, enum,
    const, strings, bounded numbers, booleans, null)."""
    schema = resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "object":
        return _object(schema, root)
    if t == "array":
        lo = schema.get("minItems", 0)
        return st.lists(
            from_schema(schema.get("items", {}), root), min_size=lo, max_size=max(lo, 3)
        )
    if t == "string":
        return st.text(max_size=30)
    if t == "integer":
        lo, hi = _bounds(schema)
        return st.integers(
            min_value=None if lo is None else int(lo) + ("exclusiveMinimum" in schema),
            max_value=None if hi is None else int(hi) - ("exclusiveMaximum" in schema),
        )
    if t == "number":
        lo, hi = _bounds(schema)
        return st.floats(
            min_value=lo,
            max_value=hi,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return json_values()


def _bounds(schema: dict[str, Any]) -> tuple[float | None, float | None]:
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    return lo, hi


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    fixed = st.fixed_dictionaries(
        {k: from_schema(v, root) for k, v in props.items() if k in required},
        optional={k: from_schema(v, root) for k, v in props.items() if k not in required},
    )
    extra = schema.get("additionalProperties", False)
    if extra is False:
        return fixed
    values = json_values(6) if extra is True else from_schema(extra, root)
    more = st.dictionaries(st.text(max_size=8), values, max_size=3)
    return st.tuples(more, fixed).map(lambda pair: {**pair[0], **pair[1]})
