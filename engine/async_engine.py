"""The engine on a background thread, streaming to asyncio callers.

The step loop runs in its own thread (torch releases the GIL inside kernels), so an asyncio
server stays responsive while the model computes. Requests and aborts reach the loop as
commands applied between steps; outputs come back through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("driftgate.engine")


class EngineError(RuntimeError):
    """The engine failed while running a request (the request ends; the engine keeps going)."""


class ReplicaLostError(EngineError):
    """A cluster's replica was lost after part of a request's output had been handed over: a caller
    that passed none of it on (it keeps only the final output) may start the request again."""


class _Withdrawn:
    """Stream marker: the request was withdrawn before it started; the stream ends with no output."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        if engine is None:
            if config is None:
                raise ValueError("give an EngineConfig or an LLMEngine")
            engine = LLMEngine(config)
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self.eos_token_ids = engine.eos_token_ids
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="driftgate-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (never blocks on the engine thread)."""
        return self._stats

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; ValueError before the first yield
        for a bad request. Cancelling the consumer aborts the request and frees its blocks."""
        if not self.is_alive:
            raise EngineError("the engine is not running")
        if params.structured_outputs is not None:  # compiling its grammar takes ms (the first 0.1 s): off the loop
            state = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params, priority, lora)
        else:
            state = self.engine.make_request(request_id, prompt, params, priority, lora)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)
        self._commands.put(("add", state))
        self._wake.set()
        ended = False  # finished, withdrawn or failed: nothing left to abort
        try:
            while True:
                item = await stream.get()
                if isinstance(item, _Withdrawn):
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True  # refused, failed or aborted: the engine no longer holds it
                    raise item
                yield item
                if item.finished:
                    ended = True
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not ended:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's KV blocks are freed before the next forward."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def withdraw(self, request_id: str) -> bool:
        """Take back a request the engine has not started, so a router can send it elsewhere.

        True only if it was still waiting since it arrived (nothing computed, nothing streamed);
        its `generate` stream then ends without output. False, with nothing changed, once it
        started, finished, or when the id is unknown. Frees nothing: it held nothing.
        """
        if not self.is_alive:
            return False
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._commands.put(("withdraw", (request_id, done)))
        self._wake.set()
        return await asyncio.wrap_future(done)

    async def add_lora(self, request: LoRARequest) -> None:
        """Load a LoRA adapter between steps (ValueError: the engine's reason)."""
        await self._between_steps(functools.partial(self.engine.add_lora, request))

    async def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter no request in flight uses, between steps."""
        await self._between_steps(functools.partial(self.engine.remove_lora, name))

    async def _between_steps(self, call: Callable[[], None]) -> None:
        """Run `call` on the engine thread, where no step is running, and wait for it."""
        if not self.is_alive:
            raise EngineError("the engine is not running")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(("call", (call, done)))
        self._wake.set()
        await asyncio.wrap_future(done)

    # ---- the loop (engine thread) -----------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.submit(arg)
                except ValueError as e:
                    self._deliver(arg.request_id, e)
            elif kind == "withdraw":
                request_id, done = arg
                withdrawn = not self._stopping and self.engine.withdraw_request(request_id)
                if withdrawn:
                    self._deliver(request_id, _Withdrawn())
                done.set_result(withdrawn)
            elif kind == "call":
                call, done = arg
                try:
                    done.set_result(call())
                except ValueError as exc:
                    done.set_exception(exc)
            else:
                self.engine.abort_request(arg)
                # aborted from outside (a router whose caller left): its stream must end too, or
                # whoever still iterates it waits forever; a consumer that left took its stream along
                self._deliver(arg, EngineError("the request was aborted"))

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._stats = self.engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must end the affected requests, not the server
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            self._stats = self.engine.stats()
        self._apply_commands()  # answer withdrawals still queued (no: shutting down)
        self._fail_all(EngineError("the engine is shutting down"))

    def _fail_all(self, error: EngineError) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, error)
