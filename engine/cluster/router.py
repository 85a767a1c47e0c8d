"""Which replica serves a request, and when (pure policy: no Ray, no I/O, no clock).

Three policies:
- `round-robin` and `least-loaded` (fewest in-flight requests) dispatch at once, as an
  independent load balancer in front of N engines would; each engine queues locally.
- `coordinated` holds requests in one global queue and dispatches a request only to a replica that
  can admit it whole (a sequence slot is free, and the replica's predicted KV peak, every
  request there growing to its predicted output length, fits; see `index.py` and
  `lengths.py`), so an engine does not admit work it would later preempt. Among those it picks
  the best weighted score, llm-d's 3:2:2 over scores in [0, 1]:
    prefix = cached blocks from the start / prompt blocks   (work the replica skips; blocks that
             requests already sent there will compute count too, × pending_prefix_weight)
    kv     = free blocks at the peak with this request / total  (Dynamo's "decode blocks" load)
    queue  = (max q − q) / (max q − min q) over candidates, q = blocks still to prefill there
  An SGLang-style override picks the fewest in-flight requests instead when replicas are
  imbalanced (max − min > balance_abs and max > balance_rel · min), so affinity cannot pile
  everything onto one replica. The queue is served in arrival order, except that up to
  `max_overtakes` later requests may pass a head that fits nowhere yet (see `dispatch_ready`).
  Under the `priority` scheduling policy the queue is in priority order, and a request that fits
  nowhere still goes to a replica running something less urgent, whose scheduler preempts it.

Migration: when a replica's reported free KV falls below `migrate_below_free_fraction` while it
still has waiting requests (its next admission or decode growth would preempt), the router asks
it to withdraw the requests it has not started, and re-dispatches whatever came back elsewhere.
Only the replica knows what it started, so withdrawal is two-phase and a request is always in
exactly one place: in flight on a replica, or in the router's queue.
"""

from __future__ import annotations

import enum
from bisect import insort_left, insort_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_manager import hash_token_blocks, root_hash
from engine.cluster.index import ReplicaState
from engine.cluster.lengths import OutputLengths
from engine.scheduler import SCHEDULING_POLICIES


