"""`POST /v1/responses`: OpenAI's Responses API over the chat route's machinery.

A Responses body is turned into a chat body (instructions become the system message, input
items the conversation, function tools and calls the chat's tools and tool turns, `text.format`
the response format) and runs as a chat request; the output is shaped as a response: a
reasoning item when `--reasoning-parser` finds thinking, a message item of output text, and a
function_call item per tool call. Streaming sends the API's typed events (`response.created` ...
`response.output_text.delta` ... `response.completed`). Finished responses are kept in memory
(the last `--responses-store-size`, unless `store` is false), so `previous_response_id` continues
a conversation (its input and output come first; its instructions do not carry over, as in
OpenAI's API) and `GET`/`DELETE /v1/responses/{id}` find them. A `background` response returns at
once, `queued`, and runs in this process while `GET` shows its progress and
`POST /v1/responses/{id}/cancel` stops it; it stays stored while it runs (and is lost if the
server stops first).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from engine.outputs import CompletionOutput, RequestOutput
from server.chat import ChatJob, prepare_chat
from server.errors import APIError, ContextLengthError
from server.generation import EngineRequest, Generation, collect, collect_while_connected
from server.logprobs import TokenNamer, chat_logprobs, token_namer
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


class ContentPart(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Request):
    """A call the model made earlier, sent back as part of the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Request):
    """Thinking from an earlier output that a client sends back with the rest of it: accepted and
    left out of the prompt, as chat templates leave out earlier turns' thinking."""

    type: Literal["reasoning"]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningItem,
                      Field(union_mode="left_to_right")]


class ReasoningOptions(_Request):
    effort: ReasoningEffort | None = None  # the chat route's reasoning_effort
    summary: str | None = None  # reasoning summaries: none are written (reasoning items carry the text itself)


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's sampling extensions, as on the other routes
    seed: int | None = None
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension, as on the chat route
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    priority: int = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's, as on the chat route
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the answer's tokens' logprobs
    reasoning: ReasoningOptions | None = None
    truncation: Literal["auto", "disabled"] = "disabled"  # auto: drop the oldest turns to fit the context


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat route's response_format for the Responses API's `text.format`."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(400, f"text.format type {kind!r} is not one of text, json_object, json_schema", param="text")


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned (a background one: as it stands)
    turns: list[ChatMessage]  # its conversation without instructions, its own answer last
    task: asyncio.Task | None = None  # a background response's run, until it ends


def input_turns(body: ResponsesRequest) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=body.input)] if isinstance(body.input, str) else \
        _conversation(body.input)


