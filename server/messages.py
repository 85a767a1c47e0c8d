"""`POST /v1/messages`: Anthropic's Messages API over the chat route's machinery (as vLLM and
llama.cpp's server offer it), so clients built on Anthropic's SDK reach a driftgate server.

The body becomes a chat body: `system` the system message; text blocks the turns' text;
`tool_use` blocks an assistant turn's tool calls and `tool_result` blocks tool turns; `tools`
(name, description, input_schema) the chat's function tools, `tool_choice` auto / any / a named
tool / none; `thinking` (`enabled` with budget_tokens, or `disabled`) caps the thinking as the
chat route's thinking_token_budget does. The answer comes back as content blocks: `thinking` (with `--reasoning-parser`),
`text`, then a `tool_use` block per call (`output_config.format` holds the text to a JSON schema),
with Anthropic's stop reasons and usage (prompt tokens the
prefix cache served count as `cache_read_input_tokens`). Streaming sends its named events
(`message_start` ... `content_block_delta` ... `message_stop`). Errors, including a body that does
not validate, carry Anthropic's error shape. `POST /v1/messages/count_tokens` counts a body's
prompt tokens.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, get_args

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from engine.outputs import RequestOutput
from server.chat import prepare_chat, render_chat
from server.errors import APIError, invalid_body
from server.generation import EngineRequest, Generation, collect_while_connected
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    ReasoningEffort,
    Tool,
    ToolCall,
    _Request,
)
from server.state import RequestRecord, ServerState
from server.streaming import stream_response
from server.tools import ToolCallReader

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_payload(status: int, message: str, _param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body (its SDK reads `error.message`)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Request):
    """Thinking an earlier answer sent back: left out of the prompt, as chat templates leave it."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolSpec(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ThinkingConfig(_Request):
    """`enabled` caps the thinking at budget_tokens; `disabled` gives it none (a block the model
    opens is closed at once). Either needs --reasoning-parser, which names the block's markers."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None

    def token_budget(self) -> int:
        if self.type == "disabled":
            return 0
        if self.budget_tokens is None:
            raise APIError(400, "thinking of type enabled needs budget_tokens", param="thinking")
        return self.budget_tokens


class MessagesRequest(_Request):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # required by /v1/messages, not by count_tokens
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # as on the chat route (not Anthropic's)
    stream: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "none" | "tool", "name", ...}
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}, "effort": ...}
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None  # refused: no MCP connector here
    container: Any = None  # refused: no code-execution container here


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _turns(message: Message) -> list[ChatMessage]:
    """One Anthropic message as chat turns: tool results each a tool turn (before the user's text),
    an assistant's tool_use blocks its turn's tool calls; thinking blocks are left out."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    results = [ChatMessage(role="tool", content=_text(block.content), tool_call_id=block.tool_use_id)
               for block in message.content if isinstance(block, ToolResultBlock)]
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    if message.role == "user" and calls:
        raise APIError(400, "tool_use blocks belong in assistant messages", param="messages")
    if message.role == "assistant" and results:
        raise APIError(400, "tool_result blocks belong in user messages", param="messages")
    turns = results
    if text or (not results and not calls):
        turns.append(ChatMessage(role=message.role, content=text, tool_calls=calls or None))
    elif calls:
        turns.append(ChatMessage(role="assistant", content=None, tool_calls=calls))
    return turns


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """The chat route's tool_choice for Anthropic's, and whether calls may come in parallel."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice of type tool needs the tool's name", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise APIError(400, f"tool_choice type {kind!r} is not one of auto, any, tool, none", param="tool_choice")
    return mapped, parallel


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat route's response_format for `output_config.format` (a JSON schema the answer must match)."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                       param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _effort(output_config: dict[str, Any] | None) -> str | None:
    """`output_config.effort`, which reaches the chat template as the chat route's reasoning_effort does."""
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in get_args(ReasoningEffort):
        raise APIError(400, f"output_config.effort must be one of {', '.join(get_args(ReasoningEffort))}, "
                            f"got {effort!r}", param="output_config")
    return effort


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages body runs as."""
    for name, what in (("mcp_servers", "MCP connectors"), ("container", "code-execution containers")):
        if getattr(body, name):
            raise APIError(400, f"{name}: {what} are not available here", param=name)
    conversation = [turn for message in body.messages for turn in _turns(message)]
    if body.system:
        conversation.insert(0, ChatMessage(role="system", content=_text(body.system)))
    tools = [Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
             for t in body.tools or []] or None
    choice, parallel = _tool_choice(body.tool_choice)
    return ChatCompletionRequest(model=body.model, messages=conversation, max_tokens=body.max_tokens,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                 stop=body.stop_sequences, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                                 response_format=_response_format(body.output_config),
                                 reasoning_effort=_effort(body.output_config),
                                 thinking_token_budget=body.thinking.token_budget() if body.thinking else None)


class _Renderer:
    """The message object and, while streaming, its events."""

    def __init__(self, body: MessagesRequest, message_id: str, model: str, prompt_tokens: int,
                 reasoning_parser: str | None, reader: ToolCallReader) -> None:
        self.body = body
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.reasoning_parser = reasoning_parser
        self.reader = reader
        self.started = False
        self.blocks: list[str] = []  # kinds of the content blocks opened so far ("thinking", "text")
        self.sent = {"thinking": "", "text": ""}

    def _stop(self, out: RequestOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
        completion = out.outputs[0]
        if calls:
            return "tool_use", None
        if completion.finish_reason == "length":
            return "max_tokens", None
        if isinstance(completion.stop_reason, str) and completion.stop_reason in (self.body.stop_sequences or []):
            return "stop_sequence", completion.stop_reason
        return "end_turn", None

    def _usage(self, out: RequestOutput | None) -> dict[str, int]:
        cached = out.num_cached_tokens if out is not None else 0
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": len(out.outputs[0].token_ids) if out is not None else 0}

    @staticmethod
    def _tool_use(call: ToolCall) -> dict[str, Any]:
        return {"type": "tool_use", "id": call.id, "name": call.function.name,
                "input": json.loads(call.function.arguments or "{}")}

    def message(self, out: RequestOutput | None) -> dict[str, Any]:
        """The message object: empty before the output (message_start), or the finished answer."""
        content, stop_reason, stop_sequence = [], None, None
        if out is not None:
            thinking, text, calls = self.reader.parts(out.outputs[0], self.reasoning_parser)
            if thinking is not None:
                content.append({"type": "thinking", "thinking": thinking, "signature": ""})
            if text is not None:
                content.append({"type": "text", "text": text})
            content += [self._tool_use(call) for call in calls]
            stop_reason, stop_sequence = self._stop(out, calls)
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage(out)}

    def _send(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`kind`'s new characters, its block opened first (closing the thinking before the text)."""
        events = []
        if kind not in self.blocks:
            if self.blocks:
                events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
            self.blocks.append(kind)
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                           "content_block": {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking"
                                                                        else {})})
        new = text[len(self.sent[kind]):]
        if new:
            events.append({"type": "content_block_delta", "index": self.blocks.index(kind),
                           "delta": {"type": f"{kind}_delta", kind: new}})
        self.sent[kind] = text
        return events

    def delta(self, _: int, out: RequestOutput) -> list[dict[str, Any]]:
        events = []
        if not self.started:
            self.started = True
            events.append({"type": "message_start", "message": self.message(None)})
        completion = out.outputs[0]
        thinking, text, calls = self.reader.parts(completion, self.reasoning_parser)
        if thinking and "text" not in self.blocks:
            events += self._send("thinking", thinking)
        if text:
            events += self._send("text", text)
        if not completion.finished:
            return events
        if self.blocks:
            events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        for call in calls:  # each call goes out whole, once the output is complete
            index, block = len(self.blocks), self._tool_use(call)
            self.blocks.append("tool_use")
            events += [{"type": "content_block_start", "index": index, "content_block": block | {"input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                       {"type": "content_block_stop", "index": index}]
        stop_reason, stop_sequence = self._stop(out, calls)
        events += [{"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": len(completion.token_ids)}},
                   {"type": "message_stop"}]
        return events


async def _body(request: Request) -> MessagesRequest:
    """The request body validated here, so its errors too come out in Anthropic's shape."""
    try:
        return MessagesRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise invalid_body(exc) from None


def _anthropic_errors(handler):
    """Run `handler`, turning its APIErrors into Anthropic's error body."""
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return JSONResponse(error_payload(exc.status, exc.message), status_code=exc.status, headers=exc.headers)
    return run


@_anthropic_errors
async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.driftgate
    body = await _body(request)
    if body.max_tokens is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    job = prepare_chat(as_chat(body), state)
    message_id = f"msg_{uuid.uuid4().hex}"
    record = RequestRecord(message_id)
    request.state.record = record
    renderer = _Renderer(body, message_id, job.lora or state.config.served_model_name, len(job.prompt_token_ids),
                         state.config.reasoning_parser, job.reader)
    generation = Generation(state, job.engine, [EngineRequest(message_id, job.prompt_token_ids, job.params, 0,
                                                              job.lora)], record)
    if body.stream:
        return await stream_response(request, generation, record, renderer.delta, lambda: [], typed_events=True,
                                     error_payload=error_payload)
    finals = await collect_while_connected(generation, request.receive, record)
    return JSONResponse(renderer.message(finals[0]))


@_anthropic_errors
async def count_message_tokens(request: Request) -> Response:
    """The prompt tokens a Messages body would take (system, conversation and tools, as rendered)."""
    state: ServerState = request.app.state.driftgate
    chat = as_chat(await _body(request))
    ids = render_chat(state.ready_engine().tokenizer, chat, state.config)
    return JSONResponse({"input_tokens": len(ids)})
