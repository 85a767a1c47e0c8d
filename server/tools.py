"""Tool calls, two ways, as in vLLM.

By constraint, for any model: a named `tool_choice` holds the output to that function's
parameters schema, `"required"` to a JSON list of calls, each one of the tools with its
parameters; the generated JSON then becomes the message's `tool_calls`.

By parsing, for `"auto"` (OpenAI's default when tools are given): the model decides, in its
family's own format, which the server must be told (`serve --tool-call-parser`). `hermes` is
the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format of Hermes and Qwen2.5
models; `llama3_json` the Llama 3.1/3.2 one, a reply that is nothing but `{"name": ...,
"parameters": {...}}` objects (separated by `;`); `mistral` Mistral's `[TOOL_CALLS]` token
followed by a JSON list of calls (v0.3 models) or by `name[ARGS]{...}` (tokenizer v11 models such
as Mistral Small 3.2), read with special tokens kept in the text and given the 9-character ids
Mistral's chat templates require of calls sent back; `pythonic` the Llama 3.2 / Llama 4 reply
that is a Python list of calls, `[get_weather(city="Paris")]`; `granite` Granite 3's
`<|tool_call|>` before a JSON list of calls; `phi4_mini_json` Phi-4-mini's `functools[...]`;
`qwen3_coder` Qwen3-Coder's XML, `<tool_call><function=NAME><parameter=ARG>value</parameter>
</function></tool_call>`, each value typed by its tool's parameters schema.
Without a parser `"auto"` is a 400 saying what works instead. `"none"` answers in text; the tools are then not shown to the chat template.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import string
import uuid

from engine.outputs import CompletionOutput
from engine.structured_output import StructuredOutputs
from server.errors import APIError
from server.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall
from server.reasoning import partial_tag_at_end, split_reasoning


def _named(body: ChatCompletionRequest) -> Tool | None:
    """The tool a {"type": "function", "function": {"name": ...}} tool_choice names."""
    choice = body.tool_choice
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")
    tool = next((t for t in body.tools or [] if t.function.name == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the request's tools", param="tool_choice")
    return tool


def tool_constraint(body: ChatCompletionRequest, parser: str | None = None) -> StructuredOutputs | None:
    """The output constraint the request's tool_choice asks for, or None (no tools, "none", or
    "auto" with a `parser` to find the calls in free text)."""
    if body.tool_choice is None and not body.tools:
        return None
    if body.tool_choice == "none":
        return None
    if not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if body.tool_choice in (None, "auto"):
        if parser is not None:
            return None
        raise APIError(400, 'tool_choice "auto" needs a parser for this model\'s tool-call format (serve '
                            f'--tool-call-parser {"|".join(TOOL_CALL_PARSERS)}); send tool_choice "required" or '
                            'name the function', param="tool_choice")
    named = _named(body)
    try:
        if named is not None:
            return StructuredOutputs(json=named.function.parameters or {"type": "object"})
        if body.tool_choice != "required":
            raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got '
                                f'{body.tool_choice!r}', param="tool_choice")
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                             "parameters": t.function.parameters or {"type": "object"}},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for t in body.tools]}
        one = {} if body.parallel_tool_calls else {"maxItems": 1}
        return StructuredOutputs(json={"type": "array", "items": calls, "minItems": 1, **one})
    except ValueError as exc:
        raise APIError(400, f"a tool's parameters schema: {exc}", param="tools") from None


def tool_calls(named: Tool | None, text: str) -> list[ToolCall] | None:
    """The calls in an output constrained to the `named` tool (or, None, to "required"'s list), or
    None when it is not their whole JSON (a stop string cut it)."""
    try:
        value = json.loads(text)
        calls = [(named.function.name, value)] if named else [(call["name"], call["parameters"]) for call in value]
    except (ValueError, KeyError, TypeError):
        return None
    return [_call(name, args) for name, args in calls]


def _call(name: str, arguments: object, call_id: str | None = None) -> ToolCall:
    """A call with a fresh id; arguments as JSON text (a model may already have written them as text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=call_id or f"chatcmpl-tool-{uuid.uuid4().hex}",
                    function=FunctionCall(name=name, arguments=text))


def _streamable_before(tag: str, text: str) -> str:
    """Everything before the first `tag`, less a tail that may be the start of one."""
    cut = text.find(tag)
    return text[:cut] if cut >= 0 else text[:len(text) - partial_tag_at_end(text, tag)]


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Free text → (the text around the calls, or None if there is none; the calls). A block that
    is not a call's JSON stays in the text, as the model wrote it."""
    calls, kept, start = [], [], 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            parsed = _call(call["name"], call.get("arguments", {}))
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[start:match.start()])
        start = match.end()
        calls.append(parsed)
    content = "".join(kept) + text[start:]
    return (content if content.strip() else None), calls