OUTPUT_LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the answer's text comes with its tokens' logprobs (OpenAI asks for them by `include`)."""
    unknown = [item for item in body.include or [] if item != OUTPUT_LOGPROBS]
    if unknown:
        raise APIError(400, f"include {unknown[0]!r} is not available here (only {OUTPUT_LOGPROBS!r})",
                       param="include")
    return OUTPUT_LOGPROBS in (body.include or [])


def as_chat(body: ResponsesRequest, conversation: list[ChatMessage], logprobs: bool) -> ChatCompletionRequest:
    """The chat request this response runs as: `conversation` (the previous response's turns, then
    this input's) after the instructions, with the answer's logprobs if asked for."""
    conversation = list(conversation)
    if not conversation:
        raise APIError(400, "input holds only reasoning items: there is no message to answer", param="input")
    if body.instructions:
        conversation.insert(0, ChatMessage(role="system", content=body.instructions))
    tools = [Tool(function=FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in body.tools or []] or None
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":  # the chat route nests the name
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return ChatCompletionRequest(
        model=body.model, messages=conversation, max_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, seed=body.seed, response_format=_response_format(body.text),
        structured_outputs=body.structured_outputs, tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls, priority=body.priority, cache_salt=body.cache_salt,
        logprobs=logprobs, top_logprobs=(body.top_logprobs or 0) if logprobs else None,
        reasoning_effort=body.reasoning.effort if body.reasoning else None)


def _conversation(items: list[InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningItem],
                  ) -> list[ChatMessage]:
    """Input items as chat turns: consecutive function calls make one assistant turn's tool_calls,
    each output a tool turn; reasoning items are left out."""
    turns: list[ChatMessage] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            turns.append(ChatMessage(role=item.role, content=text))
        elif isinstance(item, FunctionCallOutput):
            turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1].role == "assistant" and turns[-1].tool_calls and not turns[-1].content:
                turns[-1].tool_calls.append(call)
            else:
                turns.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    return turns


class _Renderer:
    """The response object and, while streaming, its events; reasoning (with a parser) comes as
    an output item of its own before the message."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, prompt_tokens: int,
                 reasoning_parser: str | None, reader: ToolCallReader, stored: bool,
                 on_finish: Callable[[RequestOutput, dict[str, Any]], None], token_text: TokenNamer | None) -> None:
        self.body = body
        self.token_text = token_text  # names the answer's tokens in its logprobs; None: none asked for
        self.logprobs_sent = 0  # tokens whose logprobs went out with a text delta
        self.stored = stored
        self.on_finish = on_finish  # called with the final output and its response object
        self.reader = reader  # which of the answer is text and which tool calls
        self.response_id = response_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.reasoning_parser = reasoning_parser
        self.created_at = int(time.time())
        self.item_ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        self.sequence_number = 0
        self.opened: list[str] = []  # output items opened so far, in order ("reasoning", "message")
        self.sent = {"reasoning": "", "message": ""}  # the text of each streamed so far

    def _item(self, kind: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning", "id": self.item_ids[kind], "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": text}]}
        return {"type": "message", "id": self.item_ids[kind], "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    def _logprobs(self, completion: CompletionOutput, start: int = 0) -> list[dict[str, Any]]:
        """The logprobs of the output's tokens from `start` on, as output_text carries them."""
        if self.token_text is None:
            return []
        tokens, entries = completion.token_ids[start:], list(completion.logprobs or [])[start:]
        return [t.model_dump() for t in chat_logprobs(self.token_text, tokens, entries, self.body.top_logprobs or 0).content]

    @staticmethod
    def _call_item(call: ToolCall) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.function.name,
                "arguments": call.function.arguments, "status": "completed"}

    def response(self, out: RequestOutput | None) -> dict[str, Any]:
        """The response object: in progress (no output yet), or finished from the final output."""
        output, status, incomplete, output_tokens = [], "in_progress", None, 0
        if out is not None:
            completion = out.outputs[0]
            reasoning, content, calls = self.reader.parts(completion, self.reasoning_parser)
            if reasoning is not None:
                output.append(self._item("reasoning", reasoning, "completed"))
            if content is not None:
                output.append(self._item("message", content, "completed", self._logprobs(completion)))
            output += [self._call_item(call) for call in calls]
            output_tokens = len(completion.token_ids)
            status = "incomplete" if completion.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "incomplete_details": incomplete, "error": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "text": body.text or {"format": {"type": "text"}},
            "tools": [t.model_dump() for t in body.tools or []], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "store": self.stored, "background": body.background, "metadata": body.metadata or {},
            "truncation": body.truncation,
            "usage": None if out is None else {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + output_tokens},
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}

    def error_event(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        """A stream's failure, as OpenAI's Responses stream sends it (clients dispatch on `type`)."""
        return self._event("error", code=str(status), message=message, param=param)

    def _where(self, kind: str) -> dict[str, Any]:
        return {"item_id": self.item_ids[kind], "output_index": self.opened.index(kind), "content_index": 0}

    def _open(self, kind: str) -> list[dict[str, Any]]:
        self.opened.append(kind)
        part = self._item(kind, "", "in_progress")["content"][0]
        return [self._event("response.output_item.added", output_index=len(self.opened) - 1,
                            item={**self._item(kind, "", "in_progress"), "content": []}),
                self._event("response.content_part.added", **self._where(kind), part=part)]

    def _close(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        item = self._item(kind, text, "completed", logprobs)
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        return [self._event(done, **self._where(kind), text=text),
                self._event("response.content_part.done", **self._where(kind), part=item["content"][0]),
                self._event("response.output_item.done", output_index=self.opened.index(kind), item=item)]

    def _send(self, kind: str, text: str, completion: CompletionOutput) -> list[dict[str, Any]]:
        """Events for `kind`'s text so far: its item opened (closing the reasoning before the
        message), then the new characters (the message's with the logprobs of the tokens since
        the last delta)."""
        events = []
        if kind not in self.opened:
            if kind == "message" and "reasoning" in self.opened:
                events += self._close("reasoning", self.sent["reasoning"])
            events += self._open(kind)
        new = text[len(self.sent[kind]):]  # what was sent is a prefix of text
        # the last tokens' logprobs go out even where their text came earlier (or is held back)
        unsent_logprobs = self.token_text is not None and self.logprobs_sent < len(completion.token_ids)
        if new and kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **self._where(kind), delta=new))
        elif kind == "message" and (new or (completion.finished and unsent_logprobs)):
            logprobs = self._logprobs(completion, self.logprobs_sent)
            self.logprobs_sent = len(completion.token_ids)
            events.append(self._event("response.output_text.delta", **self._where(kind), delta=new, logprobs=logprobs))
        self.sent[kind] = text
        return events

    def delta(self, _: int, out: RequestOutput) -> list[dict[str, Any]]:
        events = []
        if not self.sequence_number:
            events += [self._event("response.created", response=self.response(None)),
                       self._event("response.in_progress", response=self.response(None))]
        completion = out.outputs[0]
        reasoning, text, calls = self.reader.parts(completion, self.reasoning_parser)
        if reasoning and "message" not in self.opened:
            events += self._send("reasoning", reasoning, completion)
        if text or (completion.finished and text is not None):  # an empty answer is still an item
            events += self._send("message", text, completion)
        if completion.finished:
            if "message" in self.opened:
                events += self._close("message", text or "", self._logprobs(completion))
            elif "reasoning" in self.opened:
                events += self._close("reasoning", self.sent["reasoning"])
            for call in calls:  # each call goes out whole, once the output is complete
                index, item = len(self.opened), self._call_item(call)
                self.opened.append(item["id"])
                events += [self._event("response.output_item.added", output_index=index,
                                       item={**item, "arguments": "", "status": "in_progress"}),
                           self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=item["arguments"]),
                           self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]),
                           self._event("response.output_item.done", output_index=index, item=item)]
            # a response cut off by max_output_tokens ends like any other, its status "incomplete"
            # (as vLLM does; the openai client's stream helper waits for response.completed)
            response = self.response(out)
            events.append(self._event("response.completed", response=response))
            self.on_finish(out, response)
        return events

    def answer_turn(self, out: RequestOutput) -> ChatMessage:
        """The finished output as the conversation's assistant turn (the thinking left out)."""
        _, content, calls = self.reader.parts(out.outputs[0], self.reasoning_parser)
        return ChatMessage(role="assistant", content=content, tool_calls=[c.model_dump() for c in calls] or None)


