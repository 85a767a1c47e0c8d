"""Paged KV block bookkeeping with hash-based prefix caching (vLLM v1's design, no torch).

- Every block object exists from the start; free blocks sit in an intrusive doubly linked
  queue in eviction order (head = evict next), so taking a block out of the middle is O(1).
- A full block is identified by a chained hash: sha256(parent hash ‖ its token ids), seeded
  with a fixed root so every process (and an external router) computes the same hashes; a
  request's cache salt and LoRA adapter change its root, so only requests with the same salt
  and adapter share blocks.
- Freed blocks keep their hash until reused: the prefix cache costs no capacity.
- A request frees its blocks tail first, so its longest (least shareable) prefix is evicted
  before the shared head of the sequence.
- Under a sliding window a running request lets go of the blocks its window has left
  (`release_before`); their ids stay in its table, where attention skips or masks them.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.sequence import Request

ROOT_HASH = hashlib.sha256(b"driftgate-kv-block-hash-v1").digest()


def root_hash(cache_salt: str | None = None, lora: str | None = None) -> bytes:
    """The parent of a request's first block: the fixed root, or one derived from its cache salt
    (vLLM's `cache_salt`: tenants with different salts cannot probe each other's cached prompts
    through time to first token) and its LoRA adapter (whose KV differs from the base model's)."""
    if cache_salt is None and lora is None:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + json.dumps([cache_salt, lora]).encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: same prefix and same tokens ⇔ same hash (up to sha256 collisions)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def hash_token_blocks(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of every full block of `token_ids` (the router uses this too)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "lora", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.lora: str | None = None  # the LoRA adapter its KV was computed under
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks; head is the next block to reuse."""

    def __init__(self, blocks: list[Block]):
        self.head = Block(-1)  # sentinels keep the pointer updates branch-free
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        self.num_hashed = 0  # free blocks still holding a hash (kept here: stats read it every step)
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: Block, block: Block) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1
        self.num_hashed += block.hash is not None

    def append(self, block: Block) -> None:
        self._insert_after(self.tail.prev, block)

    def append_left(self, block: Block) -> None:
        self._insert_after(self.head, block)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1
        self.num_hashed -= block.hash is not None

    def pop_left(self) -> Block:
        block = self.head.next
        if block is self.tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


@dataclass(frozen=True, slots=True)
class KVEvent:
    """What a router mirrors: `stored` / `removed` block hashes, or `cleared`; seq is monotonic."""

    seq: int
    kind: str
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None


class BlockManager:
    """Allocates KV blocks to requests and serves prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}  # hash → the block that answers hits for it
        self.record_events = record_events
        self.events: list[KVEvent] = []
        self._event_seq = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a hash: reclaimable capacity that can also serve hits, but for
        the duplicates of a block the cache already maps (two requests that computed the same
        prefix at once), which serve none."""
        return self.free_queue.num_hashed

    def _emit(self, kind: str, hashes: tuple[bytes, ...] = (), parent: bytes | None = None) -> None:
        if self.record_events:
            self._event_seq += 1
            self.events.append(KVEvent(self._event_seq, kind, hashes, parent))

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to every full block among its first `num_tokens` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else root_hash(request.params.cache_salt, request.lora)
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """Longest run of cached blocks from the start of the request's tokens.

        At most num_tokens − 1 tokens can come from the cache: the last token must be
        recomputed to produce logits, so a fully cached sequence gives back its last block.
        """
        if not self.enable_prefix_caching or request.params.pooling in ("mean", "cls"):
            return []  # (those poolings read every prompt token's hidden state, so all are computed)
        self._update_hashes(request, request.num_tokens)
        hits = []
        for h in request.block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return hits

    def allocate(self, request: Request, num_new_tokens: int, computed: list[Block] | None = None,
                 num_lookahead_tokens: int = 0) -> bool:
        """Give `request` room for `num_new_tokens` more tokens (after any `computed` hit blocks),
        plus `num_lookahead_tokens` slots for draft tokens, which are never cached: they may be rejected.

        Returns False and changes nothing when there are not enough free blocks.
        """
        computed = computed or []
        num_tokens, num_new_blocks, num_reclaimed = self._plan(request, num_new_tokens, computed, num_lookahead_tokens)
        if num_new_blocks + num_reclaimed > self.free_queue.num_free:
            return False
        for block in computed:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        for _ in range(num_new_blocks):
            block = self.free_queue.pop_left()
            self._evict(block)
            block.ref_count = 1
            request.block_ids.append(block.block_id)
        if self.enable_prefix_caching:
            # Cache blocks that will be full once this step runs, so requests later in the
            # same batch can hit them (each layer writes K/V before any attention reads it).
            self._cache_full_blocks(request, num_tokens)
        return True

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int, computed: list[Block] | None = None,
                               num_lookahead_tokens: int = 0) -> int:
        """Free blocks that `allocate` with the same arguments would take (it changes nothing)."""
        _, num_new_blocks, num_reclaimed = self._plan(request, num_new_tokens, computed or [], num_lookahead_tokens)
        return num_new_blocks + num_reclaimed

    def _plan(self, request: Request, num_new_tokens: int, computed: list[Block],
              num_lookahead_tokens: int) -> tuple[int, int, int]:
        """(the request's tokens once the step runs, blocks to take beyond its own and the hit ones,
        hit blocks with no other user, which sit in the free queue and cost capacity too)."""
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_slots = num_tokens + num_lookahead_tokens
        num_new_blocks = max(-(-num_slots // self.block_size) - len(request.block_ids) - len(computed), 0)
        return num_tokens, num_new_blocks, sum(1 for b in computed if b.ref_count == 0)

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                self._emit("removed", (block.hash,))
            if block.prev is not None:  # still in the free queue
                self.free_queue.num_hashed -= 1
            block.hash = None

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_hashes(request, num_tokens)
        # A request's hashed blocks are always a prefix of its block_ids (hits come first, and
        # each call hashes every full block), so only the newly full ones at the end are walked:
        # walking them all cost O(context) per sequence per step.
        full = first = num_tokens // self.block_size
        # blocks a sliding window let go of are not the request's to hash: another may hold them now
        while first > request.num_released_blocks and self.blocks[request.block_ids[first - 1]].hash is None:
            first -= 1
        stored = []
        for i in range(first, full):
            block = self.blocks[request.block_ids[i]]
            block.hash, block.lora = request.block_hashes[i], request.lora
            if block.hash not in self.cached:  # a duplicate keeps serving from the first copy
                self.cached[block.hash] = block
                stored.append(block.hash)
        if stored:
            first = request.block_hashes.index(stored[0])
            self._emit("stored", tuple(stored), request.block_hashes[first - 1] if first else None)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see module docstring); those already let go
        (release_before) are not released twice."""
        for block_id in reversed(request.block_ids[request.num_released_blocks:]):
            self._unref(self.blocks[block_id])
        request.block_ids = []
        request.num_released_blocks = 0

    def release_before(self, request: Request, position: int) -> None:
        """Let go of the request's blocks that hold only tokens before `position`, which its
        sliding window no longer reaches. Their hashes stay cached for prefix hits."""
        first_kept = min(max(position, 0) // self.block_size, len(request.block_ids))
        if first_kept <= request.num_released_blocks:  # most steps: the window has not left another block
            return
        for block_id in request.block_ids[request.num_released_blocks:first_kept]:
            self._unref(self.blocks[block_id])
        request.num_released_blocks = first_kept

    def _unref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.free_queue.append_left(block)  # holds nothing reusable: reuse first
            else:
                self.free_queue.append(block)

    def forget_adapter(self, lora: str) -> None:
        """Drop the cached blocks computed under a LoRA adapter being unloaded (no request holds
        them): an adapter loaded later under the same name may have other weights, and prefix
        hashes know adapters by name."""
        for block in [b for b in self.cached.values() if b.lora == lora and b.ref_count == 0]:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash = None
        self.free_queue.num_hashed = 0
        self.cached.clear()
        self._emit("cleared")
        return True
