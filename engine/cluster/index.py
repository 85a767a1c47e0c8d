"""The router's view of one replica: an exact mirror of its prefix cache, plus its load.

- The prefix mirror is fed by the replica's KV events (stored / removed / cleared, seq +1 each).
  A gap in seq means an event was lost: the mirror is marked stale and reports no hits (rather
  than wrong ones) until it is rebuilt from a snapshot of the replica's cached hashes.
- Load has two halves. What the replica reports (free blocks, running, waiting) lags by one
  report; what the router predicts itself at dispatch, each output and completion (Dynamo's
  three moments, plus progress) is immediate, so two requests routed between reports never see
  the same free space twice.
- KV prediction is over time, not a sum of maxima: each request holds its prompt's blocks now
  and grows by a token a step until max_tokens, and frees everything when it finishes. The
  replica's worst moment is just before one of them finishes; sizing for that instead of
  every request at its longest at once admits more while still never overcommitting (as long
  as requests decode in step, which a replica that admits them whole does).
- Pending prefix blocks: a request's prompt blocks the replica lacked when the request was sent
  there. The replica will compute (and cache) them soon, but the mirror learns that only from
  the events after its prefill, so without this a burst sharing a new prefix would scatter.
  A pending hash lasts until an event (or a resync) confirms it, or its request leaves the
  replica (completion, failure, withdrawal, replica death): it never outlives its request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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


def peak_blocks(requests: Iterable[tuple[int, int]], block_size: int) -> int:
    """Most KV blocks `requests` hold at once if each adds a token a step until it finishes.

    A request is (tokens it holds blocks for now, tokens it will still generate). Usage grows
    between finishes, so the peak is just before one: at t = remaining − 1 steps, summed over
    the requests still there. Each request is rounded up to whole blocks (an upper bound).
    """
    peak = held = count = 0
    order = sorted(requests, key=lambda r: r[1], reverse=True)
    for i, (num_tokens, remaining) in enumerate(order):
        held += num_tokens
        count += 1
        if i + 1 < len(order) and order[i + 1][1] == remaining:
            continue  # the same finishing step: measure once all of them are counted
        t = max(remaining - 1, 0)
        peak = max(peak, (held + count * (t + block_size - 1)) // block_size)
    return peak


@dataclass(slots=True)
class InFlight:
    """What the router predicted for one request it sent to a replica."""

    num_tokens: int  # tokens it holds its own blocks for at dispatch (prompt − cached or pending hits)
    max_tokens: int  # output budget: it grows by up to this many tokens
    num_prefill_tokens: int  # tokens the replica must compute before the first token
    num_output_tokens: int = 0  # generated so far, as last reported to the router
    pending: set[bytes] = field(default_factory=set)  # its prompt blocks not confirmed cached yet

    @property
    def has_first_token(self) -> bool:
        return self.num_output_tokens > 0

    @property
    def now_and_remaining(self) -> tuple[int, int]:
        return self.num_tokens + self.num_output_tokens, max(self.max_tokens - self.num_output_tokens, 0)


class ReplicaState:
    """One replica as the router sees it: prefix mirror, reported load, predicted load."""

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
        self.pending: dict[bytes, set[str]] = {}  # pending block hash → in-flight requests computing it
        self.is_alive = True

    def apply_events(self, events: Sequence[KVEvent]) -> bool:
        """Feed the mirror (see `PrefixIndex.apply`); stored blocks are no longer pending."""
        seq = self.prefix.last_seq
        applied = self.prefix.apply(events)
        if applied:  # a redelivered event may describe a block evicted since: only new ones confirm
            self._confirm(h for e in events if e.kind == "stored" and e.seq > seq for h in e.block_hashes)
        return applied

    def resync(self, snapshot: set[bytes], seq: int) -> None:
        """Rebuild the mirror from a snapshot; whatever it holds is no longer pending."""
        self.prefix.resync(snapshot, seq)
        self._confirm([h for h in self.pending if h in snapshot])

    def _confirm(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            for request_id in self.pending.pop(h, ()):
                self.in_flight[request_id].pending.discard(h)

    def prefix_hits(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """(cached, cached or pending): longest runs from the start of `block_hashes`."""
        cached = self.prefix.num_prefix_blocks(block_hashes)
        n = cached
        for h in block_hashes[cached:]:
            if h not in self.pending and h not in self.prefix:  # cached past a gap counts again
                break
            n += 1
        return cached, n

    def clear(self) -> None:
        """Forget every in-flight request and pending block (the replica died)."""
        self.in_flight.clear()
        self.pending.clear()

    def report(self, num_free_blocks: int, num_running: int, num_waiting: int) -> None:
        """The replica's own counts, as of its last step."""
        self.num_reported_free_blocks = num_free_blocks
        self.num_reported_running = num_running
        self.num_reported_waiting = num_waiting

    def on_dispatch(self, request_id: str, num_tokens: int, max_tokens: int, num_prefill_tokens: int,
                    pending: Iterable[bytes] = ()) -> None:
        """Record a request sent here; `pending` are its prompt blocks this replica will compute."""
        self.release(request_id)  # a re-dispatch replaces the old entry, pending blocks included
        entry = InFlight(num_tokens, max_tokens, num_prefill_tokens, pending=set(pending))
        self.in_flight[request_id] = entry
        for h in entry.pending:
            self.pending.setdefault(h, set()).add(request_id)

    def on_progress(self, request_id: str, num_output_tokens: int) -> None:
        """The request has generated this many tokens (≥ 1: prefill done, decode work only)."""
        entry = self.in_flight.get(request_id)
        if entry is not None:
            entry.num_output_tokens = max(entry.num_output_tokens, num_output_tokens)

    def release(self, request_id: str) -> InFlight | None:
        """Completion, failure or withdrawal: forget the request's predicted load and pending blocks."""
        entry = self.in_flight.pop(request_id, None)
        if entry is not None:
            for h in entry.pending:
                holders = self.pending[h]
                holders.discard(request_id)
                if not holders:
                    del self.pending[h]
        return entry

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    @property
    def num_pending_prefill_tokens(self) -> int:
        return sum(e.num_prefill_tokens for e in self.in_flight.values() if not e.has_first_token)

    def num_free_blocks_with(self, num_tokens: int, max_tokens: int, block_size: int) -> int:
        """Blocks left at this replica's worst moment if a request (holding `num_tokens` now,
        generating up to `max_tokens`) joined; negative when it does not fit. The more
        pessimistic of the report (now) and the router's prediction (over time)."""
        now = self.num_reported_free_blocks - -(-num_tokens // block_size)
        requests = [e.now_and_remaining for e in self.in_flight.values()] + [(num_tokens, max_tokens)]
        return min(now, self.num_total_blocks - peak_blocks(requests, block_size))

    def unstarted_request_ids(self) -> list[str]:
        """Requests with no first token yet, newest first (the cheapest to move)."""
        return [rid for rid, e in reversed(self.in_flight.items()) if not e.has_first_token]