class Policy(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    COORDINATED = "coordinated"


@dataclass(slots=True)
class RouterConfig:
    policy: Policy = Policy.COORDINATED
    block_size: int = 16  # must equal the replicas' block size: hashes are per block
    prefix_weight: float = 3.0
    kv_weight: float = 2.0
    queue_weight: float = 2.0
    balance_abs: int = 64  # SGLang's defaults
    balance_rel: float = 1.5
    migrate_below_free_fraction: float = 0.05
    # a block another request sent to the replica is about to compute, against one already cached:
    # the same saving once that prefill runs (the scheduler shares blocks within a step)
    pending_prefix_weight: float = 1.0
    # how many later requests may pass a queue head that fits nowhere yet (0: strict FIFO)
    max_overtakes: int = 32
    # the replicas cache prefixes; off: every prompt is computed and held in full, nothing shared
    prefix_caching: bool = True
    # "priority": requests carry one (lower first) and the global queue keeps that order, as the
    # replicas' schedulers do; "fcfs": every priority is 0, so the queue is in arrival order
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            try:
                self.policy = Policy(self.policy)
            except ValueError:
                raise ValueError(f"unknown policy {self.policy!r}; "
                                 f"choose from {', '.join(p.value for p in Policy)}") from None
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if min(self.prefix_weight, self.kv_weight, self.queue_weight) < 0:
            raise ValueError("score weights must be non-negative")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be ≥ 0 and balance_rel ≥ 1")
        if not 0.0 <= self.migrate_below_free_fraction < 1.0:
            raise ValueError("migrate_below_free_fraction must be in [0, 1)")
        if not 0.0 <= self.pending_prefix_weight <= 1.0:
            raise ValueError("pending_prefix_weight must be in [0, 1]")
        if self.max_overtakes < 0:
            raise ValueError("max_overtakes must be ≥ 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")


@dataclass(slots=True)
class RouteRequest:
    """A request as the router needs it: its tokens (for block hashes) and its output budget."""

    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    priority: int = 0  # lower is more urgent (only non-zero under the "priority" policy)
    cache_salt: str | None = None  # its blocks' hashes start from this salt and adapter, as in its engine
    lora: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)  # replicas it was withdrawn from
    num_overtaken: int = 0  # later requests placed while it waited at the head of the queue
    # while it waits: replica → (its version, planned output, blocks left with this request) as
    # last computed, since a queued request is looked at again on every event and most
    # replicas have not changed since
    free_seen: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send `request_id` to replica `replica_id`."""

    request_id: str
    replica_id: int


class Router:
    """Routing policy over a fixed list of replicas; the caller executes the returned dispatches."""

    def __init__(self, config: RouterConfig, replicas: list[ReplicaState]):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.config = config
        self.replicas = {r.replica_id: r for r in replicas}
        self.queue: deque[RouteRequest] = deque()
        self.num_migrated = 0
        self._next_rr = 0
        self.output_lengths = OutputLengths()

    def submit(self, request: RouteRequest) -> list[Dispatch]:
        """Accept a request; returns what can be dispatched now (possibly nothing)."""
        bs = self.config.block_size
        request.block_hashes = hash_token_blocks(request.token_ids, bs, root_hash(request.cache_salt, request.lora))
        room = max(r.num_total_blocks for r in self.replicas.values()) * bs - len(request.token_ids)
        if room < 1:
            raise ValueError(f"request {request.request_id}'s prompt needs more KV blocks than any replica has")
        # n completions of one prompt may add up to more than a replica holds; its engine then
        # runs them in turn (preempting within the request), so plan on at most a whole replica
        request.max_tokens = min(request.max_tokens, room)
        # behind every request as urgent or more (all of them, when priorities are 0)
        insort_right(self.queue, request, key=_priority)
        return self.dispatch_ready()

    def dispatch_ready(self) -> list[Dispatch]:
        """Dispatch queued requests in arrival order; a few may pass a head that does not fit.

        Strict FIFO would let one head needing a big uncached prompt hold back followers that
        need a few blocks where their prefix is cached (head-of-line blocking). So while the
        head waits, the next `max_overtakes` requests are tried too, and each one placed counts
        against the head; once it has been passed that many times the queue is strict FIFO
        again until it is placed, so nothing waits forever.
        """
        dispatches = []
        i = 0
        while i < len(self.queue) and i <= self.config.max_overtakes:
            request = self.queue[i]
            replica = self._choose(request)
            if replica is None:
                if self.queue[0].num_overtaken >= self.config.max_overtakes:
                    break
                i += 1
                continue
            del self.queue[i]
            if i:
                self.queue[0].num_overtaken += 1
            i = 0  # what just went may have changed what the head sees
            hashes = self._hashable_prefix(request)
            _, hit = replica.prefix_hits(hashes)
            bs = self.config.block_size
            replica.on_dispatch(request.request_id, hashes, len(request.token_ids) - len(hashes) * bs,
                                request.max_tokens, len(request.token_ids) - hit * bs,
                                self.output_lengths.predict(request.max_tokens), request.priority)
            dispatches.append(Dispatch(request.request_id, replica.replica_id))
        return dispatches

    def cancel(self, request_id: str) -> bool:
        """Drop a request still waiting in the global queue; False if it is not there."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                return True
        return False

    def on_progress(self, replica_id: int, request_id: str, num_output_tokens: int) -> None:
        """The request has generated this many tokens on that replica (its KV grew by as many)."""
        self.replicas[replica_id].on_progress(request_id, num_output_tokens)

    def on_complete(self, replica_id: int, request_id: str, finished: bool = False) -> list[Dispatch]:
        """A request ended on a replica: its capacity may admit queued ones. `finished`: it
        stopped on its own (not aborted or failed), so its length teaches the output prediction."""
        entry = self.replicas[replica_id].release(request_id)
        if finished and entry is not None:
            self.output_lengths.observe(entry.max_tokens, entry.num_output_tokens)
        return self.dispatch_ready()

    def mark_dead(self, replica_id: int) -> None:
        """Stop routing to a replica; its in-flight requests end (or retry) through their callers."""
        replica = self.replicas[replica_id]
        replica.is_alive = False
        replica.clear()
        replica.prefix.mark_stale()  # a restarted replica starts a new cache and a new seq

    def mark_alive(self, replica_id: int) -> list[Dispatch]:
        """A (restarted) replica answers again: route to it, and dispatch what it can take."""
        self.replicas[replica_id].is_alive = True
        return self.dispatch_ready()

    def migration_candidates(self, replica_id: int) -> list[str]:
        """Not-yet-started requests to withdraw from a replica about to preempt (newest first)."""
        replica = self.replicas[replica_id]
        if self.config.policy is not Policy.COORDINATED or len(self.replicas) < 2:
            return []
        threshold = self.config.migrate_below_free_fraction * replica.num_total_blocks
        if replica.num_reported_free_blocks >= threshold or replica.num_reported_waiting == 0:
            return []
        return replica.unstarted_request_ids()

    def withdrawn(self, replica_id: int, requests: list[RouteRequest]) -> list[Dispatch]:
        """The replica gave these back unstarted: queue them ahead of newer arrivals of their
        priority (of any, when priorities are 0), elsewhere."""
        replica = self.replicas[replica_id]
        for request in reversed(requests):  # each in front of its class, in reverse: their order is kept
            replica.release(request.request_id)
            request.excluded.add(replica_id)
            insort_left(self.queue, request, key=_priority)
        self.num_migrated += len(requests)
        return self.dispatch_ready()

    def _hashable_prefix(self, request: RouteRequest) -> list[bytes]:
        # the engine recomputes the last prompt token, so a fully cached prompt gives back a block
        if not self.config.prefix_caching:
            return []
        return request.block_hashes[:(len(request.token_ids) - 1) // self.config.block_size]

    def _choose(self, request: RouteRequest) -> ReplicaState | None:
        replicas = [r for r in self.replicas.values() if r.is_alive]
        if not replicas:
            return None  # queue until one comes back
        policy = self.config.policy
        if policy is Policy.ROUND_ROBIN:
            replica = replicas[self._next_rr % len(replicas)]
            self._next_rr += 1
            return replica
        if policy is Policy.LEAST_LOADED:
            return min(replicas, key=lambda r: (r.num_in_flight, r.replica_id))
        return self._choose_coordinated(request, replicas)

    def _choose_coordinated(self, request: RouteRequest, replicas: list[ReplicaState]) -> ReplicaState | None:
        bs = self.config.block_size
        hashes = self._hashable_prefix(request)
        tail = len(request.token_ids) - len(hashes) * bs
        # the KV prediction (the costly part) only where the cheap checks pass
        num_output = self.output_lengths.predict(request.max_tokens)
        free, fresh = {}, []
        for r in replicas:
            if r.replica_id in request.excluded or r.num_in_flight >= r.max_num_seqs:
                continue
            seen = request.free_seen.get(r.replica_id)
            if seen is not None and seen[0] == r.version and seen[1] == num_output:
                free[r.replica_id] = seen[2]
            else:
                free[r.replica_id] = r.num_free_blocks_with(hashes, tail, num_output, bs)
                fresh.append(r)
        candidates = [r for r in replicas if free.get(r.replica_id, -1) >= 0]
        if not candidates and request.excluded:
            # withdrawn from every fitting replica: its source may have room again by now
            request.excluded.clear()
            return self._choose_coordinated(request, replicas)
        if not candidates:
            if (urgent := self._preempting(request, replicas)) is not None:
                return urgent
            # it waits, and will be looked at again on every event: keep what was computed
            for r in fresh:
                request.free_seen[r.replica_id] = (r.version, num_output, free[r.replica_id])
            return None
        loads = [r.num_in_flight for r in replicas]
        if max(loads) - min(loads) > self.config.balance_abs and max(loads) > self.config.balance_rel * min(loads):
            return min(candidates, key=lambda r: (r.num_in_flight, r.replica_id))
        cached_and_pending = {r.replica_id: r.prefix_hits(hashes) for r in candidates}
        queued = {r.replica_id: -(-r.num_pending_prefill_tokens // bs) for r in candidates}
        q_min, q_max = min(queued.values()), max(queued.values())
        cfg = self.config

        def score(r: ReplicaState) -> float:
            cached, hit = cached_and_pending[r.replica_id]
            prefix = (cached + cfg.pending_prefix_weight * (hit - cached)) / len(hashes) if hashes else 0.0
            kv = free[r.replica_id] / r.num_total_blocks
            queue = 1.0 if q_max == q_min else (q_max - queued[r.replica_id]) / (q_max - q_min)
            return cfg.prefix_weight * prefix + cfg.kv_weight * kv + cfg.queue_weight * queue

        # ties (e.g. an idle cluster) go to the fewest in-flight, then the lowest id
        return max(candidates, key=lambda r: (score(r), -r.num_in_flight, -r.replica_id))

    def _preempting(self, request: RouteRequest, replicas: list[ReplicaState]) -> ReplicaState | None:
        """Under the priority policy, a request that fits nowhere still goes where something less
        urgent runs: that replica's scheduler preempts it, as one engine's would (holding it here
        would leave it behind the very requests it outranks). The replica with the most such
        room, then the fewest in flight."""
        if self.config.scheduling_policy != "priority":
            return None
        room = {r.replica_id: r.num_preemptible_for(request.priority) for r in replicas
                if r.replica_id not in request.excluded}
        return max((r for r in replicas if room.get(r.replica_id, 0) > 0), default=None,
                   key=lambda r: (room[r.replica_id], -r.num_in_flight, -r.replica_id))


def _priority(request: RouteRequest) -> int:
    return request.priority