def _stored(state: ServerState, response_id: str, param: str | None = None) -> StoredResponse:
    found = state.responses.get(response_id)
    if found is None:
        raise APIError(404, f"response {response_id!r} was not found (this server keeps the last "
                            f"{state.config.responses_store_size} stored responses, in memory)", param=param)
    return found


def _keep(state: ServerState, response_id: str, stored: StoredResponse) -> None:
    """Store a response, dropping the oldest beyond the store's size (never one still running)."""
    state.responses[response_id] = stored
    finished = [key for key, kept in state.responses.items() if kept.task is None]
    for key in finished[:max(len(state.responses) - state.config.responses_store_size, 0)]:
        del state.responses[key]


def _prepare(body: ResponsesRequest, conversation: list[ChatMessage], logprobs: bool, state: ServerState) -> ChatJob:
    """The chat job for the conversation; with truncation "auto", its oldest turns are dropped (a
    tool result with the call it answers) until it fits the context, as OpenAI truncates, never the
    last turn. "disabled" (the default) leaves a conversation that does not fit a 400."""
    try:
        return prepare_chat(as_chat(body, conversation, logprobs), state)
    except ContextLengthError:
        if body.truncation != "auto" or len(conversation) < 2:
            raise
    # where the kept turns may start: not at a tool result, whose call would be gone (the last turn
    # always); the earliest start that fits is found by bisection, as each try renders the whole chat
    last = len(conversation) - 1
    starts = [i for i in range(1, len(conversation)) if conversation[i].role != "tool" or i == last]
    low, high, fitted, error = 0, len(starts) - 1, None, None
    while low <= high:
        middle = (low + high) // 2
        try:
            fitted, high = prepare_chat(as_chat(body, conversation[starts[middle]:], logprobs), state), middle - 1
        except ContextLengthError as exc:
            error, low = exc, middle + 1
    if fitted is None:
        raise error
    return fitted


