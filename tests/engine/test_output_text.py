"""What a finished sequence's text holds: the token that stopped it is not text (vLLM's rule)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stop_token_is_left_out_of_the_text_unless_asked_for(tiny_model_dir, skip_special_tokens):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    decode = llm.tokenizer.decode
    # tokens that are whole characters, so text and decoded ids compare exactly
    printable = [i for i in range(3, len(llm.tokenizer)) if decode([i]).isascii() and decode([i]).isprintable()]
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                 allowed_token_ids=printable), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free[6]
    cut = free.index(stop_id) + 1  # it may come earlier too
    for include, text_ids in ((False, free[:cut - 1]), (True, free[:cut])):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id],
                                                    allowed_token_ids=printable, skip_special_tokens=skip_special_tokens,
                                                    include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == free[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id
        assert out.text == decode(text_ids, skip_special_tokens=skip_special_tokens)
    # EOS too: a special token, shown by skip_special_tokens=False anywhere but at the end
    eos = llm.tokenizer.eos_token_id
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[eos],
                                                allowed_token_ids=[eos], skip_special_tokens=skip_special_tokens),
                       use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [eos] and out.text == ""


def _write_sentencepiece_style_tokenizer(dest) -> None:
    """A Metaspace tokenizer as Llama 2 / Mistral ship them: its decoder drops the space of the ▁
    that begins a sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog."] * 20,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(dest)


def test_the_first_output_word_keeps_its_space_after_the_prompt(tiny_model_dir, tmp_path):
    """Text is decoded after the prompt's last tokens, as vLLM does: a SentencePiece "▁world"
    following "Hello" is " world" (decoded alone, the decoder drops that space)."""
    _write_sentencepiece_style_tokenizer(tmp_path / "sp")
    llm = LLM(str(tiny_model_dir), tokenizer=str(tmp_path / "sp"), dtype="float32", max_model_len=64)
    tok = llm.tokenizer
    prompt = tok.encode("Hello", add_special_tokens=False)
    words = [i for w, i in tok.get_vocab().items() if w.startswith("▁") and w[1:].isalpha()]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, allowed_token_ids=words),
                       use_tqdm=False)[0].outputs[0]
    assert tok.decode(out.token_ids)[0] != " "  # what decoding the output alone gives
    assert out.text[0] == " " and out.text == tok.decode(prompt + list(out.token_ids))[len(tok.decode(prompt)):]
