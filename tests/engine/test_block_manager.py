"""Block manager invariants: no block both free and referenced, ref counts return to zero,
hash hits only on identical prefixes, tail-first freeing, hits capped at num_tokens − 1."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, hash_token_blocks, root_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Request

PARAMS = SamplingParams(temperature=0.0)


def _check_invariants(bm: BlockManager, live: list[Request]) -> None:
    free_ids = {b.block_id for b in bm.free_queue}
    assert len(free_ids) == bm.num_free_blocks
    refs = {}
    for r in live:
        for b in r.block_ids[r.num_released_blocks:]:  # a sliding window's released blocks are not held
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), "ref count must equal the number of holders"
        assert (block.ref_count == 0) == (block.block_id in free_ids), "free ⇔ unreferenced"
    for h, block in bm.cached.items():
        assert block.hash == h
    assert bm.num_cached_free_blocks == sum(1 for b in bm.free_queue if b.hash is not None)  # a count, not a walk


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "release", "forget", "reset"]), st.integers(0, 40),
                              st.integers(0, 3)), min_size=1, max_size=40))
# a window that let go of every full block, their hashes then forgotten: growing must not hash
# them again (another request may hold them), nor count them as cached free blocks
@example(ops=[("add", 0, 0), ("add", 0, 0), ("add", 0, 0), ("free", 0, 0), ("free", 0, 0), ("release", 0, 0),
              ("forget", 0, 0), ("grow", 0, 0)])
def test_random_workload_keeps_invariants(ops):
    bm = BlockManager(num_blocks=24, block_size=4)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], []]
    live: list[Request] = []
    for i, (op, n, which) in enumerate(ops):
        if op == "add":
            req = Request(f"r{i}", prefixes[which] + [i % 7] * (n % 13 + 1), PARAMS)
            hits = bm.get_computed_blocks(req)
            num_hit = len(hits) * bm.block_size
            assert num_hit <= req.num_tokens - 1
            for j, block in enumerate(hits):  # a hit must hold exactly this prefix
                assert block.hash == hash_token_blocks(req.all_token_ids, 4)[j]
            if bm.allocate(req, req.num_tokens - num_hit, hits):
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        elif op == "grow" and live:
            req = live[n % len(live)]
            req.append_token(n)
            if bm.allocate(req, 1):
                req.num_computed_tokens = req.num_tokens
        elif op == "free" and live:
            bm.free(live.pop(n % len(live)))
        elif op == "release" and live:  # a window of `which * 4 + 1` tokens moved on
            req = live[n % len(live)]
            bm.release_before(req, req.num_tokens - which * 4)
        elif op == "forget":  # as an adapter's unloading forgets its blocks (here: the base model's)
            bm.forget_adapter(None)
        elif op == "reset":  # only while no block is held (a windowed request may hold none)
            all_free = bm.num_free_blocks == bm.num_blocks
            assert bm.reset_prefix_cache() == all_free
        _check_invariants(bm, live)
    for req in live:
        bm.free(req)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_hits_only_on_identical_prefixes_and_capped():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Request("a", list(range(12)), PARAMS)
    assert bm.allocate(a, 12)
    bm.free(a)
    same = Request("b", list(range(12)), PARAMS)
    # all 3 blocks cached, but the last token must be recomputed → only 2 blocks hit
    assert len(bm.get_computed_blocks(same)) == 2
    longer = Request("c", list(range(13)), PARAMS)
    assert len(bm.get_computed_blocks(longer)) == 3
    diverging = Request("d", [0, 1, 2, 3, 4, 5, 99, 7, 8], PARAMS)
    assert len(bm.get_computed_blocks(diverging)) == 1
    shifted = Request("e", [99] + list(range(12)), PARAMS)
    assert bm.get_computed_blocks(shifted) == []  # same tokens, other position: chained hashes differ


def test_cache_salts_separate_the_prefix_cache():
    """Only requests with the same salt share blocks; with none, the root is the unsalted one
    (which the router's hash_token_blocks reproduces)."""
    from dataclasses import replace

    bm = BlockManager(num_blocks=16, block_size=4)
    salted = {salt: replace(PARAMS, cache_salt=salt) for salt in ("tenant-a", "tenant-b")}
    a = Request("a", list(range(12)), salted["tenant-a"])
    assert bm.allocate(a, 12)
    bm.free(a)
    assert bm.get_computed_blocks(Request("b", list(range(12)), salted["tenant-b"])) == []
    assert bm.get_computed_blocks(Request("c", list(range(12)), PARAMS)) == []
    assert len(bm.get_computed_blocks(Request("d", list(range(12)), salted["tenant-a"]))) == 2
    assert a.block_hashes == hash_token_blocks(list(range(12)), 4, root_hash("tenant-a"))
    plain = Request("e", list(range(12)), PARAMS)
    bm.get_computed_blocks(plain)
    assert plain.block_hashes == hash_token_blocks(list(range(12)), 4)


def test_freed_blocks_keep_hash_and_tail_is_evicted_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6], PARAMS)
    assert bm.allocate(a, 6)
    first, second, third = a.block_ids
    bm.free(a)
    assert len(bm.cached) == 3  # still hittable while free
    order = [b.block_id for b in bm.free_queue]
    # the never-used block first, then a's tail before its head
    assert order.index(third) < order.index(second) < order.index(first)
    b = Request("b", [7, 8, 9, 10], PARAMS)
    assert bm.allocate(b, 4)
    assert first in [blk.block_id for blk in bm.cached.values()], "the head block must survive longest"


def test_blocks_a_window_left_are_free_and_stay_hittable():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], PARAMS)
    assert bm.allocate(a, 7)
    a.num_computed_tokens = 7
    first, second, *_ = a.block_ids
    bm.release_before(a, 5)  # tokens 0-3 left the window: blocks 0 and 1
    assert bm.num_free_blocks == 2 + 2 and a.block_ids[:2] == [first, second]
    bm.release_before(a, 3)  # a window never comes back: nothing happens
    assert bm.num_free_blocks == 4
    b = Request("b", [1, 2, 3, 4, 9], PARAMS)
    assert [blk.block_id for blk in bm.get_computed_blocks(b)] == [first, second]
    bm.free(a)  # the released blocks are not released twice
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks) and a.num_released_blocks == 0


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = Request("r", list(range(12)), PARAMS)
    assert not bm.allocate(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_hit_on_block_in_use_shares_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(9)), PARAMS)
    assert bm.allocate(a, 9)
    b = Request("b", list(range(8)) + [42], PARAMS)
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a.block_ids[:2]
    assert bm.allocate(b, 1, hits)
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    bm.free(a)
    assert bm.blocks[b.block_ids[0]].ref_count == 1


def test_events_mirror_cache():
    bm = BlockManager(num_blocks=3, block_size=2, record_events=True)
    a = Request("a", [1, 2, 3, 4], PARAMS)
    bm.allocate(a, 4)
    bm.free(a)
    b = Request("b", [9, 9, 8, 8, 7, 7], PARAMS)
    bm.allocate(b, 6)
    mirror: set[bytes] = set()
    seqs = []
    for e in bm.drain_events():
        seqs.append(e.seq)
        if e.kind == "stored":
            mirror.update(e.block_hashes)
        elif e.kind == "removed":
            mirror.difference_update(e.block_hashes)
    assert seqs == sorted(seqs)
    assert mirror == set(bm.cached)
