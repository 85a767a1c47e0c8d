"""Tool calling by constraint: named and required tool_choice give parseable calls, "none" gives
text, "auto" is a clear 400, and tools and tool turns reach the chat template."""

from __future__ import annotations

import json

import httpx
import pytest

from server.chat import render_chat
from server.config import ServerConfig
from server.protocol import ChatCompletionRequest
from tests.server.conftest import MODEL_NAME

FLAG = {"type": "function", "function": {"name": "set_flag", "description": "Set a flag",
                                         "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                                        "required": ["on"], "additionalProperties": False}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"size": {"enum": ["s", "m"]}}, "required": ["size"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Turn the flag on."}]


def test_a_named_tool_choice_returns_that_call_with_valid_arguments(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[FLAG, PICK], max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "pick"}},
                                         temperature=1.0, n=2, seed=0)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert call.function.name == "pick" and json.loads(call.function.arguments)["size"] in ("s", "m")
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"


def test_a_call_cut_by_max_tokens_stays_text(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[FLAG], max_tokens=2,
                                         tool_choice={"type": "function", "function": {"name": "set_flag"}})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls == [] and choice.message.content


def test_required_picks_among_the_tools_and_streams_the_calls_whole(client):
    body = dict(model=MODEL_NAME, messages=MESSAGES, tools=[FLAG, PICK], tool_choice="required",
                parallel_tool_calls=False, max_tokens=400, temperature=0)  # the tiny model pads with whitespace
    (call,) = client.chat.completions.create(**body).choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, set(arguments)) in (("set_flag", {"on"}), ("pick", {"size"}))
    chunks = list(client.chat.completions.create(**body, stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in last.delta.tool_calls] == [
        (0, call.function.name, call.function.arguments)]
    assert not any(c.choices[0].delta.content for c in chunks[:-1])  # no JSON fragments as text


def test_tool_choice_none_answers_in_text(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[FLAG], tool_choice="none",
                                         max_tokens=5, temperature=0)
    assert out.choices[0].message.tool_calls == [] and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "says"), [
    ({"tools": [FLAG]}, 'tool_choice "auto" needs a parser'),  # OpenAI's default when tools are sent
    ({"tools": [FLAG], "tool_choice": "auto"}, 'tool_choice "auto" needs a parser'),
    ({"tools": [FLAG], "tool_choice": {"type": "function", "function": {"name": "pick"}}}, "not among"),
    ({"tools": [FLAG], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [FLAG], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_tool_requests_it_cannot_honour_are_400s(base_url, extra, says):
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and says in r.json()["error"]["message"]


def test_tools_and_tool_turns_reach_the_chat_template(engine):
    from tests.server.conftest import serve

    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.function.name }}){% endfor %}"
                "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}{% endfor %}")
    turns = [*MESSAGES, {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "set_flag",
                                                                                      "arguments": "{\"on\": true}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "done"}]

    def rendered(**fields) -> str:
        body = ChatCompletionRequest(messages=turns, tools=[FLAG], **fields)
        config = ServerConfig(served_model_name="m", chat_template=template)
        return engine.tokenizer.decode(render_chat(engine.tokenizer, body, config))

    expected = "[tool set_flag]<user>Turn the flag on.<assistant>(call set_flag)<tool>done(answers c1)"
    assert rendered(tool_choice="required") == expected
    assert not rendered(tool_choice="none").startswith("[tool")  # "none": the model is not shown the tools
    with serve(engine, chat_template=template) as url:  # /tokenize renders a chat with tools the same way
        tokens = httpx.post(url + "/tokenize", json={"messages": turns, "tools": [FLAG]}, timeout=30).json()["tokens"]
    assert engine.tokenizer.decode(tokens) == expected


def test_hermes_calls_are_read_from_free_text():
    from server.tools import hermes_streamable, parse_hermes

    text = ('Let me check. <tool_call>{"name": "pick", "arguments": {"size": "s"}}</tool_call>\n'
            '<tool_call>{"name": "set_flag", "arguments": "{\\"on\\": true}"}</tool_call> <tool_call>not json</tool_call>')
    content, calls = parse_hermes(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("pick", {"size": "s"}),
                                                                                     ("set_flag", {"on": True})]
    assert content == "Let me check. \n <tool_call>not json</tool_call>"  # a block that is not a call stays text
    assert parse_hermes("just text") == ("just text", [])
    assert parse_hermes('<tool_call>{"name": "pick"}</tool_call>')[0] is None  # nothing around the call
    # streamed text stops before a call, and holds back what may be the start of one
    assert hermes_streamable("Sure. <tool_call>{") == "Sure. "
    assert hermes_streamable("Sure. <tool_") == "Sure. "
    assert hermes_streamable("a < b") == "a < b"


def test_llama3_json_calls_are_a_reply_of_call_objects_only():
    from server.tools import llama3_json_streamable, parse_llama3_json

    content, calls = parse_llama3_json('{"name": "pick", "parameters": {"size": "m"}}; {"name": "set_flag", '
                                       '"arguments": {"on": false}}')
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("pick", {"size": "m"}),
                                                                                     ("set_flag", {"on": False})]
    for text in ("Sure, {x} is a set.", '{"name": 1}', '{"no": "name"}', '{"name": "pick"'):
        assert parse_llama3_json(text) == (text, [])  # text, not calls
    assert llama3_json_streamable(" {") == "" and llama3_json_streamable("") == ""
    assert llama3_json_streamable("Sure {") == "Sure {"


def test_mistral_calls_follow_the_tool_calls_token():
    from server.tools import ToolCallReader, mistral_streamable, parse_mistral
    from tests.server.test_openai_api import MESSAGES

    content, calls = parse_mistral('Let me see.[TOOL_CALLS] [{"name": "pick", "arguments": {"size": "m"}}, '
                                   '{"name": "set_flag", "arguments": {"on": true}}]')
    assert content == "Let me see."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("pick", {"size": "m"}), ("set_flag", {"on": True})]
    # Mistral's templates refuse call ids sent back that are not 9 letters or digits
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id
    # tokenizer v11 models: name[ARGS]{...} after each token
    content, calls = parse_mistral('[TOOL_CALLS]pick[ARGS]{"size": "s"}[TOOL_CALLS]set_flag[ARGS]{"on": false}')
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("pick", '{"size": "s"}'), ("set_flag", '{"on": false}')]
    for text in ("no calls here", "[TOOL_CALLS] not json", '[TOOL_CALLS]pick[ARGS]{"size": '):
        assert parse_mistral(text) == (text, [])
    assert mistral_streamable("Sure.[TOOL_CA") == "Sure." and mistral_streamable("a [b]") == "a [b]"
    # the tokens are special: an auto request keeps them in the text, other requests need not
    tools = {"messages": MESSAGES, "tools": [FLAG]}
    assert ToolCallReader(ChatCompletionRequest(**tools), "mistral").keeps_special_tokens
    assert not ToolCallReader(ChatCompletionRequest(**tools, tool_choice="none"), "mistral").keeps_special_tokens
    assert not ToolCallReader(ChatCompletionRequest(**tools), "hermes").keeps_special_tokens


