"""Structured outputs: every output matches its constraint, sequences keep their own matchers."""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputs

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)


def _generate(llm, constraint: StructuredOutputs | None, n: int = 1, temperature: float = 0.0, max_tokens: int = 48):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=3, structured_outputs=constraint)
    return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_choice_regex_and_grammar(llm, temperature):
    for constraint, accepts in [
        (StructuredOutputs(choice=["yes", "no", 'say "maybe"']), lambda t: t in ("yes", "no", 'say "maybe"')),
        (StructuredOutputs(regex=r"[0-9]{3}-(ab|cd)"), lambda t: re.fullmatch(r"[0-9]{3}-(ab|cd)", t)),
        (StructuredOutputs(grammar='root ::= "x" yz yz "."\nyz ::= "y" | "z"'), lambda t: re.fullmatch(r"x[yz]{2}\.", t)),
    ]:
        for out in _generate(llm, constraint, n=3, temperature=temperature):
            assert accepts(out.text) and out.finish_reason == "stop", (constraint.kind, out.text)


def test_a_complete_grammar_ends_the_output_before_min_tokens(llm):
    """min_tokens bans the stop tokens; once the grammar allows nothing else it wins, instead of
    the row sampling from an empty distribution (tokens outside the grammar, then a late stop)."""
    choice = StructuredOutputs(choice=["yes", "no"])
    plain = _generate(llm, choice)[0]
    params = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=len(plain.token_ids) + 10,
                            structured_outputs=choice)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (plain.text, plain.token_ids, "stop")


def test_a_complete_grammar_ends_the_output_under_ignore_eos_too(llm):
    """ignore_eos (benchmark clients send it) would otherwise let the sequence run on past its
    grammar, unconstrained ('no\nassistant\nThe answer is no...')."""
    for constraint in (StructuredOutputs(choice=["yes", "no"]), StructuredOutputs(regex="(yes|no)")):
        plain = _generate(llm, constraint)[0]
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, structured_outputs=constraint)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason) == (plain.text, plain.token_ids, "stop"), constraint.kind
        assert out.stop_reason is plain.stop_reason is None  # the end of sequence, not a stop_token_id


