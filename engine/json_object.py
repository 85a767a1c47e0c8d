"""One JSON object from text, with the error a user can act on: where the JSON breaks, or what it is instead.

Calibration files, batch files and --speculative-config all take JSON objects from users; each
caller prefixes the message with where the text came from (a file and line, a flag).
"""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(text: str) -> dict[str, Any]:
    """`text` as a dict, or ValueError: "not valid JSON (... at column N)" or "expected a JSON object, got a JSON list"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got a JSON {_json_kind(value)}")
    return value


def _json_kind(value: object) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
