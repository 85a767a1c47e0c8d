"""Read, validate, sample and tokenize a calibration JSONL file.

Every line is validated before anything is tokenized or the model is touched, so a typo on
line 9000 fails in milliseconds with its line number instead of after an hour of calibration.

Accepted line shapes (extra keys such as ``id`` are ignored):

- ``{"messages": [{"role": ..., "content": ...}, ...]}`` — rendered with the model's chat template;
- ``{"prompt": ..., "completion": ...}`` — concatenated as-is (completion-style pairs carry their
  own leading whitespace);
- ``{"text": ...}``.

When a line holds several shapes the first in that order wins: the shared calibration sets carry
both ``messages`` and a plain ``text`` copy, and an instruct model should be calibrated on the
text it will actually serve, which is the chat-rendered form.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.file_hash import file_sha256
from engine.json_object import numbered_lines, parse_json_object


class CalibrationDataError(ValueError):
    """The calibration file cannot be used; the message names the file and, where it applies, the line."""


class RecordKind(Enum):
    """Which JSONL shape a line used."""

    MESSAGES = "messages"
    PROMPT_COMPLETION = "prompt_completion"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    """One validated line, not yet rendered or tokenized."""

    line_no: int
    kind: RecordKind
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(slots=True)
class CalibrationSet:
    """Token ids to calibrate on, plus disjoint held-out samples for the error report."""

    path: Path
    sha256: str
    num_records: int
    samples: list[torch.Tensor]  # each [num_tokens] int64
    heldout: list[torch.Tensor]  # each [num_tokens] int64
    is_heldout_disjoint: bool

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.samples)


class Tokenizer(Protocol):
    """The slice of a HF tokenizer this module uses."""

    chat_template: str | None

    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...

    def apply_chat_template(self, messages: list[dict[str, str]], *, tokenize: bool) -> str: ...


_EXPECTED = ('a JSON object with "messages" (list of {"role", "content"} strings), '
             '"prompt" and "completion" (strings), or "text" (string)')


def _parse_line(raw: str, path: Path, line_no: int) -> CalibrationRecord:
    def fail(what: str) -> CalibrationDataError:
        return CalibrationDataError(f"{path}:{line_no}: {what}; expected {_EXPECTED}")

    try:
        obj = parse_json_object(raw)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise fail('"messages" is not a non-empty list')
        for i, message in enumerate(messages):
            if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                    or not isinstance(message.get("content"), str)):
                raise fail(f'"messages"[{i}] is not an object with string "role" and "content"')
        return CalibrationRecord(line_no, RecordKind.MESSAGES,
                                 messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))
    if "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise fail('"prompt" and "completion" must both be strings')
        if not prompt + completion:
            raise fail('"prompt" and "completion" are both empty')
        return CalibrationRecord(line_no, RecordKind.PROMPT_COMPLETION, text=prompt + completion)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise fail('"text" is not a non-empty string')
        return CalibrationRecord(line_no, RecordKind.TEXT, text=obj["text"])
    raise fail(f"no recognised key among {sorted(obj)}")


def read_records(path: Path) -> list[CalibrationRecord]:
    """Validate every line of ``path``; blank lines are skipped, anything else malformed raises."""
    path = Path(path)
    records = [_parse_line(raw, path, i) for i, raw in numbered_lines(path, "calibration file", CalibrationDataError)]
    if not records:
        raise CalibrationDataError(f"{path}: no calibration samples (the file is empty)")
    return records


def tokenize_record(record: CalibrationRecord, tokenizer: Tokenizer, max_seq_len: int) -> torch.Tensor:
    """Render one record to token ids ``[num_tokens]``, truncated to ``max_seq_len``.

    A chat template already writes its own special tokens, so rendered messages are tokenized
    without adding more; plain text gets the tokenizer's usual BOS handling.
    """
    if record.kind is RecordKind.MESSAGES:
        text = tokenizer.apply_chat_template(list(record.messages or ()), tokenize=False)
        add_special_tokens = False
    else:
        text, add_special_tokens = record.text or "", True
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return torch.tensor(ids[:max_seq_len], dtype=torch.long)


def _tokenize_line(path: Path, record: CalibrationRecord, tokenizer: Tokenizer, max_seq_len: int) -> torch.Tensor:
    """tokenize_record, with a chat template's refusal (roles must alternate, say) named by file and line."""
    try:
        return tokenize_record(record, tokenizer, max_seq_len)
    except Exception as exc:  # jinja's raise_exception and friends: the template's words say why
        if record.kind is not RecordKind.MESSAGES:
            raise
        raise CalibrationDataError(f"{path}:{record.line_no}: the chat template failed on \"messages\": {exc}") from None


def load_calibration_set(
    path: Path,
    tokenizer: Tokenizer,
    *,
    num_samples: int,
    max_seq_len: int,
    seed: int,
    allow_few: bool,
    num_heldout: int,
) -> CalibrationSet:
    """Validate ``path``, draw ``num_samples`` calibration and ``num_heldout`` held-out samples, tokenize them.

    The draw is a seeded shuffle of all valid lines, so the same seed gives the same samples.
    Held-out samples come from lines not used for calibration (as many as are spare, up to
    ``num_heldout``); only when no line is spare are they taken from the calibration samples,
    and the set says so.
    """
    if num_samples < 1 or max_seq_len < 1 or num_heldout < 0:
        raise ValueError("num_samples and max_seq_len must be positive, num_heldout non-negative")
    path = Path(path)
    records = read_records(path)
    if any(r.kind is RecordKind.MESSAGES for r in records) and not getattr(tokenizer, "chat_template", None):
        first = next(r for r in records if r.kind is RecordKind.MESSAGES)
        raise CalibrationDataError(f"{path}:{first.line_no}: \"messages\" needs a chat template, "
                                   "and the model's tokenizer has none")
    if len(records) < num_samples:
        message = f"{path}: {len(records)} usable samples, fewer than --num-samples {num_samples}"
        if not allow_few:
            raise CalibrationDataError(message + " (pass --allow-few to calibrate on them anyway)")
        warnings.warn(message + "; calibrating on all of them (--allow-few)", stacklevel=2)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    chosen, spare = order[:num_samples], order[num_samples:]
    heldout_ids = spare[:num_heldout]
    is_disjoint = bool(heldout_ids) or num_heldout == 0
    if not is_disjoint:
        heldout_ids = chosen[-num_heldout:]
    samples = [_tokenize_line(path, records[i], tokenizer, max_seq_len) for i in chosen]
    if any(s.numel() == 0 for s in samples):
        empty = next(records[i].line_no for i, s in zip(chosen, samples, strict=True) if s.numel() == 0)
        raise CalibrationDataError(f"{path}:{empty}: tokenizes to no tokens")
    heldout = [_tokenize_line(path, records[i], tokenizer, max_seq_len) for i in heldout_ids]
    return CalibrationSet(path=path, sha256=file_sha256(path), num_records=len(records),
                          samples=samples, heldout=[h for h in heldout if h.numel()],
                          is_heldout_disjoint=is_disjoint)
