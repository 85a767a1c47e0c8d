"""The API process's side of a cluster: the router in front of replica actors, as a `ServingEngine`.

`ClusterEngine` has AsyncEngine's calls (sync `start`/`shutdown`/`abort`/`stats`, async
`generate`), so a server holds either. The router, its poll loop and every request's routing run
on one event loop of its own, on a thread (as AsyncEngine's step loop runs on a thread): the
router needs no locks, and callers on any loop get outputs handed over thread-safely.

A request waits in the router's global queue until a replica is chosen, then streams from that
replica's actor. The poll loop pulls every replica's KV events and stats into the router
(resyncing a mirror from the replica's snapshot after a gap, a restart, or when this router
joins late) and dispatches whatever the new state admits.

Migration: when the router names unstarted requests on a replica short of KV, the replica is
asked to withdraw each. A withdrawn request's stream there ends without output and it goes back
to the head of the router's queue, to be placed elsewhere; one the replica already started (the
withdraw answers False) stays where it is and is never asked about again.

Faults: a replica that stops answering is marked dead and gets no new requests; once it has
been silent for `lost_after_s` (a wedged process, a partitioned node) its streams give up on it
too, as they do at once when its actor dies. A request whose replica is lost before any output
reached the caller is retried from scratch elsewhere; one that already streamed output ends with
a `ReplicaLostError` (which a caller that only keeps the final output may start again). Ray
restarts the actor, and the first report it answers puts it back in rotation. Every accepted
request ends with a completion or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from engine.async_engine import EngineError, ReplicaLostError
from engine.cluster.index import ReplicaState
from engine.cluster.replica import ReplicaReport, ReplicaShape, launch_replicas
from engine.cluster.router import Dispatch, Policy, Router, RouterConfig, RouteRequest
from engine.config import EngineConfig, check_priority
from engine.lora import LoRARequest
from engine.outputs import ClusterStats, EngineStats, ReplicaStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_SUMMED = tuple(f.name for f in dataclasses.fields(EngineStats) if f.type == "int" and f.name != "max_loras")


async def _get(ref: ray.ObjectRef):
    return await ref


class _End:
    """Output-queue marker: the request is over and the cluster side has cleaned up after it."""


class _Silent(Exception):
    """A replica was given up on (silent for lost_after_s) while a stream waited on it."""


class _Outcome(enum.Enum):
    FINISHED = "finished"
    WITHDRAWN = "withdrawn"  # back in the router's queue: wait for the next placement
    RETRY = "retry"  # the replica died before any output: route again from scratch


@dataclass(slots=True)
class _Flight:
    """One request on the router's loop, from `generate()` until its stream ends."""

    request: RouteRequest
    params: SamplingParams
    deliver: Callable[[object], None]
    placed: asyncio.Future[int] | None = None  # while it waits in the router's queue
    replica_id: int | None = None  # where it was last dispatched
    withdrawal: asyncio.Future[bool] | None = None  # a withdraw in flight, or its answer
    started: bool = False  # a withdraw said it started: never ask again
    tasks: set[asyncio.Task] = field(default_factory=set)
    arrived_at: float = field(default_factory=time.monotonic)
    dispatched_at: float | None = None  # when the router last placed it (its queue wait ends there)


def _sum_stats(reports: list[EngineStats]) -> EngineStats:
    """The replicas' counters summed, and the adapters any of them runs or queues."""
    adapters = {name: tuple(sorted({a for s in reports for a in getattr(s, name)}))
                for name in ("running_loras", "waiting_loras")}
    return EngineStats(**{name: sum(getattr(s, name) for s in reports) for name in _SUMMED}, **adapters,
                       max_loras=max((s.max_loras for s in reports), default=0))


def init_ray(address: str | None = None, num_replicas: int = 1) -> None:
    """Join the Ray cluster at `address` (`auto`: this machine's), or start a local instance.

    Call it from the main thread: a local Ray started from another thread leaves its agent
    processes running after `ray.shutdown()`.
    """
    if ray.is_initialized():
        return
    if address is None:
        # logical CPUs: one per replica even on a smaller machine (they then share cores)
        ray.init(num_cpus=max(os.cpu_count() or 1, num_replicas), include_dashboard=False)
    else:
        ray.init(address=address)


def _replica_error(exc: RayTaskError) -> Exception:
    """What a replica's method raised, as the engine raised it: a ValueError (the request's or the
    call's own fault) or an EngineError, with the message and not Ray's remote traceback."""
    if isinstance(exc.cause, ValueError):
        return ValueError(str(exc.cause))
    return EngineError(str(exc.cause) if exc.cause is not None else "a replica failed")


