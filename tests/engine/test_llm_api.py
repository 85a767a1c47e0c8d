"""The offline `LLM` takes what vLLM scripts pass it, answers as vLLM does, and survives their mistakes."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.beam_search import BeamSearchParams
from engine.loader import resolve_dtype

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, num_kv_blocks=64)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert not llm.engine.requests and stats.num_running == stats.num_waiting == stats.num_blocks_used == 0


def test_a_step_that_fails_leaves_the_engine_empty_and_serving(llm, monkeypatch):
    expected = llm.generate([PROMPT], greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    for error in (RuntimeError("kernel failed"), KeyboardInterrupt()):
        def fail(*_args, error=error):
            raise error
        with monkeypatch.context() as patch:
            patch.setattr(llm.engine.runner, "execute", fail)
            with pytest.raises(type(error)):
                llm.generate([PROMPT, [9, 10]], greedy(max_tokens=4), use_tqdm=False)
        assert_idle(llm)
        assert llm.generate([PROMPT], greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": "abc"}, "seed must be an integer"),
    ({"n": 1.5}, "n must be an integer"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"top_p": "0.5"}, "top_p must be a finite number"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids must be token ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or at least 1"),
    ({"seed": 2**63}, "seed must fit"),
])
def test_wrong_types_and_values_are_refused_when_the_params_are_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_stop_token_id_outside_the_vocabulary_is_refused_before_it_runs(llm):
    with pytest.raises(ValueError, match="stop_token_ids token id 1000000 is outside the vocabulary"):
        llm.generate([PROMPT], greedy(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    assert_idle(llm)


def test_a_batch_refused_for_any_error_queues_none_of_it(llm, monkeypatch):
    calls = []

    def fail_second(*args, original=llm.engine.make_request):
        calls.append(args)
        if len(calls) == 2:
            raise TypeError("unforeseen")
        return original(*args)
    monkeypatch.setattr(llm.engine, "make_request", fail_second)
    with pytest.raises(TypeError):
        llm.generate([PROMPT, PROMPT], greedy(max_tokens=2), use_tqdm=False)
    assert_idle(llm)


def test_a_stop_string_completed_by_the_last_allowed_token_stops_it(llm):
    """The length limit's token still ends the text at a stop string it completes (vLLM)."""
    decode = llm.tokenizer.decode
    # tokens that are whole characters, so text and decoded ids compare exactly
    printable = [i for i in range(3, len(llm.tokenizer)) if decode([i]).isascii() and decode([i]).isprintable()]
    free = llm.generate([PROMPT], greedy(max_tokens=12, ignore_eos=True, allowed_token_ids=printable),
                        use_tqdm=False)[0].outputs[0].token_ids
    checked = 0
    for n in range(2, len(free) + 1):
        before, text = decode(free[:n - 1]), decode(free[:n])
        stop = text[len(before) - 1:] if before and len(text) > len(before) else ""
        if not stop or text.find(stop) != len(before) - 1:
            continue  # this token adds no text, or the string would stop it earlier
        out = llm.generate([PROMPT], greedy(max_tokens=n, ignore_eos=True, stop=[stop], allowed_token_ids=printable),
                           use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text[:len(before) - 1])
        assert out.token_ids == free[:n]
        checked += 1
    assert checked, "no token of the greedy output could end a stop string"


