"""`POST /v1/completions`: prompts as text, token ids or lists of either; echo with prompt logprobs,
or vLLM's prompt_logprobs and return_token_ids beside the text."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from server.generation import EngineRequest, Generation, collect_while_connected
from server.logprobs import TokenNamer, completion_logprobs, prompt_logprobs, token_namer
from server.params import (
    apply_server_defaults,
    check_prompt_ids,
    engine_params,
    refuse_unsupported,
    requested_adapter,
    running_usage,
    truncate_prompt,
)
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from server.state import RequestRecord, ServerState
from server.streaming import stream_response


def tokenized_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer,
                      ) -> list[tuple[str | None, list[int]]]:
    """Each prompt (text, token ids, or a list of either) as (original text or None, token ids)."""
    if isinstance(prompt, str):
        return [(prompt, tokenizer.encode(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(None, list(p)) for p in prompt]


class _Renderer:
    """Builds choices from engine outputs; remembers what each streamed choice already got."""

    def __init__(self, body: CompletionRequest, request_id: str, model: str, text: TokenNamer,
                 prompts: list[tuple[str, list[int]]]) -> None:
        self.body = body
        self.request_id = request_id
        self.model = model
        self.text = text
        self.prompts = prompts
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars sent, tokens sent)
        self.done: set[int] = set()  # choices whose finish_reason went out
        self.usage = Usage(prompt_tokens=sum(len(ids) for _, ids in prompts), completion_tokens=0, total_tokens=0)
        self.cached: dict[int, int] = {}  # prompt index -> its prompt tokens the prefix cache served

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, chars: int, tokens: int,
                first: bool) -> CompletionChoice:
        """The choice for `c` from char/token offset on; the `first` of a choice echoes the prompt
        (when asked) and carries what is said of the prompt once."""
        prompt_text, prompt_ids = self.prompts[prompt_index]
        echo = first and self.body.echo
        text = c.text[chars:]
        logprobs = None
        if self.body.logprobs is not None:
            ids, entries = c.token_ids[tokens:], list(c.logprobs or [])[tokens:]
            offset = len(prompt_text) + chars
            if echo:
                ids, entries, offset = prompt_ids + ids, list(out.prompt_logprobs or []) + entries, 0
            logprobs = completion_logprobs(self.text, ids, entries, self.body.logprobs, offset,
                                           self.body.skip_special_tokens)
        if echo:
            text = prompt_text + text
        choice = CompletionChoice(index=prompt_index * self.body.n + c.index, text=text, logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if self.body.prompt_logprobs is not None and not self.body.stream:
            choice.prompt_logprobs = prompt_logprobs(self.text, prompt_ids, out.prompt_logprobs,
                                                     self.body.prompt_logprobs)
        if self.body.return_token_ids:
            choice.prompt_token_ids = prompt_ids if first else None
            choice.token_ids = list(c.token_ids[tokens:])
        return choice

    def full(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices = []
        self.usage.prompt_tokens_details.cached_tokens = sum(out.num_cached_tokens for out in finals.values())
        for prompt_index in sorted(finals):
            out = finals[prompt_index]
            for c in out.outputs:
                choices.append(self._choice(prompt_index, out, c, 0, 0, first=True))
                self.usage.completion_tokens += len(c.token_ids)
        self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=self.usage)

    def delta(self, prompt_index: int, out: RequestOutput) -> list[CompletionResponse]:
        choices = []
        self.cached[prompt_index] = out.num_cached_tokens
        for c in out.outputs:
            index = prompt_index * self.body.n + c.index
            if index in self.done:
                continue
            first = index not in self.sent
            chars, tokens = self.sent.get(index, (0, 0))
            if not (tokens < len(c.token_ids) or chars < len(c.text) or c.finished or first and self.body.echo):
                continue
            choices.append(self._choice(prompt_index, out, c, chars, tokens, first))
            self.sent[index] = (len(c.text), len(c.token_ids))
            if c.finished:
                self.done.add(index)
                self.usage.completion_tokens += len(c.token_ids)
        # one choice per chunk, as OpenAI streams it (clients read choices[0])
        usage = running_usage(self.body, self.usage.prompt_tokens, (tokens for _, tokens in self.sent.values()))
        return [CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)
                for choice in choices]

    def usage_chunk(self) -> list[CompletionResponse]:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return []
        self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens
        self.usage.prompt_tokens_details.cached_tokens = sum(self.cached.values())
        return [CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=self.usage)]


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.driftgate
    engine = state.ready_engine()
    config = state.config
    apply_server_defaults(body, config)
    lora = requested_adapter(body.model, config)
    refuse_unsupported(body)
    prompts = []
    engine_requests = []
    request_id = f"cmpl-{uuid.uuid4().hex}"
    for i, (prompt_text, ids) in enumerate(tokenized_prompts(body.prompt, engine.tokenizer)):
        kept = truncate_prompt(ids, body.truncate_prompt_tokens, engine.max_model_len)
        if len(kept) < len(ids):  # echo shows what the model saw
            prompt_text, ids = None, kept
        max_tokens = check_prompt_ids(ids, vocab_size=len(engine.tokenizer), max_model_len=engine.max_model_len,
                                      max_tokens=body.max_tokens)
        # echo with logprobs and vLLM's prompt_logprobs both read the prompt's: the engine gives the most asked
        asked = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
        params = engine_params(body, max_tokens=max_tokens, max_n=config.max_n, logprobs=body.logprobs,
                               prompt_logprobs=(-1 if -1 in asked else max(asked)) if asked else None,
                               vocab_size=len(engine.tokenizer), max_logprobs=engine.max_logprobs,
                               defaults=config.sampling_defaults)
        prompts.append((engine.tokenizer.decode(ids) if prompt_text is None else prompt_text, ids))
        engine_requests.append(EngineRequest(f"{request_id}-{i}", ids, params, body.priority, lora))

    record = RequestRecord(request_id)
    request.state.record = record
    renderer = _Renderer(body, request_id, lora or config.served_model_name,
                         token_namer(state.token_text, body.return_tokens_as_token_ids), prompts)
    generation = Generation(state, engine, engine_requests, record)
    if body.stream:
        return await stream_response(request, generation, record, renderer.delta, renderer.usage_chunk)
    finals = await collect_while_connected(generation, request.receive, record)
    return Response(renderer.full(finals).model_dump_json(), media_type="application/json")
