"""The router's view of one replica: an exact mirror of its prefix cache, plus its load.

- The prefix mirror is fed by the replica's KV events (stored / removed / cleared, seq +1 each).
  A gap in seq means an event was lost: the mirror is marked stale and reports no hits (rather
  than wrong ones) until it is rebuilt from a snapshot of the replica's cached hashes.
- Load has two halves. What the replica reports (free blocks, running, waiting) lags by one
  report; what the router predicts itself at dispatch, each output and completion (Dynamo's
  three moments, plus progress) is immediate, so two requests routed between reports never see
  the same free space twice.
- KV prediction is over time, not a sum of maxima: each request holds its prompt's blocks now
  and grows by a token a step until its predicted output length (max_tokens, or less once
  finished requests show outputs stop sooner: `lengths.py`), and frees everything when it
  finishes. The replica's worst moment is just before one of them finishes; sizing for that
  instead of every request at its longest at once admits more while still never overcommitting
  (as long as requests decode in step, which a replica that admits them whole does, and stop
  within their predicted lengths).
- Pending prefix blocks: prompt blocks of requests sent to the replica that its mirror does
  not hold yet. The replica will compute (and cache) them soon, but the mirror learns that
  only from the events after that prefill, so without this a burst sharing a new prefix would
  scatter. A block stops being pending when an event (or a resync) confirms it, or when no
  request holding it is in flight there (completion, failure, withdrawal, replica death).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.block_manager import KVEvent


class PrefixIndex:
    """Set of block hashes one replica holds in its prefix cache, kept exact by its KV events."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.last_seq = 0
        self.is_stale = False

    def apply(self, events: Iterable[KVEvent]) -> bool:
        """Apply events in order; returns False (and marks stale) on a gap in seq, or if stale."""
        if self.is_stale:
            return False  # everything after a gap waits for the resync
        for event in events:
            if event.seq <= self.last_seq:
                continue  # redelivered: already applied
            if event.seq != self.last_seq + 1:
                self.mark_stale()
                return False
            if event.kind == "stored":
                self.hashes.update(event.block_hashes)
            elif event.kind == "removed":
                self.hashes.difference_update(event.block_hashes)
            elif event.kind == "cleared":
                self.hashes.clear()
            else:
                raise ValueError(f"unknown KV event kind {event.kind!r}")
            self.last_seq = event.seq
        return True

    def mark_stale(self) -> None:
        """Stop trusting the mirror until `resync` (an event was lost, or we joined late)."""
        self.is_stale = True

    def resync(self, snapshot: set[bytes], seq: int) -> None:
        """Replace the mirror with the replica's cached hashes as of event `seq`."""
        self.hashes = set(snapshot)
        self.last_seq = seq
        self.is_stale = False

    def __contains__(self, block_hash: bytes) -> bool:
        return not self.is_stale and block_hash in self.hashes

    def num_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Longest run of cached blocks from the start (a hit past a miss is unusable)."""
        if self.is_stale:
            return 0
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


class KVTimeline:
    """Most KV blocks a set of requests holds at once if each adds a token a step until it
    finishes, and the same with one more request, answered without re-sorting the set.

    A request is (tokens it holds blocks for now, tokens it will still generate). Usage grows
    between finishes, so the peak is just before one: at t = remaining − 1 steps, summed over
    the requests still there; each request is rounded up to whole blocks (an upper bound). At
    the finishing level L (a remaining count), with H(L) and C(L) the tokens and count of the
    requests that last at least that long, the peak in tokens is
        g(L) = H(L) + C(L) · (t_L + block_size − 1),  t_L = max(L − 1, 0).
    A new request (a, r) adds a + t_L + block_size − 1 at every level L < r, nothing above r,
    and makes the level r its own (or joins it); so prefix maxima of g(L) + t_L over ascending
    levels, suffix maxima of g(L), and suffix sums of H and C answer `peak_with` in O(log n).
    The router asks this for every replica at every dispatch attempt, while a replica's set
    changes only when one of its requests is sent, progresses or ends.
    """

    def __init__(self, requests: Iterable[tuple[int, int]], block_size: int):
        self.block_size = block_size
        by_level: dict[int, list[int]] = {}
        for num_tokens, remaining in requests:
            by_level.setdefault(remaining, [0, 0])
            by_level[remaining][0] += num_tokens
            by_level[remaining][1] += 1
        self.levels = sorted(by_level)  # ascending remaining
        n = len(self.levels)
        self.held_from = [0] * (n + 1)  # H over levels[i:]
        self.count_from = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            tokens, count = by_level[self.levels[i]]
            self.held_from[i] = self.held_from[i + 1] + tokens
            self.count_from[i] = self.count_from[i + 1] + count
        g = [self.held_from[i] + self.count_from[i] * (max(level - 1, 0) + block_size - 1)
             for i, level in enumerate(self.levels)]
        self.max_g_from = [0] * (n + 1)  # max g over levels[i:]
        for i in range(n - 1, -1, -1):
            self.max_g_from[i] = max(self.max_g_from[i + 1], g[i])
        self.max_gt_upto: list[int] = []  # max g + t over levels[:i + 1]
        for i, level in enumerate(self.levels):
            value = g[i] + max(level - 1, 0)
            self.max_gt_upto.append(max(self.max_gt_upto[-1], value) if i else value)

    def peak(self) -> int:
        """Blocks at the set's worst moment."""
        return self.max_g_from[0] // self.block_size

    def peak_with(self, num_tokens: int, remaining: int) -> int:
        """Blocks at the worst moment if a request (num_tokens, remaining) joined the set."""
        bs = self.block_size
        at = bisect.bisect_left(self.levels, remaining)  # levels[at:] last at least as long
        own = (self.held_from[at] + num_tokens
               + (self.count_from[at] + 1) * (max(remaining - 1, 0) + bs - 1))
        # levels below it gain the new request; at or above, only its own level changes (`own`)
        joined = self.max_gt_upto[at - 1] + num_tokens + bs - 1 if at else 0
        return max(own, joined, self.max_g_from[at]) // bs


