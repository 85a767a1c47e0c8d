"""Logprob entries name tokens as OpenAI clients read them: `bytes` are each token's own bytes
(a character split over tokens has its bytes split too, so they join back into the text) and
completions' `text_offset` indexes the text (a split character counts where it completes)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from server.logprobs import TokenText, chat_logprobs, completion_logprobs, token_namer
from tests.helpers import write_tiny_tokenizer
from tests.server.conftest import MODEL_NAME

TEXT = "Hi 中文😀 é, ok"


def _byte_fallback_tokenizer(dest):
    """A SentencePiece-style BPE (Llama 2, Mistral, Gemma): unknown characters as <0xNN> bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                 prepend_scheme="first")])
    trainer = trainers.BpeTrainer(vocab_size=80, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]])
    tok.train_from_iterator(["Hi there, ok then. é"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(dest)
    return AutoTokenizer.from_pretrained(dest)


@pytest.fixture(scope="module", params=["byte-level", "byte-fallback"])
def tokenizer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "byte-fallback":
        return _byte_fallback_tokenizer(folder)
    write_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_token_bytes_join_into_the_text_where_characters_split(tokenizer):
    names = token_namer(TokenText(tokenizer), as_ids=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [names(t) for t in ids]
    assert "\ufffd" in "".join(pieces)  # some character is split: alone, its pieces do not decode
    content = chat_logprobs(names, ids, [{t: -1.0} for t in ids], top_n=1).content
    assert bytes(b for entry in content for b in entry.bytes).decode().strip() == TEXT
    assert all(entry.bytes == entry.top_logprobs[0].bytes for entry in content)


def test_text_offsets_index_the_text(tokenizer):
    """The text as the engine returns it after a prompt (SentencePiece's first "▁Hi" is " Hi" there)."""
    prompt, ids = tokenizer.encode("ok", add_special_tokens=False), tokenizer.encode(TEXT, add_special_tokens=False)
    text = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
    offsets = completion_logprobs(token_namer(TokenText(tokenizer), as_ids=False), ids, [None] * len(ids),
                                  0).text_offset
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert "".join(text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)) == text


def test_an_echoed_prompt_that_splits_characters_keeps_its_offsets_inside_the_text(base_url):
    body = {"model": MODEL_NAME, "prompt": TEXT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0}
    choice = httpx.post(base_url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    offsets, text = choice["logprobs"]["text_offset"], choice["text"]
    assert text.startswith(TEXT) and offsets[0] == 0 and max(offsets) <= len(text)
    assert offsets[len(offsets) - 1] == len(TEXT)  # the generated token starts where the prompt ends


def test_special_tokens_count_where_the_output_shows_them(tmp_path):
    """With skip_special_tokens off the text holds a special token's text, and the offsets after it
    move past it; with it on (the default) the text has none of it."""
    write_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    names = token_namer(TokenText(tokenizer), as_ids=False)
    ids = tokenizer.encode("ok<|im_end|>then", add_special_tokens=False)
    for skip in (True, False):
        text = tokenizer.decode(ids, skip_special_tokens=skip)
        offsets = completion_logprobs(names, ids, [None] * len(ids), 0, skip_special_tokens=skip).text_offset
        assert "".join(text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)) == text
        assert offsets[-1] == len(text) - len(tokenizer.decode(ids[-1:]))