def _named_args(calls) -> list[tuple[str, object]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_pythonic_calls_are_a_reply_that_is_a_list_of_python_calls():
    from server.tools import parse_pythonic, pythonic_streamable

    content, calls = parse_pythonic('[pick(size="m", extras=["a", 1.5], meta={"k": None}), set_flag(on=True)]')
    assert content is None
    assert _named_args(calls) == [("pick", {"size": "m", "extras": ["a", 1.5], "meta": {"k": None}}),
                                  ("set_flag", {"on": True})]
    assert _named_args(parse_pythonic("<|python_start|>[set_flag(on=False)]<|python_end|>")[1]) == [
        ("set_flag", {"on": False})]  # Llama 4's markers
    for text in ("[1, 2]", "[pick(size=x)]", "[pick('m')]", "[pick(**kw)]", "[obj.pick()]", "[pick(", "Sure.", "[]"):
        assert parse_pythonic(text) == (text, []), text  # text, not calls
    assert pythonic_streamable(" [") == "" and pythonic_streamable("<|python") == ""
    assert pythonic_streamable("Sure [") == "Sure ["


def test_granite_calls_follow_the_tool_call_token():
    from server.tools import granite_streamable, parse_granite

    for text in ('<|tool_call|>[{"name": "pick", "arguments": {"size": "m"}}, {"name": "set_flag", "arguments": '
                 '{"on": true}}]', '<tool_call> [{"name": "pick", "arguments": {"size": "m"}}, {"name": "set_flag", '
                 '"arguments": {"on": true}}]'):
        content, calls = parse_granite(text)
        assert content is None and _named_args(calls) == [("pick", {"size": "m"}), ("set_flag", {"on": True})]
    for text in ("Paris.", "<|tool_call|>not json", '<|tool_call|>[{"no": "name"}]', "<|tool_call|>[]"):
        assert parse_granite(text) == (text, []), text
    assert granite_streamable("<|tool") == "" and granite_streamable("[") == "" and granite_streamable("Hi") == "Hi"


def test_phi4_mini_calls_are_a_functools_list():
    from server.tools import parse_phi4_mini_json, phi4_mini_json_streamable

    content, calls = parse_phi4_mini_json('Checking. functools[{"name": "pick", "arguments": {"size": "l"}}] done')
    assert content == "Checking. " and _named_args(calls) == [("pick", {"size": "l"})]
    for text in ("no calls", "functools[nope]", 'functools[{"name": "pick"'):
        assert parse_phi4_mini_json(text) == (text, []), text
    assert phi4_mini_json_streamable("Sure. functo") == "Sure. "


def test_qwen3_coder_calls_are_xml_with_values_typed_by_the_schema():
    from server.protocol import Tool
    from server.tools import parse_qwen3_coder, qwen3_coder_streamable

    tools = [Tool(**t) for t in (FLAG, PICK, {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"},
                                         "tags": {"type": "array"}, "mode": {"type": ["integer", "null"]}}}}})]
    text = ("I will write it.\n<tool_call>\n<function=write>\n<parameter=path>\n007.txt\n</parameter>\n"
            "<parameter=lines>\n12\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=mode>\nnull\n</parameter>\n<parameter=note>\n  two\nlines\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=set_flag>\n<parameter=on>\nTrue\n</parameter>\n</function>\n"
            "</tool_call>")
    content, calls = parse_qwen3_coder(text, tools)
    assert content == "I will write it.\n\n"
    # a string stays text ("007", not 7), typed values parse, a parameter the schema lacks stays text
    assert _named_args(calls) == [("write", {"path": "007.txt", "lines": 12, "tags": ["a", "b"], "mode": None,
                                             "note": "  two\nlines"}), ("set_flag", {"on": True})]
    unknown = parse_qwen3_coder("<tool_call><function=pick><parameter=size>m</parameter></function></tool_call>")
    assert unknown[0] is None and _named_args(unknown[1]) == [("pick", {"size": "m"})]  # no tools: all text
    for plain in ("no calls", "<tool_call><function=pick>unclosed"):
        assert parse_qwen3_coder(plain, tools) == (plain, [])
    assert qwen3_coder_streamable("Sure.\n<tool_") == "Sure.\n" and qwen3_coder_streamable("a < b") == "a < b"


