"""The API process's side of a cluster: the router in front of replica actors, `generate()`-shaped.

`generate` has AsyncEngine's signature, so a server can hold either. A request waits in the
router's global queue until a replica is chosen, then streams from that replica's actor. A poll
loop pulls every replica's KV events and load into the router (resyncing a mirror from the
replica's snapshot after a gap, a restart, or when this router joins late) and dispatches
whatever the new state admits.

Faults: a replica that stops answering is marked dead and gets no new requests. A request whose
replica dies before any output reached the caller is retried from scratch elsewhere; one that
already streamed output ends with an `EngineError`. Ray restarts the actor, and the first report
it answers puts it back in rotation. Every accepted request ends with a completion or an error.

Not here yet: withdrawing waiting requests from a replica (the engine has no withdraw call, so
migration runs only in the simulator).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError

from engine.async_engine import EngineError
from engine.cluster.index import ReplicaState
from engine.cluster.replica import ReplicaReport, ReplicaShape
from engine.cluster.router import Dispatch, Router, RouterConfig, RouteRequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


async def _get(ref: ray.ObjectRef):
    return await ref


class ClusterEngine:
    """Routes requests over replica actors and keeps the router's view of them current."""

    def __init__(self, actors: list[ray.actor.ActorHandle], router_config: RouterConfig, tokenizer,
                 poll_interval_s: float = 0.05, poll_timeout_s: float = 2.0):
        shapes: list[ReplicaShape] = ray.get([a.shape.remote() for a in actors])
        if any(s.block_size != router_config.block_size for s in shapes):
            raise ValueError("the router's block_size must equal every replica's")
        self.actors = actors
        self.router = Router(router_config, [ReplicaState(i, s.num_blocks, s.max_num_seqs)
                                             for i, s in enumerate(shapes)])
        for state in self.router.replicas.values():
            state.prefix.mark_stale()  # replicas may hold blocks cached before this router existed
        self.tokenizer = tokenizer
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.num_dispatched = [0] * len(actors)
        self._incarnations: list[str | None] = [None] * len(actors)
        self._placed: dict[str, asyncio.Future] = {}  # requests waiting in the router's queue
        self._active: set[str] = set()  # every request between generate() and its end
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll_loop())

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def refresh(self) -> None:
        """Pull every replica's events and load into the router, then dispatch what now fits."""
        await asyncio.gather(*(self._refresh_one(i) for i in range(len(self.actors))))
        self._place(self.router.dispatch_ready())

    async def _refresh_one(self, replica_id: int) -> None:
        state, actor = self.router.replicas[replica_id], self.actors[replica_id]
        try:
            report: ReplicaReport = await asyncio.wait_for(_get(actor.report.remote()), self.poll_timeout_s)
            if report.incarnation != self._incarnations[replica_id]:
                state.prefix.mark_stale()  # restarted (or first seen): its seq began again
                self._incarnations[replica_id] = report.incarnation
            if not state.prefix.apply(report.events):
                hashes, seq = await asyncio.wait_for(_get(actor.snapshot.remote()), self.poll_timeout_s)
                state.prefix.resync(hashes, seq)
        except (RayActorError, TimeoutError):
            if state.is_alive:
                self.router.mark_dead(replica_id)
            return
        state.report(report.num_free_blocks, report.num_running, report.num_waiting)
        if not state.is_alive:
            self._place(self.router.mark_alive(replica_id))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.refresh()

    def _place(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            self.num_dispatched[d.replica_id] += 1
            future = self._placed.get(d.request_id)
            if future is not None and not future.done():
                future.set_result(d.replica_id)

    async def _route(self, request: RouteRequest) -> int:
        """Submit to the router and wait for a replica (cancelling leaves the queue clean)."""
        placed = asyncio.get_running_loop().create_future()
        self._placed[request.request_id] = placed
        try:
            self._place(self.router.submit(request))
            return await placed
        except BaseException:
            self.router.cancel(request.request_id)
            raise
        finally:
            del self._placed[request.request_id]

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs from whichever replica the router picks."""
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request = RouteRequest(request_id, token_ids, params.max_tokens * params.n)
        self._active.add(request_id)
        try:
            async for out in self._generate_with_retry(request, params):
                yield out
        finally:
            self._active.discard(request_id)

    async def _generate_with_retry(self, request: RouteRequest, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        request_id, token_ids = request.request_id, request.token_ids
        for _ in range(len(self.actors)):  # one retry per replica at most
            replica_id = await self._route(request)
            yielded = done = False
            try:
                stream = self.actors[replica_id].generate.options(num_returns="streaming").remote(
                    token_ids, params, request_id)
                async for ref in stream:
                    out: RequestOutput = await ref
                    if any(c.token_ids for c in out.outputs):
                        self.router.on_first_token(replica_id, request_id)
                    done = out.finished
                    yielded = True
                    yield out
                return
            except RayActorError as e:
                done = True  # nothing left to abort on a dead replica
                if self.router.replicas[replica_id].is_alive:
                    self.router.mark_dead(replica_id)
                if yielded:
                    raise EngineError(f"replica {replica_id} died while streaming request {request_id!r}; "
                                      "the output so far is incomplete") from e
            finally:
                if not done:  # the caller stopped listening
                    self.actors[replica_id].abort.remote(request_id)
                self._place(self.router.on_complete(replica_id, request_id))
        raise EngineError(f"request {request_id!r} failed on {len(self.actors)} replicas before any output")
