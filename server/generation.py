"""Drive one API request's engine requests: merge their outputs, time them, and always clean up.

A completions request may carry several prompts; each becomes its own engine request, and
their outputs arrive interleaved on one queue. Whatever way the consumer stops (finished,
timed out, client gone, cancelled), `aclose` aborts every engine request still running so
its KV blocks are freed before the next forward pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from starlette.types import Receive

from engine.async_engine import EngineError, ReplicaLostError
from engine.beam_search import BeamSearch, BeamSearchParams, search_async
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError
from server.state import Phase, RequestRecord, ServerState

if TYPE_CHECKING:
    from engine.serving import ServingEngine

T = TypeVar("T")
request_logger = logging.getLogger("driftgate.server.requests")
log = logging.getLogger("driftgate.server")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    priority: int = 0
    lora: str | None = None  # the LoRA adapter serving it


def log_received(tokenizer, requests: list[EngineRequest], max_len: int | None) -> None:
    """serve --enable-log-requests: one JSON line per engine request with what it was given (its
    prompt, cut to `max_len` characters and token ids, and the sampling fields it sets), so an
    output can be reproduced. Off by default: prompts may be private."""
    for request in requests:
        ids = request.prompt_token_ids[:max_len]
        params = request.params
        changed = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                   if getattr(params, f.name) != _default(f)}
        request_logger.info(json.dumps({
            "event": "received", "id": request.request_id, "prompt": tokenizer.decode(ids)[:max_len],
            "prompt_token_ids": ids, "prompt_tokens": len(request.prompt_token_ids),
            "params": changed, "lora": request.lora, "priority": request.priority}, default=str))


def _default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


class _Done:
    """Queue marker: one engine request has no more outputs."""


class Generation:
    """Async iterator of `(prompt_index, RequestOutput)` over all of one API request's prompts."""

    def __init__(self, state: ServerState, engine: ServingEngine, requests: list[EngineRequest],
                 record: RequestRecord) -> None:
        state.admit()  # 429 before anything is allocated; `aclose` gives the slot back
        if state.config.log_requests:
            log_received(engine.tokenizer, requests, state.config.max_log_len)
        self._engine = engine
        self._state = state
        self._requests = requests
        self._record = record
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | _Done]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._unfinished = {r.request_id for r in requests}
        self._num_tokens = [0] * len(requests)
        self._arrival = time.monotonic()
        self._last_token_at: float | None = None
        self._started = False
        self._closed = False
        self._restartable = False  # set by outputs(final_only=True)
        timeout = state.config.request_timeout_s
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        record.prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)

    async def _pump(self, index: int, request: EngineRequest) -> None:
        for attempt in range(2):
            try:
                async for out in self._outputs(request):
                    self._queue.put_nowait((index, out))
            except ReplicaLostError as exc:
                if self._restartable and attempt == 0:  # nothing was passed on: start again, once
                    log.warning("%s; starting it again", exc)
                    continue
                self._queue.put_nowait((index, exc))
            except Exception as exc:  # handed to the consumer, which decides the status
                self._queue.put_nowait((index, exc))
            else:
                self._queue.put_nowait((index, _Done()))
            return

    def _outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if isinstance(request.params, BeamSearchParams):
            return self._beam_search(request)
        return self._engine.generate(request.prompt_token_ids, request.params, request.request_id, request.priority,
                                     request.lora)

    async def _beam_search(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One finished output once the search ends (its one-token requests stop with the pump)."""
        engine = self._engine
        search = BeamSearch(request.prompt_token_ids, request.params, engine.eos_token_ids, engine.max_model_len)
        await search_async(functools.partial(engine.generate, lora=request.lora), search, request.request_id,
                           request.priority)
        yield search.output(request.request_id, None, engine.tokenizer)

    def _observe(self, index: int, out: RequestOutput) -> None:
        """Latency metrics and the request record, from the growth in generated tokens."""
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new_tokens = num_tokens - self._num_tokens[index]
        if new_tokens <= 0:
            return
        self._num_tokens[index] = num_tokens
        now = time.monotonic()
        metrics = self._state.metrics
        if not self._started:
            self._started = True
            self._state.mark_started()
            self._record.ttft_s = now - self._arrival
            metrics.time_to_first_token.observe(self._record.ttft_s)
        elif self._last_token_at is not None:
            gap = (now - self._last_token_at) / new_tokens
            for _ in range(new_tokens):
                metrics.inter_token_latency.observe(gap)
        self._last_token_at = now
        self._record.output_tokens = sum(self._num_tokens)

    async def outputs(self, final_only: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs in arrival order until every prompt has finished; raises `APIError` 400/500/504.

        `final_only`: the caller keeps only each prompt's last output, so a request a cluster
        replica lost midway may start again from scratch (its earlier outputs are superseded)."""
        self._restartable = final_only
        if not self._pumps:
            self._pumps = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self._requests)]
        num_open = len(self._requests)
        while num_open:
            try:
                async with asyncio.timeout_at(self._deadline):
                    index, item = await self._queue.get()
            except TimeoutError:
                self._record.outcome = "timeout"
                raise APIError(504, f"request timed out after {self._state.config.request_timeout_s} s") from None
            if isinstance(item, _Done):
                num_open -= 1
                continue
            if isinstance(item, ValueError):  # the engine's verdict on the prompt or the params
                raise APIError(400, str(item)) from None
            if isinstance(item, EngineError):  # an error body (a stream's error event), not a cut-off response
                self._record.outcome = "error"
                log.warning("request %s failed: %s", self._record.request_id, item)
                if self._state.phase is Phase.DRAINING:  # ended by the drain's deadline: retry elsewhere
                    raise APIError(503, "the server is shutting down; retry later",
                                   headers={"Retry-After": str(self._state.config.retry_after_s)}) from None
                # a lost replica is the client's to know (its retry may succeed); an engine fault is ours
                raise APIError(500, str(item) if isinstance(item, ReplicaLostError) else "internal server error") from None
            if isinstance(item, Exception):
                self._record.outcome = "error"
                raise item
            self._observe(index, item)
            if item.finished:
                request, metrics = self._requests[index], self._state.metrics
                self._unfinished.discard(request.request_id)
                if item.queue_time_s is not None:  # a beam search's has none: its steps queue one by one
                    metrics.request_queue_time.observe(item.queue_time_s)
                for completion in item.outputs:  # each of n samples counts as a request, as in vLLM
                    metrics.request_success.labels(completion.finish_reason or "unknown").inc()
                    metrics.request_prompt_tokens.observe(len(request.prompt_token_ids))
                    metrics.request_generation_tokens.observe(len(completion.token_ids))
            yield index, item

    async def aclose(self) -> None:
        """Abort whatever is still running and release the queue slot; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        for pump in self._pumps:
            pump.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        if not self._started:
            self._state.mark_started()
        elif self._record.outcome == "ok":
            self._state.metrics.e2e_request_latency.observe(time.monotonic() - self._arrival)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[T], receive: Receive, record: RequestRecord) -> T:
    """Await `work`, but give up at once (APIError 499) if the client hangs up first.

    Starlette cancels a *streaming* body on disconnect by itself; this covers the waits that
    happen before a response exists (a non-streaming request, or a stream's first token).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        record.outcome = "client_closed"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client closed the request")
    return task.result()


async def collect(generation: Generation) -> dict[int, RequestOutput]:
    """The last output of each prompt, once all have finished."""
    last: dict[int, RequestOutput] = {}
    async for index, out in generation.outputs(final_only=True):
        last[index] = out
    return last


async def collect_while_connected(generation: Generation, receive: Receive,
                                  record: RequestRecord) -> dict[int, RequestOutput]:
    """`collect` for a client that may hang up first (APIError 499); the generation is closed
    (its requests aborted, their KV blocks freed) however it ends."""
    try:
        return await until_disconnect(collect(generation), receive, record)
    finally:
        await generation.aclose()
