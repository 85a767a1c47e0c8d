"""`POST /v1/chat/completions`: messages rendered with the model's own chat template."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from engine.beam_search import BeamSearchParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.thinking import ThinkingBudget
from engine.tokenizer import render_chat as render_chat_text
from server.config import TEMPLATE_ARGUMENTS, ServerConfig
from server.errors import APIError
from server.generation import EngineRequest, Generation, collect_while_connected
from server.logprobs import TokenNamer, chat_logprobs, prompt_logprobs, token_namer
from server.params import (
    apply_server_defaults,
    check_prompt_ids,
    engine_params,
    refuse_unsupported,
    requested_adapter,
    running_usage,
    truncate_prompt,
)
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    DeltaToolCall,
    TokenizeRequest,
    Usage,
)
from server.reasoning import THINK_END, THINK_START, split_reasoning
from server.state import RequestRecord, ServerState
from server.streaming import stream_response
from server.tools import ToolCallReader

if TYPE_CHECKING:
    from engine.serving import ServingEngine


def render_chat(tokenizer, body: ChatCompletionRequest | TokenizeRequest, config: ServerConfig | None = None) -> list[int]:
    """Token ids of the body's conversation under the server's chat template (default: the
    tokenizer's), with its template options over the server's defaults; template failures are the
    client's 400."""
    template = (config and config.chat_template) or getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, "this model has no chat template; use /v1/completions, or serve it with "
                            "--chat-template", param="messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt=false", param="continue_final_message")
    extra = body.chat_template_kwargs or {}
    if clash := sorted(TEMPLATE_ARGUMENTS & extra.keys()):
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    if effort := getattr(body, "reasoning_effort", None):  # a template that reads it (gpt-oss's) sets the effort
        extra = {"reasoning_effort": effort, **extra}
    extra = {**(config.default_chat_template_kwargs if config else {}), **extra}
    conversation = [{"role": m.role, "content": m.text()}
                    | {k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id)) if v is not None}
                    for m in body.messages]
    if body.tools and getattr(body, "tool_choice", None) != "none":
        extra = {**extra, "tools": [tool.model_dump(exclude_none=True) for tool in body.tools]}
    try:
        text = render_chat_text(tokenizer, conversation, template, add_generation_prompt=body.add_generation_prompt,
                                continue_final_message=body.continue_final_message, template_kwargs=extra)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


class _Renderer:
    """Builds chat choices and chunks; remembers what each streamed choice already got.
    `reasoning_parser` (or None) tells a reasoning model's thinking from its answer; `reader` says
    which of the answer is text and which tool calls."""

    def __init__(self, body: ChatCompletionRequest, request_id: str, model: str, text: TokenNamer,
                 prompt_ids: list[int], reader: ToolCallReader, reasoning_parser: str | None = None) -> None:
        self.body = body
        self.prompt_ids = prompt_ids
        self.reader = reader
        self.reasoning_parser = reasoning_parser
        self.request_id = request_id
        self.model = model
        self.text = text
        self.top_n = (body.top_logprobs or 0) if body.logprobs else None
        self.sent: dict[int, tuple[int, int, int]] = {}  # choice index -> (thinking chars, chars, tokens sent)
        self.done: set[int] = set()
        self.usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=0, total_tokens=0)

    def _logprobs(self, c: CompletionOutput, tokens: int) -> ChatLogprobs | None:
        if self.top_n is None:
            return None
        return chat_logprobs(self.text, c.token_ids[tokens:], list(c.logprobs or [])[tokens:], self.top_n)

    def _finish(self, c: CompletionOutput) -> tuple[str | None, str | None, list, str | None]:
        """A finished choice's (thinking, content, tool calls, finish reason)."""
        reasoning, answer = split_reasoning(c.text, self.reasoning_parser, final=True)
        content, calls, reason = self.reader.finish(answer, c.finish_reason)
        return reasoning, (content or None) if reasoning is not None else content, calls, reason

    def full(self, finals: dict[int, RequestOutput]) -> ChatCompletionResponse:
        out = finals[0]
        choices = []
        self.usage.prompt_tokens_details.cached_tokens = out.num_cached_tokens
        for c in sorted(out.outputs, key=lambda c: c.index):
            reasoning, content, calls, reason = self._finish(c)
            message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c, 0),
                                      finish_reason=reason, stop_reason=c.stop_reason,
                                      token_ids=self._token_ids(c, 0)))
        self.usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens
        response = ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage)
        if self.body.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs(self.text, self.prompt_ids, out.prompt_logprobs,
                                                       self.body.prompt_logprobs)
        if self.body.return_token_ids:
            response.prompt_token_ids = self.prompt_ids
        return response

    def _token_ids(self, c: CompletionOutput, tokens: int) -> list[int] | None:
        """return_token_ids: the choice's output ids from `tokens` on."""
        return list(c.token_ids[tokens:]) if self.body.return_token_ids else None

    def delta(self, _: int, out: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        self.usage.prompt_tokens_details.cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            if c.index in self.done:
                continue
            if c.index not in self.sent:  # OpenAI opens every choice with the role alone
                chunks.append(self._chunk(ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant",
                                                                                         content=""))))
                if self.body.return_token_ids and not self.sent:  # the prompt's ids, on the stream's first chunk
                    chunks[-1].prompt_token_ids = self.prompt_ids
                self.sent[c.index] = (0, 0, 0)
            thought, chars, tokens = self.sent[c.index]
            if c.finished:
                reasoning, content, calls, reason = self._finish(c)
                thinking, text = (reasoning or "")[thought:], (content or "")[chars:]  # streamed: prefixes of these
                delta = ChatDelta(content=text, reasoning_content=thinking or None,
                                  tool_calls=[DeltaToolCall(index=i, **call.model_dump())
                                              for i, call in enumerate(calls)] or None)
            else:
                reasoning, answer = split_reasoning(c.text, self.reasoning_parser, final=False)
                thinking, text, reason = (reasoning or "")[thought:], self.reader.streamable(answer)[chars:], None
                wants_tokens = self.top_n is not None or self.body.return_token_ids
                if not (thinking or text or (wants_tokens and tokens < len(c.token_ids))):
                    continue
                delta = ChatDelta(content=text if text or not thinking else None, reasoning_content=thinking or None)
            chunks.append(self._chunk(ChatChunkChoice(index=c.index, delta=delta, logprobs=self._logprobs(c, tokens),
                                                      finish_reason=reason, stop_reason=c.stop_reason,
                                                      token_ids=self._token_ids(c, tokens))))
            self.sent[c.index] = (thought + len(thinking), chars + len(text), len(c.token_ids))
            if c.finished:
                self.done.add(c.index)
                self.usage.completion_tokens += len(c.token_ids)
        if usage := running_usage(self.body, self.usage.prompt_tokens, (sent[-1] for sent in self.sent.values())):
            for chunk in chunks:
                chunk.usage = usage
        return chunks

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self) -> list[ChatCompletionChunk]:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return []
        self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens
        return [ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=self.usage)]


