"""One JSON object from text, with the error a user can act on: where the JSON breaks, or what it is instead.

Calibration files, batch files, gate prompt files and --speculative-config all take JSON objects
from users; each caller prefixes the message with where the text came from (a file and line, a flag).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def numbered_lines(path: Path, what: str, error: type[Exception] = ValueError) -> list[tuple[int, str]]:
    """A JSONL file's non-blank lines with their 1-based numbers; `error` says which file is missing
    or not UTF-8 (`what` names its role, e.g. "calibration file")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path} is a folder; give the {what} itself")
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    # lines end at "\n" only: str.splitlines() also breaks at U+2028, U+2029 and U+0085, which JSON
    # strings may hold unescaped (json.dumps(..., ensure_ascii=False) writes them so)
    return [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]


def parse_json_object(text: str) -> dict[str, Any]:
    """`text` as a dict, or ValueError: "not valid JSON (..., column N)" or "expected a JSON object, got a JSON list"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got a JSON {_json_kind(value)}")
    return value


def _json_kind(value: object) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def flag_json_object(name: str, value: str) -> dict[str, Any]:
    """A flag's JSON object (--hf-overrides, --override-generation-config), or ValueError naming the flag."""
    try:
        return parse_json_object(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}: {value!r}") from None