@dataclass(slots=True)
class InFlight:
    """What the router predicted for one request it sent to a replica."""

    prefix: list[bytes]  # its prompt's full blocks (bar the last token's): shareable, held while it runs
    num_tail_tokens: int  # prompt tokens past them, never shared
    max_tokens: int  # output budget: it grows by up to this many tokens
    num_prefill_tokens: int  # tokens the replica must compute before the first token
    num_predicted_tokens: int  # output it is expected to stop at, ≤ max_tokens (see lengths.py)
    priority: int = 0  # lower is more urgent (non-zero only under the "priority" policy)
    num_output_tokens: int = 0  # generated so far, as last reported to the router
    num_charged: int = 0  # prefix blocks charged to it (see ReplicaState.held)

    @property
    def has_first_token(self) -> bool:
        return self.num_output_tokens > 0

    @property
    def remaining(self) -> int:
        if self.num_output_tokens <= self.num_predicted_tokens:
            return self.num_predicted_tokens - self.num_output_tokens
        return max(self.max_tokens - self.num_output_tokens, 0)  # outlived its prediction: only the bound holds

    def now_and_remaining(self, block_size: int) -> tuple[int, int]:
        return self.num_charged * block_size + self.num_tail_tokens + self.num_output_tokens, self.remaining


class ReplicaState:
    """One replica as the router sees it: prefix mirror, reported load, predicted load.

    `held` maps every prefix block of an in-flight request to the requests holding it. It
    serves twice. Affinity: a held block not in the mirror yet is pending (its request will
    compute it; the KV event after that prefill confirms it), and counts as a hit. KV: a block
    shared by several requests exists once and lives until the last of them finishes, so it is
    charged to one holder, the one expected to run longest (`charged_to`), and to nobody else.
    Both end with the request: a holder that completes, fails, is withdrawn or dies is dropped.
    """

    def __init__(self, replica_id: int, num_total_blocks: int, max_num_seqs: int):
        if num_total_blocks < 1 or max_num_seqs < 1:
            raise ValueError("num_total_blocks and max_num_seqs must be positive")
        self.replica_id = replica_id
        self.num_total_blocks = num_total_blocks
        self.max_num_seqs = max_num_seqs
        self.prefix = PrefixIndex()
        self.num_reported_free_blocks = num_total_blocks
        self.num_reported_running = 0
        self.num_reported_waiting = 0
        self.in_flight: dict[str, InFlight] = {}
        self.held: dict[bytes, set[str]] = {}  # prefix block → in-flight requests holding it
        self.charged_to: dict[bytes, str] = {}  # prefix block → the holder its KV is charged to
        self.is_alive = True
        # derived from in_flight, rebuilt on first use after it changes (routing asks far more often)
        self._timeline: KVTimeline | None = None
        self._pending_prefill: int | None = None
        self.version = 0  # bumped whenever what `num_free_blocks_with` reads changes

    @property
    def pending(self) -> set[bytes]:
        """Held blocks the mirror has not confirmed yet: being (or about to be) computed."""
        return {h for h in self.held if h not in self.prefix}

    def prefix_hits(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """(cached, cached or held): longest runs from the start of `block_hashes`."""
        cached = self.prefix.num_prefix_blocks(block_hashes)
        n = cached
        for h in block_hashes[cached:]:
            if h not in self.held and h not in self.prefix:  # cached past a gap counts again
                break
            n += 1
        return cached, n

    def clear(self) -> None:
        """Forget every in-flight request and what it held (the replica died)."""
        self.in_flight.clear()
        self.held.clear()
        self.charged_to.clear()
        self._changed()

    def report(self, num_free_blocks: int, num_running: int, num_waiting: int) -> None:
        """The replica's own counts, as of its last step."""
        if num_free_blocks != self.num_reported_free_blocks:
            self.version += 1
        self.num_reported_free_blocks = num_free_blocks
        self.num_reported_running = num_running
        self.num_reported_waiting = num_waiting

    def on_dispatch(self, request_id: str, prefix: Sequence[bytes], num_tail_tokens: int, max_tokens: int,
                    num_prefill_tokens: int, num_predicted_tokens: int | None = None, priority: int = 0) -> None:
        """Record a request sent here, holding `prefix` (its prompt's shareable blocks); its
        output is planned at `num_predicted_tokens` (default: all of max_tokens)."""
        self.release(request_id)  # a re-dispatch replaces the old entry
        self._changed()
        predicted = max_tokens if num_predicted_tokens is None else min(num_predicted_tokens, max_tokens)
        entry = InFlight(list(prefix), num_tail_tokens, max_tokens, num_prefill_tokens, predicted, priority)
        self.in_flight[request_id] = entry
        for h in entry.prefix:
            holders = self.held.setdefault(h, set())
            if not holders:
                self._charge(h, request_id)
            elif self.in_flight[self.charged_to[h]].remaining < entry.remaining:
                self.in_flight[self.charged_to[h]].num_charged -= 1  # it now outlives the old holder
                self._charge(h, request_id)
            holders.add(request_id)

    def _charge(self, block_hash: bytes, request_id: str) -> None:
        self.charged_to[block_hash] = request_id
        self.in_flight[request_id].num_charged += 1

    def on_progress(self, request_id: str, num_output_tokens: int) -> None:
        """The request has generated this many tokens (≥ 1: prefill done, decode work only)."""
        entry = self.in_flight.get(request_id)
        if entry is not None and num_output_tokens > entry.num_output_tokens:
            entry.num_output_tokens = num_output_tokens
            self._changed()

    def release(self, request_id: str) -> InFlight | None:
        """Completion, failure or withdrawal: forget the request's predicted load and held blocks."""
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return None
        self._changed()
        heir = None  # holders of a longer prefix hold every shorter one: sets shrink along it
        for h in entry.prefix:
            holders = self.held[h]
            holders.discard(request_id)
            if not holders:
                del self.held[h], self.charged_to[h]
            elif self.charged_to[h] == request_id:
                if heir not in holders:
                    heir = max(holders, key=lambda rid: self.in_flight[rid].remaining)
                self._charge(h, heir)
        return entry

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def _changed(self) -> None:
        self._timeline = self._pending_prefill = None
        self.version += 1

    @property
    def num_pending_prefill_tokens(self) -> int:
        if self._pending_prefill is None:
            self._pending_prefill = sum(e.num_prefill_tokens for e in self.in_flight.values() if not e.has_first_token)
        return self._pending_prefill

    def num_free_blocks_with(self, prefix: Sequence[bytes], num_tail_tokens: int, num_output_tokens: int,
                             block_size: int) -> int:
        """Blocks left at this replica's worst moment if a request joined; negative when it
        does not fit. Its prefix blocks held here already cost nothing more (a cached block
        nobody holds does: taking it from the free queue uses capacity). The more pessimistic
        of the report (now) and the router's prediction (over time); when the report alone says
        it does not fit, that (negative) number."""
        # held blocks are whole chains from a prompt's start, so those of `prefix` are a run from its start
        num_held = next((i for i, h in enumerate(prefix) if h not in self.held), len(prefix))
        num_new = (len(prefix) - num_held) * block_size + num_tail_tokens
        now = self.num_reported_free_blocks - -(-num_new // block_size)
        if now < 0:  # does not fit now: how much less over time is not needed
            return now
        if self._timeline is None or self._timeline.block_size != block_size:
            self._timeline = KVTimeline([e.now_and_remaining(block_size) for e in self.in_flight.values()], block_size)
        return min(now, self.num_total_blocks - self._timeline.peak_with(num_new, num_output_tokens))

    def num_preemptible_for(self, priority: int) -> int:
        """How many more requests of `priority` this replica's scheduler would run now by preempting
        less urgent ones: those in flight here less urgent, less the ones already over its seats."""
        less_urgent = sum(e.priority > priority for e in self.in_flight.values())
        return less_urgent - max(self.num_in_flight - self.max_num_seqs, 0)

    def unstarted_request_ids(self) -> list[str]:
        """Requests with no first token yet, newest first (the cheapest to move)."""
        return [rid for rid, e in reversed(self.in_flight.items()) if not e.has_first_token]
