"""Tool calling by constraint, as vLLM does without a tool-call parser: a named `tool_choice` holds
the output to that function's parameters schema, `"required"` to a JSON list of calls, each one
of the tools with its parameters; the generated JSON then becomes the message's `tool_calls`.

`"auto"` (OpenAI's default when tools are given) would need to recognise calls in free text, in
each model family's own format (vLLM's --tool-call-parser); it is refused with a 400 saying what
works instead. `"none"` generates text as if no tools were sent; the tools still reach the chat
template, which may show them to the model.
"""

from __future__ import annotations

import json
import uuid

from engine.structured_output import StructuredOutputs
from server.errors import APIError
from server.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall


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


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutputs | None:
    """The output constraint the request's tool_choice asks for, or None (no tools, or "none")."""
    if body.tool_choice is None and not body.tools:
        return None
    if body.tool_choice == "none":
        return None
    if not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if body.tool_choice in (None, "auto"):
        raise APIError(400, 'tool_choice "auto" needs a parser for this model\'s tool-call format, which this '
                            'server does not have; send tool_choice "required" or name the function',
                       param="tool_choice")
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


def tool_calls(body: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The calls in a constrained output, or None when it is not their whole JSON (a stop string cut it)."""
    named = _named(body)
    try:
        value = json.loads(text)
        calls = [(named.function.name, value)] if named else [(call["name"], call["parameters"]) for call in value]
    except (ValueError, KeyError, TypeError):
        return None
    return [ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", function=FunctionCall(name=name, arguments=json.dumps(args)))
            for name, args in calls]
