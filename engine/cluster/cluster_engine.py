"""The API process's side of a cluster: the router in front of replica actors, `generate()`-shaped.

`generate` has AsyncEngine's signature, so a server can hold either. A request waits in the
router's global queue until a replica is chosen, then streams from that replica's actor. A poll
loop pulls every replica's KV events and load into the router (resyncing a mirror that saw a
gap from the replica's snapshot) and dispatches whatever the new state admits.

Not here yet: withdrawing waiting requests from a replica (the engine has no withdraw call, so
migration runs only in the simulator) and replica-death handling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import ray

from engine.cluster.index import ReplicaState
from engine.cluster.replica import ReplicaReport, ReplicaShape
from engine.cluster.router import Dispatch, Router, RouterConfig, RouteRequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class ClusterEngine:
    """Routes requests over replica actors and keeps the router's view of them current."""

    def __init__(self, actors: list[ray.actor.ActorHandle], router_config: RouterConfig, tokenizer,
                 poll_interval_s: float = 0.05):
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
        self.num_dispatched = [0] * len(actors)
        self._placed: dict[str, asyncio.Future] = {}
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
        reports: list[ReplicaReport] = await asyncio.gather(*(a.report.remote() for a in self.actors))
        for replica_id, report in enumerate(reports):
            state = self.router.replicas[replica_id]
            if not state.prefix.apply(report.events):
                hashes, seq = await self.actors[replica_id].snapshot.remote()
                state.prefix.resync(hashes, seq)
            state.report(report.num_free_blocks, report.num_running, report.num_waiting)
        self._place(self.router.dispatch_ready())

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

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs from whichever replica the router picks."""
        if request_id in self._placed:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        placed = asyncio.get_running_loop().create_future()
        self._placed[request_id] = placed
        replica_id = None
        finished = False
        try:
            self._place(self.router.submit(RouteRequest(request_id, token_ids, params.max_tokens * params.n)))
            replica_id = await placed
            stream = self.actors[replica_id].generate.options(num_returns="streaming").remote(
                token_ids, params, request_id)
            async for ref in stream:
                out: RequestOutput = await ref
                if any(c.token_ids for c in out.outputs):
                    self.router.on_first_token(replica_id, request_id)
                finished = out.finished
                yield out
        finally:
            del self._placed[request_id]
            if replica_id is None:  # cancelled (or rejected) before a replica was chosen
                self.router.cancel(request_id)
            else:
                if not finished:
                    self.actors[replica_id].abort.remote(request_id)
                self._place(self.router.on_complete(replica_id, request_id))