# what a Hermes / Llama 3.1 / Mistral / Llama 3.2 / Granite / Phi-4-mini / Qwen3-Coder model writes to call
# set_flag, and the text the client should see
CALLS_AS_WRITTEN = {
    "hermes": ('Sure. <tool_call>{"name": "set_flag", "arguments": {"on": true}}</tool_call>', "Sure. "),
    "llama3_json": ('{"name": "set_flag", "parameters": {"on": true}}', None),
    "mistral": ('Sure. [TOOL_CALLS] [{"name": "set_flag", "arguments": {"on": true}}]', "Sure. "),
    "pythonic": ("[set_flag(on=True)]", None),
    "granite": ('<|tool_call|>[{"name": "set_flag", "arguments": {"on": true}}]', None),
    "phi4_mini_json": ('Sure. functools[{"name": "set_flag", "arguments": {"on": true}}]', "Sure. "),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=set_flag>\n<parameter=on>\ntrue\n</parameter>\n</function>\n"
                    "</tool_call>", "Sure.\n"),
}


@pytest.mark.parametrize("parser", sorted(CALLS_AS_WRITTEN))
def test_auto_tool_choice_with_a_parser(engine, parser):
    from tests.server.conftest import serve

    said, content = CALLS_AS_WRITTEN[parser]
    # the tiny model cannot decide to call a tool; a regex makes it write the call, as such a model would
    body = {"messages": MESSAGES, "tools": [FLAG, PICK], "max_tokens": 160, "temperature": 0,
            "guided_regex": "".join(f"\\{ch}" if ch in "[]" else "\\n" if ch == "\n" else f"[{ch}]"
                                    for ch in said)}  # each character, literally
    with serve(engine, tool_call_parser=parser) as url:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"] == content
        (call,) = r["message"]["tool_calls"]
        assert call["function"] == {"name": "set_flag", "arguments": '{"on": true}'}
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")  # no fragment of the call
        assert [t["function"]["name"] for t in deltas[-1]["tool_calls"]] == ["set_flag"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        plain = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"messages": MESSAGES, "tools": [FLAG], "max_tokens": 3}).json()["choices"][0]
        assert plain["message"]["tool_calls"] == [] and plain["finish_reason"] in ("stop", "length")


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'; known: hermes, llama3_json, mistral, "
                                         "pythonic, granite, phi4_mini_json, qwen3_coder"):
        ServerConfig(served_model_name="x", tool_call_parser="xml")


