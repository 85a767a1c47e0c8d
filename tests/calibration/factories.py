"""Calibration-file factories for the calibration tests."""

from __future__ import annotations

import json
from pathlib import Path

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler admits waiting requests while running ones decode.",
    "Quantization maps weights to fewer bits with a scale per group.",
    "What is the capital of France? Paris is the capital of France.",
]


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows as JSONL; a ``str`` row is written verbatim (for malformed-line tests)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_calib_file(path: Path, num_lines: int) -> Path:
    """A valid file mixing all three line shapes, each line distinct and a few sentences long."""
    rows: list[dict] = []
    for i in range(num_lines):
        body = " ".join(_SENTENCES[(i + j) % len(_SENTENCES)] for j in range(1 + i % 4)) + f" {i}"
        if i % 3 == 0:
            rows.append({"text": body})
        elif i % 3 == 1:
            rows.append({"messages": [{"role": "user", "content": f"Question {i}?"},
                                      {"role": "assistant", "content": body}]})
        else:
            rows.append({"prompt": f"Prompt {i}:", "completion": " " + body})
    return write_jsonl(path, rows)
