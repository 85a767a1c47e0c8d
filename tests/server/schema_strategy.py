"""Hypothesis strategies from a pydantic model's JSON schema (the subset pydantic emits).

Values are schema-valid in *type*; numbers reach past the semantic limits (negative
max_tokens, huge n, out-of-vocabulary token ids) on purpose, since those are the server's
job to reject.
"""

from __future__ import annotations

from hypothesis import strategies as st

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def from_model_schema(schema: dict) -> st.SearchStrategy:
    """A strategy for request bodies matching `schema` (as from `Model.model_json_schema()`)."""
    return _node(schema, schema.get("$defs", {}))


def _node(node: dict, defs: dict) -> st.SearchStrategy:
    if "$ref" in node:
        return st.deferred(lambda: _node(defs[node["$ref"].rsplit("/", 1)[-1]], defs))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([_node(option, defs) for option in node[key]])
    kind = node.get("type")
    if kind == "object":
        return _object(node, defs)
    if kind == "array":
        low = node.get("minItems", 0)
        return st.lists(_node(node.get("items", {}), defs), min_size=low, max_size=max(low, node.get("maxItems", low + 4)))
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        low = node.get("minimum")
        small = st.integers(min_value=-5 if low is None else low, max_value=40)
        return small | st.integers(min_value=low)
    if kind == "number":
        return st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def _object(node: dict, defs: dict) -> st.SearchStrategy:
    properties = node.get("properties", {})
    required = set(node.get("required", ()))
    if not properties:
        extra = node.get("additionalProperties")
        values = _node(extra, defs) if isinstance(extra, dict) else ANY_JSON
        return st.dictionaries(st.text(max_size=12), values, max_size=4)

    @st.composite
    def build(draw) -> dict:
        body = {}
        for name, schema in properties.items():
            if name in required or draw(st.booleans()):
                body[name] = draw(_node(schema, defs))
        return body

    return build()