@dataclass(slots=True)
class ChatJob:
    """A chat request checked and turned into engine input: what both chat-shaped routes run."""

    engine: ServingEngine
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    reader: ToolCallReader
    lora: str | None  # the LoRA adapter the request's `model` names


def prepare_chat(body: ChatCompletionRequest, state: ServerState) -> ChatJob:
    """Validate a chat body (400s) and render its conversation to token ids."""
    engine = state.ready_engine()
    config = state.config
    lora = requested_adapter(body.model, config)
    refuse_unsupported(body)
    reader = ToolCallReader(body, config.tool_call_parser)
    ids = truncate_prompt(render_chat(engine.tokenizer, body, config), body.truncate_prompt_tokens,
                          engine.max_model_len)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = check_prompt_ids(ids, vocab_size=len(engine.tokenizer), max_model_len=engine.max_model_len,
                                  max_tokens=requested, param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    try:
        params = engine_params(body, max_tokens=max_tokens, max_n=config.max_n,
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                               prompt_logprobs=body.prompt_logprobs, vocab_size=len(engine.tokenizer),
                               max_logprobs=engine.max_logprobs, defaults=config.sampling_defaults,
                               tool_constraint=reader.constraint)
    except APIError as exc:  # chat's count of logprobs is top_logprobs (its logprobs is a switch)
        if exc.param != "logprobs":
            raise
        raise APIError(400, exc.message.replace("logprobs", "top_logprobs", 1), param="top_logprobs") from None
    think_start, think_end = ([engine.tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
                              if config.reasoning_parser else (None, None))
    if think_end and isinstance(params, SamplingParams) and params.structured_outputs is not None:
        # the constraint holds the answer, from the token after </think> (as vLLM does): in the
        # prompt where thinking is turned off, else once the model has thought
        params.structured_outputs_after, params.structured_outputs_reopened_by = think_end, think_start
    if body.thinking_token_budget is not None:
        params.thinking_budget = _thinking_budget(body.thinking_token_budget, config.reasoning_parser, params,
                                                  think_start, think_end)
    if reader.keeps_special_tokens and isinstance(params, SamplingParams):
        params.skip_special_tokens = False
    return ChatJob(engine, ids, params, reader, lora)


def _thinking_budget(max_tokens: int, parser: str | None, params: SamplingParams | BeamSearchParams,
                     think_start: list[int] | None, think_end: list[int] | None) -> ThinkingBudget:
    """thinking_token_budget as the engine's, the block's markers tokenized as the model writes them."""
    if parser is None:
        raise APIError(400, "thinking_token_budget needs a server started with --reasoning-parser, which names "
                            "the thinking block's markers", param="thinking_token_budget")
    if not isinstance(params, SamplingParams):
        raise APIError(400, "thinking_token_budget does not apply to beam search", param="thinking_token_budget")
    return ThinkingBudget(max_tokens, tuple(think_start), tuple(think_end), open_at_start=parser == "deepseek_r1")


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.driftgate
    config = state.config
    apply_server_defaults(body, config)
    job = prepare_chat(body, state)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    record = RequestRecord(request_id)
    request.state.record = record
    renderer = _Renderer(body, request_id, job.lora or config.served_model_name,
                         token_namer(state.token_text, body.return_tokens_as_token_ids), job.prompt_token_ids,
                         job.reader, config.reasoning_parser)
    generation = Generation(state, job.engine, [EngineRequest(request_id, job.prompt_token_ids, job.params,
                                                              body.priority, job.lora)], record)
    if body.stream:
        return await stream_response(request, generation, record, renderer.delta, renderer.usage_chunk)
    finals = await collect_while_connected(generation, request.receive, record)
    return Response(renderer.full(finals).model_dump_json(), media_type="application/json")