def hermes_streamable(text: str) -> str:
    """The part of a growing output that can be streamed as text: what comes before a call."""
    return _streamable_before(_HERMES_OPEN, text)


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """A reply made only of call objects → (None, the calls); any other reply is text."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    body = text.strip()
    if not body.startswith("{"):
        return text, []
    try:
        while pos < len(body):
            call, pos = decoder.raw_decode(body, pos)
            calls.append(_call(call["name"], call.get("parameters", call.get("arguments", {}))))
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    return None, calls


def llama3_json_streamable(text: str) -> str:
    """Nothing while the reply is blank or opens with '{' (it may be a call), all of it otherwise."""
    head = text.lstrip()
    return "" if not head or head.startswith("{") else text


_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """Text before the first [TOOL_CALLS] and the calls after each: a JSON list (or one object) of
    {"name", "arguments"}, or name[ARGS]{...}. Anything else after the token leaves all as text."""
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return text, []
    calls = []
    try:
        for segment in text[start + len(_MISTRAL_CALLS):].split(_MISTRAL_CALLS):
            segment = segment.strip()
            if not segment.startswith(("[", "{")) and _MISTRAL_ARGS in segment:
                name, arguments = segment.split(_MISTRAL_ARGS, 1)
                calls.append(_call(name.strip(), json.loads(arguments), _mistral_id()))
                continue
            value = json.loads(segment)
            for call in value if isinstance(value, list) else [value]:
                calls.append(_call(call["name"], call.get("arguments", {}), _mistral_id()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def mistral_streamable(text: str) -> str:
    return _streamable_before(_MISTRAL_CALLS, text)


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """A reply that is a Python list of calls with literal keyword arguments, `[f(a=1), g()]`
    (Llama 3.2 and 4, between <|python_start|> and <|python_end|> where the model writes them),
    → (None, the calls); any other reply is text."""
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            if any(k.arg is None for k in node.keywords):  # **kwargs: not a literal call
                return text, []
            calls.append(_call(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text, []
    return None, calls


def pythonic_streamable(text: str) -> str:
    """Nothing while the reply is blank or opens as a list of calls may, all of it otherwise."""
    head = text.lstrip()
    opening = head.startswith(("[", _PYTHON_START)) or _PYTHON_START.startswith(head)
    return "" if not head or opening else text


def _json_calls(value: object) -> list[ToolCall]:
    """A parsed JSON list (or one object) of {"name", "arguments" or "parameters"}; ValueError otherwise."""
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise ValueError("no calls")
    try:
        return [_call(c["name"], c.get("arguments", c.get("parameters", {}))) for c in calls]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a call: {exc}") from None


_GRANITE_TAGS = ("<|tool_call|>", "<tool_call>")


def parse_granite(text: str) -> tuple[str | None, list[ToolCall]]:
    """Granite 3's reply of calls: <|tool_call|> (or, as Granite 3.0 writes it, <tool_call>)
    before a JSON list of {"name", "arguments"} → (None, the calls); any other reply is text."""
    body = text.strip()
    for tag in _GRANITE_TAGS:
        body = body.removeprefix(tag)
    if not body.lstrip().startswith("["):
        return text, []
    try:
        return None, _json_calls(json.loads(body))
    except ValueError:
        return text, []


def granite_streamable(text: str) -> str:
    head = text.lstrip()
    opening = head.startswith(("[", *_GRANITE_TAGS)) or any(tag.startswith(head) for tag in _GRANITE_TAGS)
    return "" if not head or opening else text


_PHI4_CALLS = "functools["


def parse_phi4_mini_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]` → (text before it, or None;
    the calls); without a readable list, all of it is text."""
    start = text.find(_PHI4_CALLS)
    if start < 0:
        return text, []
    try:
        value, _ = json.JSONDecoder().raw_decode(text, start + len(_PHI4_CALLS) - 1)  # the list from its "["
        calls = _json_calls(value)
    except ValueError:
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def phi4_mini_json_streamable(text: str) -> str:
    return _streamable_before(_PHI4_CALLS, text)