def _check_background(body: ResponsesRequest, stored: bool) -> None:
    if body.stream:
        raise APIError(400, "a background response cannot stream; poll GET /v1/responses/{id}", param="background")
    if not stored:
        raise APIError(400, "a background response must be stored (store: true, and a --responses-store-size "
                            "above 0), as it is fetched later", param="background")


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state: ServerState = request.app.state.driftgate
    history = []
    if body.previous_response_id is not None:
        previous = _stored(state, body.previous_response_id, "previous_response_id")
        if previous.task is not None:
            raise APIError(400, f"response {body.previous_response_id!r} has not finished yet",
                           param="previous_response_id")
        history = previous.turns
    stored = body.store and state.config.responses_store_size > 0
    if body.background:
        _check_background(body, stored)
    logprobs = wants_logprobs(body)
    if logprobs and state.config.reasoning_parser:
        raise APIError(400, "output_text logprobs are not available with --reasoning-parser (the thinking and the "
                            "answer share the tokens)", param="include")
    job = _prepare(body, history + input_turns(body), logprobs, state)
    response_id = f"resp_{uuid.uuid4().hex}"
    record = RequestRecord(response_id)
    request.state.record = record

    def finish(out: RequestOutput, response: dict[str, Any]) -> None:
        if stored:
            turns = history + input_turns(body) + [renderer.answer_turn(out)]
            _keep(state, response_id, StoredResponse(response, turns))

    token_text = token_namer(state.token_text, as_ids=False) if logprobs else None
    renderer = _Renderer(body, response_id, job.lora or state.config.served_model_name, len(job.prompt_token_ids),
                         state.config.reasoning_parser, job.reader, stored, finish, token_text)
    generation = Generation(state, job.engine, [EngineRequest(response_id, job.prompt_token_ids, job.params,
                                                              body.priority, job.lora)], record)
    if body.background:
        queued = {**renderer.response(None), "status": "queued"}
        entry = StoredResponse(queued, [])
        entry.task = asyncio.create_task(_run_in_background(renderer, generation, entry))
        _keep(state, response_id, entry)
        return Response(json.dumps(queued), media_type="application/json")
    if body.stream:
        return await stream_response(request, generation, record, renderer.delta, lambda: [], typed_events=True,
                                     error_payload=renderer.error_event)
    finals = await collect_while_connected(generation, request.receive, record)
    response = renderer.response(finals[0])
    finish(finals[0], response)
    return Response(json.dumps(response), media_type="application/json")


async def _run_in_background(renderer: _Renderer, generation: Generation, entry: StoredResponse) -> None:
    """A background response's run: `entry` shows it in progress, then finished (by `finish`),
    cancelled or failed."""
    entry.response = renderer.response(None)  # in_progress
    try:
        finals = await collect(generation)
        renderer.on_finish(finals[0], renderer.response(finals[0]))  # stores the finished response in its place
    except asyncio.CancelledError:
        entry.response = {**entry.response, "status": "cancelled"}
    except Exception as exc:  # an engine failure ends this response, not the server
        entry.response = {**entry.response, "status": "failed",
                          "error": {"code": "server_error", "message": str(exc)}}
    finally:
        entry.task = None
        await generation.aclose()


async def retrieve_response(response_id: str, request: Request) -> Response:
    return Response(json.dumps(_stored(request.app.state.driftgate, response_id).response),
                    media_type="application/json")


async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response still running; a finished one comes back as it is."""
    entry = _stored(request.app.state.driftgate, response_id)
    if not entry.response.get("background"):
        raise APIError(400, f"response {response_id!r} is not a background response: only those can be cancelled")
    if entry.task is not None:
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
    return Response(json.dumps(entry.response), media_type="application/json")


async def delete_response(response_id: str, request: Request) -> Response:
    state: ServerState = request.app.state.driftgate
    entry = _stored(state, response_id)
    if entry.task is not None:
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
    del state.responses[response_id]
    return Response(json.dumps({"id": response_id, "object": "response.deleted", "deleted": True}),
                    media_type="application/json")
