"""Calibration JSONL: validation with line numbers, rendering, seeded sampling, truncation."""

from __future__ import annotations

import json

import pytest
import torch

from calibration.data import (
    CalibrationDataError,
    RecordKind,
    load_calibration_set,
    read_records,
    tokenize_record,
)
from tests.calibration.factories import write_calib_file, write_jsonl


def _load(path, tokenizer, **overrides):
    kwargs = dict(num_samples=4, max_seq_len=64, seed=0, allow_few=False, num_heldout=2)
    kwargs.update(overrides)
    return load_calibration_set(path, tokenizer, **kwargs)


@pytest.mark.parametrize(("bad_line", "reason"), [
    ('{"text": "unterminated', "not valid JSON"),
    ('["a list"]', "JSON list"),
    ('{"txt": "typo"}', "no recognised key"),
    ('{"text": ""}', '"text" is not a non-empty string'),
    ('{"text": 7}', '"text" is not a non-empty string'),
    ('{"messages": []}', '"messages" is not a non-empty list'),
    ('{"messages": [{"role": "user"}]}', '"messages"[0]'),
    ('{"prompt": "p"}', '"prompt" and "completion" must both be strings'),
])
def test_malformed_line_names_file_line_and_expectation(tmp_path, bad_line, reason):
    path = write_jsonl(tmp_path / "calib.jsonl", [{"text": "fine"}, "", bad_line, {"text": "fine"}])
    with pytest.raises(CalibrationDataError) as info:
        read_records(path)
    message = str(info.value)
    assert f"{path}:3:" in message  # line numbers count blank lines too: they are what an editor shows
    assert reason in message
    assert "expected" in message


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(CalibrationDataError, match="empty"):
        read_records(path)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(CalibrationDataError, match="not found"):
        read_records(tmp_path / "nope.jsonl")


def test_messages_win_over_text_and_extra_keys_are_ignored(tmp_path):
    row = {"id": 3, "text": "plain", "messages": [{"role": "user", "content": "hi"}]}
    [record] = read_records(write_jsonl(tmp_path / "c.jsonl", [row]))
    assert record.kind is RecordKind.MESSAGES and record.line_no == 1


def test_each_shape_renders_as_documented(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"text": "The quick brown fox."},
        {"prompt": "What is the capital of France?", "completion": " Paris."},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    ])
    text, pair, chat = (tokenize_record(r, tiny_tokenizer, 512) for r in read_records(path))
    assert tiny_tokenizer.decode(text) == "The quick brown fox."
    assert tiny_tokenizer.decode(pair) == "What is the capital of France? Paris."
    expected_chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert tiny_tokenizer.decode(chat) == expected_chat
    assert chat[0].item() == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_messages_without_chat_template_is_an_error(tmp_path, tiny_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"messages": [{"role": "user", "content": "b"}]}])
    monkeypatch.setattr(tiny_tokenizer, "chat_template", None)
    with pytest.raises(CalibrationDataError, match=r":2: .*chat template"):
        _load(path, tiny_tokenizer, num_samples=2, num_heldout=0)


def test_a_chat_template_refusing_a_conversation_names_the_line(tmp_path, tiny_tokenizer, monkeypatch):
    """Templates such as Llama 2's and Mistral's raise on two user turns in a row: the file and line,
    with the template's reason, not a jinja traceback."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"messages": [{"role": "user", "content": "b"},
                                                                           {"role": "user", "content": "c"}]}])
    strict = ("{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    monkeypatch.setattr(tiny_tokenizer, "chat_template", strict)
    with pytest.raises(CalibrationDataError, match=r"c\.jsonl:2: .*chat template.*roles must alternate"):
        _load(path, tiny_tokenizer, num_samples=2, num_heldout=0)


def test_line_separators_inside_strings_do_not_split_lines(tmp_path, tiny_tokenizer):
    """U+2028, U+2029 and U+0085 may stand unescaped in a JSON string (json.dumps with
    ensure_ascii=False writes them so); only a newline ends a line."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"one{sep}two"}, ensure_ascii=False) + "\n"
                            for sep in ("\u2028", "\u2029", "\x85")), encoding="utf-8")
    assert [(r.line_no, r.text) for r in read_records(path)] == [
        (1, "one\u2028two"), (2, "one\u2029two"), (3, "one\x85two")]


def test_truncates_to_max_seq_len(tmp_path, tiny_tokenizer):
    path = write_calib_file(tmp_path / "c.jsonl", 8)
    calib = _load(path, tiny_tokenizer, num_samples=8, max_seq_len=5, num_heldout=0)
    assert max(s.numel() for s in calib.samples) == 5
    assert calib.num_tokens == sum(s.numel() for s in calib.samples)


def test_sampling_is_deterministic_per_seed(tmp_path, tiny_tokenizer):
    path = write_calib_file(tmp_path / "c.jsonl", 40)

    def drawn(seed):
        return [s.tolist() for s in _load(path, tiny_tokenizer, num_samples=10, seed=seed).samples]

    assert drawn(0) == drawn(0)
    assert drawn(0) != drawn(1)


def test_heldout_is_disjoint_from_calibration_when_lines_are_spare(tmp_path, tiny_tokenizer):
    path = write_calib_file(tmp_path / "c.jsonl", 12)
    calib = _load(path, tiny_tokenizer, num_samples=9, num_heldout=5)
    assert len(calib.samples) == 9 and len(calib.heldout) == 3  # only 3 lines were spare
    assert calib.is_heldout_disjoint
    calibrated = {tuple(s.tolist()) for s in calib.samples}
    assert not calibrated & {tuple(h.tolist()) for h in calib.heldout}
    assert calib.num_records == 12 and len(calib.sha256) == 64


def test_heldout_falls_back_to_calibration_samples_and_says_so(tmp_path, tiny_tokenizer):
    path = write_calib_file(tmp_path / "c.jsonl", 4)
    calib = _load(path, tiny_tokenizer, num_samples=4, num_heldout=2)
    assert len(calib.heldout) == 2 and not calib.is_heldout_disjoint


def test_too_few_samples_is_an_error_unless_allowed(tmp_path, tiny_tokenizer):
    path = write_calib_file(tmp_path / "c.jsonl", 3)
    with pytest.raises(CalibrationDataError, match="3 usable samples, fewer than --num-samples 8"):
        _load(path, tiny_tokenizer, num_samples=8)
    with pytest.warns(UserWarning, match="--allow-few"):
        calib = _load(path, tiny_tokenizer, num_samples=8, allow_few=True)
    assert len(calib.samples) == 3
    assert all(s.dtype == torch.long for s in calib.samples)