def test_json_schema_output_parses_and_follows_the_schema(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    for out in _generate(llm, StructuredOutputs(json=schema), n=2, temperature=1.0, max_tokens=120):
        value = json.loads(out.text)
        assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("s", "m")


CITY = {"type": "object", "properties": {"name": {"enum": ["Paris", "Lyon"]}}, "required": ["name"],
        "additionalProperties": False}


def test_a_structural_tag_holds_its_span_to_its_schema(llm):
    """vLLM's structural_tag, in xgrammar's format: a required tag, so the whole output is the tag
    around its content (the tiny model follows it at any temperature); a tag's JSON content, and
    vLLM's older form (free text until a trigger starts a structure), accept only spans that match.
    (xgrammar bounds no whitespace inside a tag's JSON, so the random model is not asked to write one.)"""
    from xgrammar.testing import _is_grammar_accept_string

    required = {"type": "structural_tag", "format": {"type": "tag", "begin": "<city>", "end": "</city>",
                                                      "content": {"type": "regex", "pattern": "(Paris|Lyon)"}}}
    for tag in (required, json.dumps(required)):
        for out in _generate(llm, StructuredOutputs(structural_tag=tag), n=2, temperature=1.0, max_tokens=60):
            assert out.text in ("<city>Paris</city>", "<city>Lyon</city>") and out.finish_reason == "stop", out.text
    as_json = {"type": "structural_tag", "format": {"type": "tag", "begin": "<city>", "end": "</city>",
                                                     "content": {"type": "json_schema", "json_schema": CITY}}}
    triggered = {"structures": [{"begin": "<city=", "schema": CITY, "end": "</city>"}], "triggers": ["<city="]}
    for tag, good, bad in ((as_json, '<city>{"name": "Paris"}</city>', '<city>{"name": "Rome"}</city>'),
                           (triggered, 'It is <city={"name": "Lyon"}</city>, I think.',
                            'It is <city={"name": "Rome"}</city>.')):
        grammar = StructuredOutputs(structural_tag=tag).to_grammar()
        assert _is_grammar_accept_string(grammar, good) and not _is_grammar_accept_string(grammar, bad)


def test_constrained_and_free_sequences_share_a_batch(llm):
    free_alone = _generate(llm, None)[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputs(choice=["ok"]))
    both = llm.generate([[5, 6, 7], [5, 6, 7]], [constrained, SamplingParams(temperature=0.0, max_tokens=48)],
                        use_tqdm=False)
    assert both[0].outputs[0].text == "ok"
    assert both[1].outputs[0].token_ids == free_alone  # the mask touched only its own row
    assert not llm.engine.runner.request_matchers  # each finished sequence's matcher is released


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"regex": "[0-9"}, "regex: .*Unclosed"),
    ({"json": {"type": 5}}, "json: "),
    ({"json": "{not json"}, "json: .*JSON"),
    ({"grammar": "root ::= "}, "grammar: "),
    ({"choice": []}, "choice must be"),
    ({"regex": 5}, "regex must be a string"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}, "structural_tag: .*nope"),
    ({"structural_tag": "{oops"}, "structural_tag is not valid JSON"),
    ({"structural_tag": {"structures": [{"begin": "<a>"}], "triggers": ["<a"]}}, r"structures\[0\] needs begin and end"),
    ({"structural_tag": {"structures": [], "triggers": []}}, "non-empty lists"),
])
def test_bad_constraints_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_matchers_survive_preemption(tiny_model_dir):
    """A preempted sequence is recomputed, not resampled: its matcher keeps its place."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=160, num_kv_blocks=20, block_size=8)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, max_tokens=150, n=4, seed=5, structured_outputs=StructuredOutputs(json=schema))
    outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in (c for o in outs for c in o.outputs):
        assert set(json.loads(out.text)) == {"ok", "size"}


def test_without_xgrammar_a_constraint_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if the `structured` extra were not installed
    with pytest.raises(ValueError, match=r"pip install 'driftgate\[structured\]'"):
        StructuredOutputs(regex="[0-9]+")


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                         "disable_by_batch_size": 0}])
def test_a_grammar_can_start_after_a_marker(tiny_model_dir, spec):
    """structured_outputs_after: the output is free until the marker (a reasoning model's end of
    thinking), held to the grammar from the next token; never seen, never held. Drafts wait for
    the start (one could carry the marker past the grammar's notice)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, speculative_config=spec)
    digits = StructuredOutputs(regex="[0-9]{3}")
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    marker = free.token_ids[2:4]  # what the free output writes at its third and fourth tokens
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, structured_outputs=digits,
                                                    structured_outputs_after=marker), use_tqdm=False)[0].outputs[0]
    assert held.token_ids[:4] == free.token_ids[:4]  # free up to the marker
    assert re.fullmatch("[0-9]{3}", llm.tokenizer.decode(held.token_ids[4:], skip_special_tokens=True))
    never = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                     structured_outputs=digits, structured_outputs_after=[10**6 - 1]),
                         use_tqdm=False)[0].outputs[0]
    assert never.token_ids == free.token_ids
    in_prompt = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, structured_outputs=digits,
                                                         structured_outputs_after=[6]), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", in_prompt.text)  # the marker in the prompt: held from the first token
    with pytest.raises(ValueError, match="structured_outputs_after"):
        SamplingParams(structured_outputs_after=[1])


def test_a_start_marker_after_the_end_marker_reopens_the_wait(llm):
    """The last marker decides (vLLM's reasoning parsers read it so): an end marker in an earlier
    turn, followed by a start marker that opens a new block, leaves the new block free; with the
    end marker last the constraint holds from the first token."""
    digits = StructuredOutputs(regex="[0-9]{3}")
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert 6 not in free.token_ids  # the end marker is never written: a wait lasts the whole output

    def run(reopened_by: list[int]):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, structured_outputs=digits,
                                structured_outputs_after=[6], structured_outputs_reopened_by=reopened_by)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    assert run([8]).token_ids == free.token_ids  # 6 … 8: a block opened again, free
    assert re.fullmatch("[0-9]{3}", run([5]).text)  # 5 … 6: the block closed, held at once