@pytest.mark.parametrize("parser", sorted(CALLS_AS_WRITTEN))
@pytest.mark.parametrize("reasoning_parser", [None, "qwen3"])
def test_blank_text_before_calls_is_no_content_streamed_or_not(parser, reasoning_parser):
    """'<think>…</think>\\n\\n<tool_call>…' (Qwen3, Hermes): the blank text before the calls was
    streamed as content while the whole message said content null. Cut anywhere, the stream now
    holds the blank back, and its content adds up to the message's."""
    from engine.outputs import CompletionOutput, RequestOutput
    from server.chat import _Renderer
    from server.tools import ToolCallReader

    said, content = CALLS_AS_WRITTEN[parser]
    text = ("<think>ok</think>" if reasoning_parser else "") + "\n\n" + said.removeprefix("Sure. ").removeprefix(
        "Sure.\n")

    def renderer(stream: bool) -> _Renderer:
        body = ChatCompletionRequest(messages=MESSAGES, tools=[FLAG], stream=stream)
        return _Renderer(body, "id", MODEL_NAME, str, [1], ToolCallReader(body, parser), reasoning_parser)

    def output(upto: int, finished: bool) -> RequestOutput:
        done = CompletionOutput(0, text[:upto], [0], None, "stop" if finished else None)
        return RequestOutput("id", None, [1], [done], finished)

    message = renderer(False).full({0: output(len(text), True)}).choices[0].message
    assert message.content is None and [c.function.name for c in message.tool_calls] == ["set_flag"]
    for cut in range(len(text)):
        stream = renderer(True)
        chunks = stream.delta(0, output(cut, False)) + stream.delta(0, output(len(text), True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