_QWEN3_CODER_OPEN = "<tool_call>"
_QWEN3_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_QWEN3_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _typed(value: str, schema: dict | None) -> object:
    """A parameter's text as its schema's type: text for strings (or no type), JSON otherwise
    (`true`, `3`, `[1, 2]`), the text itself where it is not JSON."""
    kinds = (schema or {}).get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if not kinds or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except ValueError:
        if "boolean" in kinds and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


def parse_qwen3_coder(text: str, tools: list[Tool] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Qwen3-Coder's XML calls, `<tool_call><function=NAME><parameter=ARG>value</parameter>...
    </function></tool_call>` → (the text around them, or None; the calls). Values are written as
    text; each becomes the type the tool's schema gives its parameter."""
    properties = {t.function.name: (t.function.parameters or {}).get("properties") or {} for t in tools or []}
    calls, kept, start = [], [], 0
    for match in _QWEN3_CODER_CALL.finditer(text):
        name = match.group(1).strip()
        schema = properties.get(name, {})
        arguments = {}
        for parameter in _QWEN3_CODER_PARAMETER.finditer(match.group(2)):
            key = parameter.group(1).strip()
            value = parameter.group(2).removeprefix("\n").removesuffix("\n")  # the template's own line breaks
            arguments[key] = _typed(value, schema.get(key))
        kept.append(text[start:match.start()])
        start = match.end()
        calls.append(_call(name, arguments))
    content = "".join(kept) + text[start:]
    return (content if content.strip() else None), calls


def qwen3_coder_streamable(text: str) -> str:
    return _streamable_before(_QWEN3_CODER_OPEN, text)


TOOL_CALL_PARSERS = {"hermes": (parse_hermes, hermes_streamable),
                     "llama3_json": (parse_llama3_json, llama3_json_streamable),
                     "mistral": (parse_mistral, mistral_streamable),
                     "pythonic": (parse_pythonic, pythonic_streamable),
                     "granite": (parse_granite, granite_streamable),
                     "phi4_mini_json": (parse_phi4_mini_json, phi4_mini_json_streamable),
                     "qwen3_coder": (parse_qwen3_coder, qwen3_coder_streamable)}
# [TOOL_CALLS] and [ARGS] (Mistral), <|tool_call|> (Granite) are special tokens
_READ_WITH_SPECIAL_TOKENS = {"mistral", "granite"}
_READ_WITH_SCHEMAS = {"qwen3_coder"}  # its calls' values are text, typed by the tools' schemas


class ToolCallReader:
    """What a chat choice's output is to the client: text, tool calls, or both. A request without
    tools reads as plain text."""

    def __init__(self, body: ChatCompletionRequest, parser: str | None = None):
        self.constraint = tool_constraint(body, parser)
        self._named = _named(body)
        auto = bool(body.tools) and body.tool_choice in (None, "auto")
        self._parse, self._streamable = TOOL_CALL_PARSERS[parser] if parser and auto else (None, None)
        if parser in _READ_WITH_SCHEMAS and self._parse is not None:
            self._parse = functools.partial(self._parse, tools=body.tools)
        self.keeps_special_tokens = auto and parser in _READ_WITH_SPECIAL_TOKENS  # the output must show them

    def streamable(self, text: str) -> str:
        """The part of a growing output that may be streamed as text now."""
        if self.constraint is not None:
            return ""  # a call's JSON goes out whole, at the end
        if self._streamable is None:
            return text
        shown = self._streamable(text)
        return shown if shown.strip() else ""  # blank text before calls is no content: it waits

    def parts(self, completion: CompletionOutput, reasoning_parser: str | None,
              ) -> tuple[str | None, str | None, list[ToolCall]]:
        """A choice's (thinking, text, calls) for the Responses and Messages APIs: once finished,
        its thinking, its text (None when the answer is only calls) and its calls; while it runs,
        what may be streamed of the thinking and the text (no calls yet)."""
        if not completion.finished:
            thinking, answer = split_reasoning(completion.text, reasoning_parser, final=False)
            return thinking, self.streamable(answer), []
        thinking, answer = split_reasoning(completion.text, reasoning_parser, final=True)
        text, calls, _ = self.finish(answer, completion.finish_reason)
        return thinking, text if text or not calls else None, calls

    def finish(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """A finished output's (text, calls, finish reason)."""
        if self.constraint is not None and reason == "stop":
            calls = tool_calls(self._named, text)
            if calls:
                return None, calls, "tool_calls"
        elif self._parse is not None:
            content, calls = self._parse(text)
            if calls:
                return content, calls, "tool_calls"
        return text, [], reason