def test_a_thinking_budget_with_a_grammar_holds_the_answer_after_the_block(llm):
    """The budget forces the block's end, which a grammar holding the whole output would refuse
    (the end was taken anyway and the answer broke its schema): the grammar starts after it."""
    from engine.thinking import ThinkingBudget

    start, end = llm.tokenizer.encode("<think>", add_special_tokens=False), [9]
    budget = ThinkingBudget(2, tuple(start), tuple(end), open_at_start=True)
    for seed in range(4):
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                                       structured_outputs=StructuredOutputs(regex="[0-9]{3}"),
                                                       thinking_budget=budget), use_tqdm=False)[0].outputs[0]
        at = out.token_ids.index(9)
        assert at <= 2 and out.finish_reason == "stop"
        assert re.fullmatch("[0-9]{3}", llm.tokenizer.decode(out.token_ids[at + 1:], skip_special_tokens=True))
    # no block open (the model answers without thinking): the constraint holds from the first token
    closed = ThinkingBudget(2, tuple(start), tuple(end))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=0, max_tokens=24, thinking_budget=closed,
                                                   structured_outputs=StructuredOutputs(regex="[0-9]{3}")),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop"


def test_allowed_token_ids_that_the_grammar_refuses_end_the_output(llm):
    """No token both allowed and in the grammar: the output ends (it sampled from nothing before,
    token 0 to the end of max_tokens); allowed_token_ids against min_tokens alone: the allowed win."""
    digits = StructuredOutputs(regex="[0-9]{3}")
    letters = llm.tokenizer.encode("abc", add_special_tokens=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=digits,
                                                   allowed_token_ids=letters), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.text, len(out.token_ids)) == ("stop", "", 1)
    eos = llm.tokenizer.eos_token_id
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                                   allowed_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert (list(out.token_ids), out.finish_reason) == ([eos], "stop")
    assert llm.stats().num_blocks_used == 0


def test_length_bounded_strings_admit_no_raw_control_characters():
    """xgrammar lets a minLength/maxLength string hold raw control characters, which no JSON parser
    accepts (a tiny model wrote '"\\x1a"' and finished 'stop'); its bounds still hold."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
              "required": ["name", "tags"]}
    grammar = StructuredOutputs(json=schema).to_grammar()
    for text, valid in (('{"name": "abc", "tags": ["x"]}', True), ('{"name": "a\x1ab", "tags": []}', False),
                        ('{"name": "ab", "tags": ["\x01"]}', False), ('{"name": "abcde", "tags": []}', False)):
        assert _is_grammar_accept_string(grammar, text) is valid, text


def test_compiled_grammars_are_cached_within_a_bound(llm):
    """Each distinct schema's compiled grammar is kept for reuse, but not without end: a server
    whose clients send fresh schemas (or tool sets) grew ~2.5 MB a schema on SmolLM2 for good.
    The engine's compiler is bounded (vLLM's 512 MiB); a small bound holds under 60 schemas."""
    from engine.structured_output import GrammarCompiler

    assert llm.engine.grammars._cache_limit_bytes == 512 * 2**20
    tokenizer = llm.tokenizer
    bounded = GrammarCompiler(tokenizer, llm.engine.model.args.vocab_size, [tokenizer.eos_token_id],
                              cache_limit_bytes=64 * 2**10)
    sizes = []
    for i in range(60):
        schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"}}, "required": [f"f{i}"]}
        bounded.compile(StructuredOutputs(json=schema))
        sizes.append(bounded.cache_size_bytes())
    one = sizes[0]
    assert one > 0 and max(sizes) <= 64 * 2**10 + one  # the newest entry may stand alone past the bound