class ClusterEngine:
    """Routes requests over replica actors and keeps the router's view of them current."""

    def __init__(self, actors: list[ray.actor.ActorHandle], router_config: RouterConfig, tokenizer,
                 poll_interval_s: float = 0.05, poll_timeout_s: float = 2.0, lost_after_s: float = 30.0,
                 on_shutdown: Callable[[], None] | None = None):
        try:
            shapes: list[ReplicaShape] = ray.get([a.shape.remote() for a in actors])
        except RayTaskError as exc:
            error = _replica_error(exc)
            if isinstance(error, ValueError):  # the engine's own reason
                raise ValueError(f"a replica refused to start: {error}") from None
            raise
        if any(s.block_size != router_config.block_size for s in shapes):
            raise ValueError("the router's block_size must equal every replica's")
        self.actors = actors
        self.router = Router(router_config, [ReplicaState(i, s.num_blocks, s.max_num_seqs)
                                             for i, s in enumerate(shapes)])
        for state in self.router.replicas.values():
            state.prefix.mark_stale()  # replicas may hold blocks cached before this router existed
        self.tokenizer = tokenizer
        self.max_model_len = min(s.max_model_len for s in shapes)
        self.max_logprobs = min(s.max_logprobs for s in shapes)
        self.eos_token_ids = shapes[0].eos_token_ids
        self.lora_names = frozenset(shapes[0].lora_paths)
        self._startup_loras = dict(shapes[0].lora_paths)  # name → folder, what every replica's config loads
        self._runtime_loras: dict[str, LoRARequest] = {}  # loaded since start: a restarted replica gets them again
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.lost_after_s = lost_after_s
        self.num_dispatched = [0] * len(actors)
        self._on_shutdown = on_shutdown
        self._incarnations: list[str | None] = [None] * len(actors)
        self._reports = [EngineStats(num_blocks_total=s.num_blocks, num_blocks_free=s.num_blocks) for s in shapes]
        self._stats = self._snapshot()
        # touched from callers' threads
        self._ids: set[str] = set()  # ids in use, from generate() until the router side is clean
        self._ids_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # touched on the router's loop only
        self._flights: dict[str, _Flight] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._poller: asyncio.Task | None = None
        self._silent_since: list[float | None] = [None] * len(actors)  # first unanswered report in a row
        self._lost: list[asyncio.Future] = []  # per replica: done once its streams should give up on it

    @classmethod
    def launch(cls, config: EngineConfig, num_replicas: int, policy: Policy | str = Policy.COORDINATED,
               ray_address: str | None = None, **kwargs: Any) -> ClusterEngine:
        """Start a local Ray instance (or join `ray_address`), launch replicas, wait for them.

        Returns an engine not started yet; its `shutdown` also kills the replicas, and stops
        Ray when this call started it.
        """
        router_config = RouterConfig(policy=policy, block_size=config.block_size,  # fail before Ray starts
                                     prefix_caching=config.enable_prefix_caching,
                                     scheduling_policy=config.scheduling_policy)
        started_ray = not ray.is_initialized()
        init_ray(ray_address, num_replicas)
        try:
            actors = launch_replicas(config, num_replicas)
        except BaseException:
            if started_ray:
                ray.shutdown()
            raise

        def stop() -> None:
            for actor in actors:
                ray.kill(actor)
            if started_ray:
                ray.shutdown()

        try:
            return cls(actors, router_config, load_tokenizer(config.tokenizer or config.model),
                       on_shutdown=stop, **kwargs)
        except BaseException:
            stop()
            raise

    # ---- lifecycle (any thread) ---------------------------------------------------------------

    def start(self) -> None:
        """Start the router's loop and take a first report from every replica."""
        if self._thread is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="driftgate-router", daemon=True)
        self._thread.start()
        self._call(self._start())

    def shutdown(self, timeout: float = 10.0) -> None:
        """End every request (EngineError), stop the loop, then run `on_shutdown`."""
        self._stopping = True
        if self._thread is not None and self._loop is not None:
            with contextlib.suppress(TimeoutError):
                self._call(self._stop(), timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    @property
    def is_alive(self) -> bool:
        """The router's loop runs and at least one replica answers."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and any(r.is_alive for r in self.router.replicas.values()))

    def stats(self) -> EngineStats:
        """Replicas' stats summed (as of their last reports), the router's queue counted as waiting."""
        return self._stats

    def refresh(self, timeout: float | None = None) -> None:
        """Poll every replica now (tests use it to see a finished request's blocks at once)."""
        self._call(self._refresh(), timeout)

    def _call(self, coro: Coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- requests (any thread, any loop) ------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs from whichever replica the router picks (and re-picks)."""
        if not self.is_alive:
            raise EngineError("the cluster engine is not running")
        check_priority(priority, self.router.config.scheduling_policy)
        if lora is not None and lora not in self.lora_names:
            raise ValueError(f"unknown LoRA adapter {lora!r}; loaded: {', '.join(sorted(self.lora_names)) or 'none'}")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        with self._ids_lock:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._ids.add(request_id)
        caller = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def deliver(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
                caller.call_soon_threadsafe(outputs.put_nowait, item)

        budget = params.output_budget(len(token_ids), self.max_model_len) * params.n
        flight = _Flight(RouteRequest(request_id, token_ids, budget, priority, params.cache_salt, lora), params, deliver)
        self._loop.call_soon_threadsafe(self._begin, flight)
        ended = False  # the router side is done (an error or _End): the id may already be reused
        try:
            while True:
                item = await outputs.get()
                ended = isinstance(item, (_End, BaseException))
                if isinstance(item, _End):
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.queue_time_s is not None and flight.dispatched_at is not None:
                    # the replica counts from when it got the request: the router's queue came first
                    item.queue_time_s += flight.dispatched_at - flight.arrived_at
                yield item
        finally:
            if not ended:
                self.abort(request_id)

    async def add_lora(self, request: LoRARequest) -> None:
        """Load a LoRA adapter on every live replica (a dead one gets it when it rejoins); if one
        refuses, the others unload it again and the ValueError says why."""
        failed = [r for r in await self._on_replicas("add_lora", request) if isinstance(r, ValueError)]
        if failed:
            await self._on_replicas("remove_lora", request.lora_name)
            raise failed[0]
        self._runtime_loras[request.lora_name] = request
        self.lora_names = self.lora_names | {request.lora_name}

    async def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter from every replica; refused while any request uses it. A replica
        that refuses (a request the router had not yet seen) makes the others load it again, so
        the adapter stays whole or goes everywhere."""
        if name not in self.lora_names:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        if users := sum(f.request.lora == name for f in list(self._flights.values())):
            raise ValueError(f"LoRA adapter {name!r} serves {users} request(s) in flight; retry once they end")
        self.lora_names = self.lora_names - {name}  # no new requests for it while replicas unload it
        results = await self._on_replicas("remove_lora", name)
        if failed := [r for r in results if isinstance(r, ValueError)]:
            request = self._runtime_loras.get(name) or LoRARequest(name, 0, self._startup_loras[name])
            await self._on_replicas("add_lora", request,
                                    only=[i for i, r in enumerate(results) if not isinstance(r, ValueError)])
            self.lora_names = self.lora_names | {name}
            raise failed[0]
        self._runtime_loras.pop(name, None)

    async def _on_replicas(self, method: str, arg: object, only: list[int] | None = None) -> list[object]:
        """Call an actor method on every replica (or those in `only`): each one's result, its
        ValueError, or None where it is dead."""
        async def call(actor) -> object:
            try:
                return await _get(getattr(actor, method).remote(arg))
            except RayTaskError as exc:
                if isinstance(error := _replica_error(exc), ValueError):
                    return error
                raise
            except RayActorError:
                return None

        actors = self.actors if only is None else [self.actors[i] for i in only]
        return list(await asyncio.gather(*(call(a) for a in actors)))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is: the router's queue, a withdrawal, or a replica."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._cancel, request_id)

    # ---- the router's loop --------------------------------------------------------------------

    def _begin(self, flight: _Flight) -> None:
        request_id = flight.request.request_id
        task = asyncio.get_running_loop().create_task(self._serve(flight))
        self._tasks[request_id] = task
        task.add_done_callback(functools.partial(self._end, flight))

    def _end(self, flight: _Flight, task: asyncio.Task) -> None:
        """Runs even for a task cancelled before it started, so the id is always released."""
        request_id = flight.request.request_id
        self._tasks.pop(request_id, None)
        with self._ids_lock:
            self._ids.discard(request_id)
        # the caller stops at an error as at _End: exactly one terminal item either way
        if task.cancelled():
            why = "the cluster engine is shutting down" if self._stopping else "the request was aborted"
            flight.deliver(EngineError(why))
        elif task.exception() is not None:
            flight.deliver(task.exception())
        else:
            flight.deliver(_End())

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _start(self) -> None:
        self._lost = [asyncio.get_running_loop().create_future() for _ in self.actors]
        await self._refresh()
        self._poller = asyncio.create_task(self._poll_loop())

    async def _stop(self) -> None:
        tasks = [t for t in (self._poller, *self._tasks.values(),
                             *(t for f in self._flights.values() for t in f.tasks)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._refresh()

    async def _refresh(self) -> None:
        """Pull every replica's events and stats into the router, dispatch what now fits, migrate."""
        await asyncio.gather(*(self._refresh_one(i) for i in range(len(self.actors))))
        self._stats = self._snapshot()
        self._place(self.router.dispatch_ready())
        for replica_id, state in self.router.replicas.items():
            if state.is_alive:
                for request_id in self.router.migration_candidates(replica_id):
                    self._start_withdrawal(replica_id, request_id)

    async def _refresh_one(self, replica_id: int) -> None:
        state, actor = self.router.replicas[replica_id], self.actors[replica_id]
        try:
            report: ReplicaReport = await asyncio.wait_for(_get(actor.report.remote()), self.poll_timeout_s)
            if report.incarnation != self._incarnations[replica_id]:
                state.prefix.mark_stale()  # restarted (or first seen): its seq began again
                for request in list(self._runtime_loras.values()):  # its config holds only the first ones
                    try:
                        await _get(actor.add_lora.remote(request))
                    except RayTaskError as exc:  # its requests for this adapter will fail, saying why
                        log.warning("replica %d could not reload LoRA adapter %r: %s", replica_id,
                                    request.lora_name, exc.cause)
                self._incarnations[replica_id] = report.incarnation
            if not state.prefix.apply(report.events):
                hashes, seq = await asyncio.wait_for(_get(actor.snapshot.remote()), self.poll_timeout_s)
                state.prefix.resync(hashes, seq)
        except (RayActorError, TimeoutError):
            self._stop_routing(replica_id)
            since = self._silent_since[replica_id] = self._silent_since[replica_id] or time.monotonic()
            if time.monotonic() - since >= self.lost_after_s and not self._lost[replica_id].done():
                self._lost[replica_id].set_result(None)
            return
        self._silent_since[replica_id] = None
        stats = report.stats
        self._reports[replica_id] = stats
        state.report(stats.num_blocks_free, stats.num_running, stats.num_waiting)
        if not state.is_alive:
            if self._lost[replica_id].done():
                self._lost[replica_id] = asyncio.get_running_loop().create_future()
            self._place(self.router.mark_alive(replica_id))

    def _stop_routing(self, replica_id: int) -> None:
        """No new requests for a replica that stopped answering; its last report counts no more."""
        if self.router.replicas[replica_id].is_alive:
            self.router.mark_dead(replica_id)
            self._reports[replica_id] = EngineStats()

    def _snapshot(self) -> EngineStats:
        stats = _sum_stats(self._reports)
        stats.num_waiting += len(self.router.queue)
        stats.cluster = ClusterStats(
            [ReplicaStats(i, self.router.replicas[i].is_alive, self.num_dispatched[i], s)
             for i, s in enumerate(self._reports)],
            len(self.router.queue), self.router.num_migrated)
        return stats

    def _place(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            self.num_dispatched[d.replica_id] += 1
            flight = self._flights.get(d.request_id)
            if flight is None or flight.placed is None or flight.placed.done():
                # nobody waits for it (the router only queues live requests, so this is a bug guard)
                self._place(self.router.on_complete(d.replica_id, d.request_id))
                continue
            flight.replica_id = d.replica_id
            flight.dispatched_at = time.monotonic()
            flight.placed.set_result(d.replica_id)

    def _enqueue(self, flight: _Flight, dispatches: Callable[[], list[Dispatch]]) -> asyncio.Future[int]:
        """Make `flight` wait for a placement, then let the router (re)queue it."""
        flight.placed = asyncio.get_running_loop().create_future()
        placed = flight.placed
        self._place(dispatches())
        return placed

    async def _serve(self, flight: _Flight) -> None:
        request = flight.request
        request_id = request.request_id
        self._flights[request_id] = flight
        placed = taken = None
        try:
            placed = self._enqueue(flight, lambda: self.router.submit(request))
            num_failed = 0
            while True:
                replica_id = await placed
                taken = placed
                outcome = await self._stream(flight, replica_id)
                if outcome is _Outcome.FINISHED:
                    return
                if outcome is _Outcome.WITHDRAWN:
                    placed = flight.placed  # the withdrawal queued it again
                    continue
                num_failed += 1
                if num_failed >= len(self.actors):  # one try per replica at most
                    raise EngineError(f"request {request_id!r} failed on {num_failed} replicas before any output")
                placed = self._enqueue(flight, lambda: self.router.submit(request))
        finally:
            del self._flights[request_id]
            self.router.cancel(request_id)  # if it was still queued
            if placed is not None and placed is not taken and placed.done() and not placed.cancelled():
                # dispatched, but aborted before its stream began: the replica's slot is released here
                self._place(self.router.on_complete(placed.result(), request_id))

    async def _stream(self, flight: _Flight, replica_id: int) -> _Outcome:
        """Relay one replica's stream for `flight`; how it ended decides what happens next."""
        request_id = flight.request.request_id
        flight.withdrawal = None
        yielded = over = withdrawn = stopped = False
        try:
            stream = self.actors[replica_id].generate.options(num_returns="streaming").remote(
                flight.request.token_ids, flight.params, request_id, flight.request.priority, flight.request.lora)
            last = None
            while (out := await self._next_output(stream, replica_id)) is not None:
                self.router.on_progress(replica_id, request_id, sum(len(c.token_ids) for c in out.outputs))
                over = out.finished
                yielded = True
                flight.deliver(out)
                last = out
            if over:
                # its own stop or length: a length the router's output prediction learns from
                stopped = all(c.finish_reason in ("stop", "length") for c in last.outputs)
                return _Outcome.FINISHED
            # ended without output: the only cause is a withdrawal (whose answer may still be on its way)
            over = withdrawn = flight.withdrawal is not None and await flight.withdrawal
            if withdrawn:
                return _Outcome.WITHDRAWN
            raise EngineError(f"replica {replica_id} ended request {request_id!r} before it finished")
        except RayTaskError as exc:  # the replica's engine refused it or failed: say why, not Ray's traceback
            over = True
            raise _replica_error(exc) from None
        except (RayActorError, _Silent) as e:
            over = isinstance(e, RayActorError)  # nothing left to abort on a dead replica; a silent one may wake
            self._stop_routing(replica_id)
            if yielded:
                why = "died" if over else f"stopped answering for {self.lost_after_s:g} s"
                raise ReplicaLostError(f"replica {replica_id} {why} while serving request {request_id!r}; "
                                       "the output so far is incomplete") from e
            return _Outcome.RETRY
        finally:
            if not over:  # the caller stopped listening, or it failed
                self.actors[replica_id].abort.remote(request_id)
            if not withdrawn:  # a withdrawal already released it (and it may be placed again)
                self._place(self.router.on_complete(replica_id, request_id, finished=stopped))

    async def _next_output(self, stream: ray.ObjectRefGenerator, replica_id: int) -> RequestOutput | None:
        """The replica stream's next output (None at its end); `_Silent` if the replica is given up
        on first, since a wedged replica's stream would neither yield nor fail."""
        async def step() -> RequestOutput | None:
            try:
                ref = await anext(stream)
            except StopAsyncIteration:
                return None
            return await ref

        task = asyncio.ensure_future(step())
        try:
            await asyncio.wait((task, self._lost[replica_id]), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise _Silent(replica_id)
            return task.result()
        finally:
            task.cancel()

    def _start_withdrawal(self, replica_id: int, request_id: str) -> None:
        flight = self._flights.get(request_id)
        queued = flight is not None and flight.placed is not None and not flight.placed.done()
        if (flight is None or queued or flight.started or flight.replica_id != replica_id
                or flight.withdrawal is not None):
            return  # gone, still queued, known started, elsewhere, or already asked
        flight.withdrawal = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._withdraw(flight, replica_id))
        flight.tasks.add(task)
        task.add_done_callback(flight.tasks.discard)

    async def _withdraw(self, flight: _Flight, replica_id: int) -> None:
        """Ask the replica to give `flight` back; requeue it if it did, pin it if it had started."""
        request_id = flight.request.request_id
        withdrawal = flight.withdrawal
        try:
            withdrawn = await asyncio.wait_for(_get(self.actors[replica_id].withdraw.remote(request_id)),
                                               self.poll_timeout_s)
        except (RayActorError, TimeoutError):
            withdrawn = False  # a dead replica's requests retry through their streams
        if withdrawn and self._flights.get(request_id) is flight:
            self._enqueue(flight, lambda: self.router.withdrawn(replica_id, [flight.request]))
        elif not withdrawn:
            flight.started = True
            flight.withdrawal = None
        withdrawal.set_result(withdrawn)