def test_stop_reason_names_a_stop_token_but_not_the_end_of_sequence(llm):
    eos = llm.tokenizer.eos_token_id
    out = llm.generate([PROMPT], greedy(max_tokens=4, allowed_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    # with ignore_eos, EOS ends it only as a stop token the request names
    out = llm.generate([PROMPT], greedy(max_tokens=4, allowed_token_ids=[eos], ignore_eos=True,
                                        stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", eos)


def test_cumulative_logprob_is_the_sum_of_the_chosen_tokens_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(seed=3, max_tokens=6, logprobs=0), use_tqdm=False)[0].outputs[0]
    chosen = [entry[token] for entry, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-6) and out.cumulative_logprob < 0
    plain = llm.generate([PROMPT], SamplingParams(seed=3, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.token_ids == out.token_ids


def test_prompts_as_vllm_dicts(llm):
    text = "hello world"
    by_text = llm.generate(text, greedy(max_tokens=4), use_tqdm=False)[0]
    by_dict = llm.generate({"prompt": text}, greedy(max_tokens=4), use_tqdm=False)[0]
    by_ids = llm.generate([{"prompt_token_ids": by_text.prompt_token_ids}], greedy(max_tokens=4), use_tqdm=False)[0]
    assert by_dict.prompt == text and by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"text": text}, use_tqdm=False)


def test_max_tokens_none_generates_to_the_end_of_the_context(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=None, ignore_eos=True, stop_token_ids=None),
                       use_tqdm=False)[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == 64 and out.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    prompt = list(range(5, 45))
    out = llm.generate([prompt], greedy(max_tokens=2, truncate_prompt_tokens=6), use_tqdm=False)[0]
    alone = llm.generate([prompt[-6:]], greedy(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-6:] and out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_options_after_the_params_are_keyword_only(llm):
    with pytest.raises(TypeError):
        llm.generate([PROMPT], greedy(max_tokens=2), True, None)  # vLLM's generate takes them by name


def test_vllm_engine_arguments_that_change_nothing_here_are_taken(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True,
              swap_space=4, disable_log_stats=True, quantization=None, dtype="float", seed=None, max_model_len=32)
    assert next(llm.engine.model.parameters()).dtype is torch.float32
    assert len(llm.generate([PROMPT], greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 2: a model runs whole on one device"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size 4"),
    ({"quantization": "fp8"}, "quantization fp8: driftgate does not quantize at load; .* is unquantized"),
])
def test_vllm_engine_arguments_this_engine_cannot_honour_say_what_to_do(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir), **kwargs)


def test_a_model_path_under_home_is_expanded(tiny_model_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    monkeypatch.setenv("HOME", str(tmp_path))
    llm = LLM("~/models/tiny", max_model_len=32)
    assert llm.engine.config.model == str(tmp_path / "models" / "tiny")


def test_half_is_float16():
    assert resolve_dtype("half") is torch.float16 and resolve_dtype("float") is torch.float32


def test_chat_takes_vllms_arguments(llm):
    conversation = [{"role": "user", "content": "hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    out = llm.chat(conversation, greedy(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt == llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    joined = llm.chat(parts, greedy(max_tokens=3), use_tqdm=False)[0]
    assert joined.prompt == out.prompt.replace("hi there", "hi\nthere")
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ tools | length }}{{ flavour }}"
    custom = llm.chat(conversation, greedy(max_tokens=3), use_tqdm=False, chat_template=template,
                      tools=[{"type": "function", "function": {"name": "f"}}], chat_template_kwargs={"flavour": "!"})
    assert custom[0].prompt == "[user]hi there1!"
    answer = [*conversation, {"role": "assistant", "content": "Hel"}]
    continued = llm.chat(answer, greedy(max_tokens=3), use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)[0]
    assert continued.prompt.endswith("Hel")
    with pytest.raises(ValueError, match="content parts must be text"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat(conversation, chat_template="{{ raise_exception('no') }}", use_tqdm=False)
    assert_idle(llm)


def test_get_tokenizer(llm):
    assert llm.get_tokenizer() is llm.tokenizer


def test_beam_search_refuses_a_prompt_that_leaves_no_room_and_takes_dict_prompts(llm):
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.beam_search([list(range(5, 75))], BeamSearchParams(beam_width=2, max_tokens=4))
    by_ids = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    by_dict = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    assert [s.tokens for s in by_ids.sequences] == [s.tokens for s in by_dict.sequences]
    assert_idle(llm)


def test_logprobs_are_vllms_logprob_records_and_still_floats(llm):
    """`.logprob`, `.rank` (1 = the most probable in the whole vocabulary) and `.decoded_token`,
    as vLLM scripts read them, against a full-vocabulary scoring of the same tokens; arithmetic
    on the values stays plain float arithmetic."""
    out = llm.generate([PROMPT], SamplingParams(seed=1, max_tokens=4, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    tokens = PROMPT + completion.token_ids
    full = llm.score_full_logprobs(tokens)  # row t: log p(. | tokens[:t + 1])
    tokenizer = llm.get_tokenizer()
    entries = {len(PROMPT) - 1 + i: e for i, e in enumerate(completion.logprobs)}
    entries |= {p - 1: e for p, e in enumerate(out.prompt_logprobs) if e is not None}
    assert len(entries) == len(tokens) - 1
    for row, entry in entries.items():
        actual = entry[tokens[row + 1]]
        assert actual.logprob == float(actual) == pytest.approx(full[row, tokens[row + 1]].item(), abs=1e-4)
        assert actual.rank == int((full[row] > full[row, tokens[row + 1]]).sum()) + 1
        top = full[row].topk(len(entry) + 1).indices.tolist()
        for token, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens([token]))
            assert token == tokens[row + 1] or logprob.rank == top.index(token) + 1
    assert completion.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(
        completion.logprobs, completion.token_ids, strict=True)))


def test_detokenize_false_gives_token_ids_only(llm):
    plain = llm.generate([PROMPT], greedy(max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate([PROMPT], greedy(max_tokens=6, ignore_eos=True, detokenize=False),
                            use_tqdm=False)[0].outputs[0]
    assert ids_only.token_ids == plain.token_ids and ids_only.text == "" and plain.text
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
