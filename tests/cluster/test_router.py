"""Router policy and prefix index on fabricated replica states (no engine, no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, KVEvent, hash_token_blocks, root_hash
from engine.cluster.index import KVTimeline, PrefixIndex, ReplicaState
from engine.cluster.router import Dispatch, Policy, Router, RouterConfig, RouteRequest
from tests.helpers import make_requests

BS = 4


def make_router(policy: str = "coordinated", num_replicas: int = 3, num_blocks: int = 100,
                max_num_seqs: int = 8, **kwargs) -> Router:
    replicas = [ReplicaState(i, num_blocks, max_num_seqs) for i in range(num_replicas)]
    return Router(RouterConfig(policy=policy, block_size=BS, **kwargs), replicas)


def cache_on(replica: ReplicaState, token_ids: list[int]) -> None:
    """Feed the replica's mirror a `stored` event for every full block of `token_ids`."""
    hashes = tuple(hash_token_blocks(token_ids, BS))
    assert replica.prefix.apply([KVEvent(replica.prefix.last_seq + 1, "stored", hashes)])


def req(rid: str, num_tokens: int = 16, max_tokens: int = 4, prefix: list[int] | None = None,
        seed: int = 0) -> RouteRequest:
    (r,) = make_requests(1, num_tokens, max_tokens=max_tokens, prefix=prefix, seed=seed, vocab=1000)
    return RouteRequest(rid, r.prompt_token_ids, max_tokens)


# --- prefix index -------------------------------------------------------------------------------

def test_index_mirrors_block_manager_events_exactly():
    bm = BlockManager(num_blocks=3, block_size=BS, record_events=True)
    index = PrefixIndex()
    a, b = make_requests(2, 12, seed=1, vocab=1000)
    for r in (a, b):  # b's allocation evicts a's freed blocks: stored, then removed events
        assert bm.allocate(r, r.num_tokens)
        bm.free(r)
        assert index.apply(bm.drain_events())
        assert index.hashes == set(bm.cached)
    assert index.num_prefix_blocks(b.block_hashes) == 3
    assert index.num_prefix_blocks(a.block_hashes) == 0


def test_longest_run_stops_at_first_miss():
    index = PrefixIndex()
    hashes = hash_token_blocks(list(range(16)), BS)
    index.apply([KVEvent(1, "stored", (hashes[0], hashes[1], hashes[3]))])
    assert index.num_prefix_blocks(hashes) == 2


def test_event_gap_marks_stale_then_snapshot_resyncs():
    index = PrefixIndex()
    hashes = hash_token_blocks(list(range(16)), BS)
    assert index.apply([KVEvent(1, "stored", tuple(hashes))])
    assert index.apply([KVEvent(1, "stored", tuple(hashes))])  # redelivery is harmless
    assert not index.apply([KVEvent(3, "removed", (hashes[3],))])  # seq 2 was lost
    assert index.is_stale and index.num_prefix_blocks(hashes) == 0  # no hits rather than wrong ones
    assert not index.apply([KVEvent(4, "cleared")])  # nothing applies until the resync
    assert not index.apply([])  # not even an empty report: a late joiner marks itself stale
    index.resync(set(hashes[:2]), seq=4)
    assert not index.is_stale and index.num_prefix_blocks(hashes) == 2
    assert index.apply([KVEvent(5, "cleared")]) and index.num_prefix_blocks(hashes) == 0


# --- placement ----------------------------------------------------------------------------------

def test_prefix_affinity_picks_the_replica_holding_the_prompt():
    router = make_router()
    system = list(range(100, 132))  # 8 shared blocks
    cache_on(router.replicas[2], system)
    (d,) = router.submit(req("a", 8, prefix=system))
    assert d == Dispatch("a", 2)
    # the router's prediction counts only the uncached part: 40 prompt tokens − 8 blocks hit
    entry = router.replicas[2].in_flight["a"]
    assert entry.num_prefill_tokens == 8 and (entry.num_tail_tokens, entry.max_tokens) == (4, 4)


def test_a_salted_request_has_affinity_only_to_its_salts_blocks():
    """Its hashes start from its cache salt, as its engine's do: another salt's (or no salt's)
    copy of the prompt is no hit, its own salt's is."""
    router = make_router()
    system = list(range(100, 132))
    cache_on(router.replicas[2], system)  # cached unsalted
    salted = req("a", 8, prefix=system)
    salted.cache_salt = "tenant-a"
    (d,) = router.submit(salted)
    assert d.replica_id == 0 and router.replicas[0].in_flight["a"].num_prefill_tokens == 40
    hashes = tuple(hash_token_blocks(system, BS, root_hash("tenant-a")))
    assert router.replicas[1].prefix.apply([KVEvent(router.replicas[1].prefix.last_seq + 1, "stored", hashes)])
    again = req("b", 8, prefix=system, seed=1)
    again.cache_salt = "tenant-a"
    (d,) = router.submit(again)
    assert d.replica_id == 1 and router.replicas[1].in_flight["b"].num_prefill_tokens == 8


def test_without_prefix_caching_nothing_counts_as_cached_or_shared():
    router = make_router(prefix_caching=False)
    system = list(range(100, 132))
    cache_on(router.replicas[2], system)  # a stale mirror must not matter either
    (d,) = router.submit(req("a", 8, prefix=system))
    assert d.replica_id == 0  # no affinity: the tie goes to the lowest id
    entry = router.replicas[0].in_flight["a"]
    assert entry.num_prefill_tokens == 40 and entry.num_tail_tokens == 40  # the whole prompt, held alone


def test_kv_aware_placement_avoids_the_replica_without_room():
    router = make_router(num_replicas=2, num_blocks=40)
    system = list(range(100, 132))
    cache_on(router.replicas[0], system)
    router.replicas[0].report(num_free_blocks=5, num_running=3, num_waiting=0)
    # replica 0 has the prefix but not the 31 − 8 = 23 blocks the request still needs
    (d,) = router.submit(req("a", 88, max_tokens=4, prefix=system))
    assert d.replica_id == 1


def test_a_request_larger_than_any_replica_is_planned_on_a_whole_one():
    router = make_router(num_replicas=2, num_blocks=100)  # 400 tokens a replica
    (d,) = router.submit(req("n4", 16, max_tokens=4 * 200))  # n = 4 completions of 200: 816 tokens
    assert router.replicas[d.replica_id].in_flight["n4"].max_tokens == 400 - 16
    with pytest.raises(ValueError, match="prompt needs more KV blocks than any replica has"):
        router.submit(req("huge", 400))


def test_kv_term_prefers_more_free_blocks_when_nothing_is_cached():
    router = make_router(num_replicas=2)
    router.replicas[0].report(num_free_blocks=30, num_running=2, num_waiting=0)
    router.replicas[1].report(num_free_blocks=90, num_running=2, num_waiting=0)
    assert router.submit(req("a"))[0].replica_id == 1


def test_the_peak_is_the_worst_moment_not_every_maximum_at_once():
    def peak(requests: list[tuple[int, int]]) -> int:
        return KVTimeline(requests, BS).peak()

    # (tokens held now, tokens still to generate), 4-token blocks
    assert peak([(16, 0)]) == 4
    assert peak([(13, 4)]) == 4  # 13 → 16 tokens
    # 40 + 3 = 43 tokens (11 blocks) and 24 + 3 = 27 (7) just before the first finishes; rounding
    # each request up bounds it by 19; every maximum at once would be 11 + 12 = 23
    assert peak([(40, 4), (24, 24)]) == 19
    assert peak([]) == 0
    assert KVTimeline([(40, 4)], BS).peak_with(24, 24) == 19


def reference_peak(requests: list[tuple[int, int]], block_size: int) -> int:
    """The worst moment by its definition: walk finishing levels from the longest-lasting down."""
    peak = held = count = 0
    order = sorted(requests, key=lambda r: r[1], reverse=True)
    for i, (num_tokens, remaining) in enumerate(order):
        held += num_tokens
        count += 1
        if i + 1 < len(order) and order[i + 1][1] == remaining:
            continue  # the same finishing step: measure once all of them are counted
        peak = max(peak, (held + count * (max(remaining - 1, 0) + block_size - 1)) // block_size)
    return peak


requests_st = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(requests_st, st.tuples(st.integers(0, 300), st.integers(0, 40)), st.sampled_from([1, 4, 16]))
def test_timeline_peak_with_one_more_equals_the_definition(requests, new, block_size):
    timeline = KVTimeline(requests, block_size)
    assert timeline.peak() == reference_peak(requests, block_size)
    assert timeline.peak_with(*new) == reference_peak([*requests, new], block_size)


def test_kv_prediction_follows_each_requests_progress():
    router = make_router(num_replicas=1, num_blocks=20)
    router.replicas[0].on_dispatch("long", [], 12, 32, 12)  # will hold 44 tokens = 11 blocks at its longest
    # a 24 + 24 request overlaps "long" for 23 steps: 35 + 47 tokens = 9 + 12 blocks > 20
    assert router.submit(req("b", 24, max_tokens=24)) == []
    # 28 tokens later "long" ends in 4 steps: 43 + 27 tokens = 11 + 7 blocks fit, though the
    # maxima (11 + 12) would not
    router.on_progress(0, "long", 28)
    assert router.dispatch_ready() == [Dispatch("b", 0)]


def test_global_queue_holds_requests_until_a_replica_can_admit():
    router = make_router(num_replicas=2, num_blocks=10)
    first = router.submit(req("a", 28, max_tokens=8)) + router.submit(req("b", 28, max_tokens=8, seed=1))
    assert sorted(d.replica_id for d in first) == [0, 1]  # 9 blocks each: one per replica
    assert router.submit(req("c", 28, max_tokens=8, seed=2)) == []
    assert [r.request_id for r in router.queue] == ["c"]
    assert router.on_complete(1, "b") == [Dispatch("c", 1)]
    assert not router.queue


def test_small_requests_pass_a_head_that_fits_nowhere_but_only_so_often():
    router = make_router(num_replicas=1, num_blocks=12, max_overtakes=2)
    router.replicas[0].on_dispatch("resident", [], 16, 4, 0)  # 5 blocks at its longest
    assert router.submit(req("big", 28, max_tokens=8)) == []  # needs 9 of the 7 left
    # followers that fit go ahead of it, twice; then the queue is strict FIFO again
    assert router.submit(req("s1", 4, max_tokens=1, seed=1)) == [Dispatch("s1", 0)]
    assert router.submit(req("s2", 4, max_tokens=1, seed=2)) == [Dispatch("s2", 0)]
    assert router.submit(req("s3", 4, max_tokens=1, seed=3)) == []
    assert [r.request_id for r in router.queue] == ["big", "s3"] and router.queue[0].num_overtaken == 2
    dispatched = [d for rid in ("resident", "s1", "s2") for d in router.on_complete(0, rid)]
    assert dispatched == [Dispatch("big", 0), Dispatch("s3", 0)]


def test_strict_fifo_when_overtaking_is_off():
    router = make_router(num_replicas=1, num_blocks=12, max_overtakes=0)
    router.replicas[0].on_dispatch("resident", [], 16, 4, 0)
    router.submit(req("big", 28, max_tokens=8))
    assert router.submit(req("s1", 4, max_tokens=1, seed=1)) == []


def test_cancel_drops_only_a_queued_request():
    router = make_router(num_replicas=1, num_blocks=10)
    router.submit(req("a", 28, max_tokens=8))
    router.submit(req("b", 28, max_tokens=8, seed=1))
    assert router.cancel("b") and not router.queue
    assert not router.cancel("a")  # dispatched: ends through on_complete, not cancel
    assert router.on_complete(0, "a") == []


def test_baselines_dispatch_immediately():
    rr = make_router("round-robin", num_blocks=10)
    ll = make_router("least-loaded", num_blocks=10)
    rr_ids = [rr.submit(req(f"r{i}", 28, max_tokens=8, seed=i))[0].replica_id for i in range(4)]
    assert rr_ids == [0, 1, 2, 0]  # even past each replica's KV: the engine queues locally
    ll.replicas[0].on_dispatch("x", [], 4, 1, 4)
    assert ll.submit(req("a"))[0].replica_id == 1


def test_imbalance_override_beats_prefix_affinity():
    router = make_router(num_replicas=2, max_num_seqs=64, balance_abs=4, balance_rel=1.5)
    system = list(range(100, 132))
    cache_on(router.replicas[0], system)
    for i in range(6):
        router.replicas[0].on_dispatch(f"busy{i}", [], 4, 1, 0)
    router.replicas[1].on_dispatch("one", [], 4, 1, 0)
    # 6 − 1 > 4 and 6 > 1.5·1: imbalanced, so the shorter replica wins despite the cache
    assert router.submit(req("a", 8, prefix=system))[0].replica_id == 1
    router.replicas[1].on_dispatch("two", [], 4, 1, 0)  # 6 − 2 = 4: balanced again
    assert router.submit(req("b", 8, prefix=system, seed=1))[0].replica_id == 0


# --- pending prefix blocks (in-flight affinity) ---------------------------------------------------

def test_a_burst_sharing_a_new_prefix_lands_together():
    router = make_router(num_replicas=3)  # nothing cached anywhere, no KV event yet
    system = list(range(100, 132))
    dispatches = [d for i in range(4) for d in router.submit(req(f"q{i}", 8, prefix=system, seed=i))]
    assert {d.replica_id for d in dispatches} == {0}
    # only the first computes the system prompt: the others' prefill and KV count just their question
    assert [router.replicas[0].in_flight[f"q{i}"].num_prefill_tokens for i in range(4)] == [40, 8, 8, 8]
    # a request with another prompt does not follow the burst
    assert router.submit(req("other", 40, seed=9))[0].replica_id != 0


def test_without_pending_blocks_the_same_burst_scatters():
    router = make_router(num_replicas=3, pending_prefix_weight=0.0)
    system = list(range(100, 132))
    dispatches = [d for i in range(3) for d in router.submit(req(f"q{i}", 8, prefix=system, seed=i))]
    assert {d.replica_id for d in dispatches} == {0, 1, 2}


def test_pending_blocks_end_with_events_or_their_request():
    router = make_router(num_replicas=2)
    system = list(range(100, 132))
    a = req("a", 8, prefix=system)
    router.submit(a)
    replica = router.replicas[0]
    hashes = router._hashable_prefix(a)
    assert replica.pending == set(hashes) and replica.prefix_hits(hashes) == (0, 9)

    # the replica stores the system prompt's 8 blocks: confirmed, no longer pending
    assert replica.prefix.apply([KVEvent(1, "stored", tuple(hashes[:8]))])
    assert replica.pending == {hashes[8]} and replica.prefix_hits(hashes) == (8, 9)

    # the request ends before its last block was confirmed: nothing of it stays pending
    router.on_complete(0, "a")
    assert not replica.pending and not replica.held and replica.prefix_hits(hashes) == (8, 8)
    # and a block evicted after that is a plain miss
    assert replica.prefix.apply([KVEvent(2, "removed", (hashes[7],))])
    assert replica.prefix_hits(hashes) == (7, 7)


def test_a_resync_confirms_pending_blocks_it_holds():
    router = make_router(num_replicas=1)
    a = req("a", 16)
    router.submit(a)
    replica = router.replicas[0]
    hashes = router._hashable_prefix(a)
    replica.prefix.resync(set(hashes[:2]), seq=7)
    assert replica.pending == set(hashes[2:])


def test_a_shared_prefix_is_charged_once_to_its_longest_running_holder():
    router = make_router(num_replicas=1)
    system = list(range(100, 132))  # 8 shared blocks; each prompt adds one block of its own + a 4-token tail
    for rid, max_tokens in (("short", 4), ("long", 20), ("mid", 8)):
        router.submit(req(rid, 8, max_tokens=max_tokens, prefix=system, seed=len(rid)))
    replica = router.replicas[0]
    assert {rid: e.num_charged for rid, e in replica.in_flight.items()} == {"short": 1, "long": 9, "mid": 1}
    # "long" finishing leaves the system prompt to the longest of the rest, not to nobody
    router.on_complete(0, "long")
    assert {rid: e.num_charged for rid, e in replica.in_flight.items()} == {"short": 1, "mid": 9}
    router.on_complete(0, "mid")
    router.on_complete(0, "short")
    assert not replica.held and not replica.charged_to


def test_kv_prediction_charges_cached_blocks_nobody_holds():
    router = make_router(num_replicas=1, num_blocks=30)
    system = list(range(100, 132))
    replica = router.replicas[0]
    a, b = req("a", 8, max_tokens=4, prefix=system), req("b", 8, max_tokens=4, prefix=system, seed=1)
    prefix_a, prefix_b = (hash_token_blocks(r.token_ids, BS)[:9] for r in (a, b))  # 4-token tails
    # 9 blocks + 4 tokens, growing 4: at most 11 blocks
    assert replica.num_free_blocks_with(prefix_a, 4, 4, BS) == 30 - 11
    cache_on(replica, system)  # cached but free: taking it uses capacity like computing it
    assert replica.num_free_blocks_with(prefix_a, 4, 4, BS) == 30 - 11
    router.submit(a)  # now held: a follower pays only for its own block and tail (8 → 12 tokens)
    assert replica.num_free_blocks_with(prefix_b, 4, 4, BS) == 30 - (40 + 8 + 2 * (3 + 3)) // BS


def test_withdrawal_moves_pending_blocks_with_the_request():
    router = make_router(num_replicas=2)
    system = list(range(100, 132))
    a = req("a", 8, prefix=system)
    assert router.submit(a) == [Dispatch("a", 0)]
    hashes = router._hashable_prefix(a)
    assert router.withdrawn(0, [a]) == [Dispatch("a", 1)]
    assert not router.replicas[0].pending
    assert set(router.replicas[1].pending) == set(hashes)
    # the next request with that prompt follows it to its new replica
    assert router.submit(req("b", 8, prefix=system, seed=1))[0].replica_id == 1


def test_replica_death_clears_its_pending_blocks():
    router = make_router(num_replicas=2)
    system = list(range(100, 132))
    router.submit(req("a", 8, prefix=system))
    router.mark_dead(0)
    assert not router.replicas[0].pending and not router.replicas[0].in_flight
    router.mark_alive(0)
    # nothing pending or cached survives the death: no pull towards replica 0 either way
    hashes = router._hashable_prefix(req("b", 8, prefix=system, seed=1))
    assert router.replicas[0].prefix_hits(hashes) == (0, 0)


# --- migration ----------------------------------------------------------------------------------

def test_migration_withdraws_only_unstarted_requests_and_loses_none():
    router = make_router(num_replicas=2, num_blocks=20)
    requests = {f"r{i}": req(f"r{i}", 12, max_tokens=4, seed=i) for i in range(4)}
    for rid in requests:
        router.replicas[0].on_dispatch(rid, [], 12, 4, 12)  # fabricated: all four sit on replica 0
    router.on_progress(0, "r0", 1)
    router.on_progress(0, "r2", 1)
    assert router.migration_candidates(0) == []  # plenty of free KV: no reason to move
    router.replicas[0].report(num_free_blocks=0, num_running=2, num_waiting=2)
    assert router.migration_candidates(0) == ["r3", "r1"]  # newest first, never r0 / r2

    # the replica admitted r3 meanwhile, so only r1 comes back
    dispatches = router.withdrawn(0, [requests["r1"]])
    assert dispatches == [Dispatch("r1", 1)]
    assert router.num_migrated == 1
    placed = set(router.replicas[0].in_flight) | set(router.replicas[1].in_flight)
    assert placed | {r.request_id for r in router.queue} == set(requests)


def test_withdrawn_requests_queue_ahead_of_new_arrivals():
    router = make_router(num_replicas=2, num_blocks=5)
    router.replicas[1].report(num_free_blocks=0, num_running=1, num_waiting=0)
    old = req("old", 12, seed=1)
    router.replicas[0].on_dispatch("old", [], 12, 4, 12)
    router.replicas[0].on_dispatch("big", [], 16, 4, 16)
    assert router.submit(req("new", 12, seed=2)) == []  # no room anywhere
    assert router.withdrawn(0, [old]) == []  # replica 1 is full and 0 still holds "big"
    assert [r.request_id for r in router.queue] == ["old", "new"]


def test_the_global_queue_keeps_priority_order_and_migrants_lead_their_class():
    router = make_router(num_replicas=1, num_blocks=10, scheduling_policy="priority", max_overtakes=0)
    router.submit(req("resident", 28, max_tokens=8))  # fills the replica: the rest queue
    for rid, priority in [("late-low", 2), ("urgent", 0), ("mid", 1), ("urgent-2", 0)]:
        request = req(rid, 28, max_tokens=8, seed=len(rid))
        request.priority = priority
        assert router.submit(request) == []
    assert [r.request_id for r in router.queue] == ["urgent", "urgent-2", "mid", "late-low"]
    migrant = req("migrant", 28, max_tokens=8, seed=9)
    migrant.priority = 1
    router.replicas[0].on_dispatch("migrant", [], 28, 8, 28)
    router.withdrawn(0, [migrant])
    assert [r.request_id for r in router.queue] == ["urgent", "urgent-2", "migrant", "mid", "late-low"]
    assert router.on_complete(0, "resident") == [Dispatch("urgent", 0)]


@pytest.mark.parametrize("scheduling_policy", ["priority", "fcfs"])
def test_under_priority_a_request_that_fits_nowhere_goes_where_it_would_preempt(scheduling_policy):
    """A full cluster still takes an urgent request where something less urgent runs, since that
    replica's scheduler preempts for it as one engine's would: as many such requests as there are
    less urgent ones to displace, and none under fcfs, or for a request only as urgent."""
    router = make_router(num_replicas=2, max_num_seqs=1, scheduling_policy=scheduling_policy)

    def submit(rid: str, priority: int, seed: int) -> list[Dispatch]:
        request = req(rid, seed=seed)
        request.priority = priority
        return router.submit(request)

    assert submit("low0", 10, 1) + submit("low1", 10, 2) == [Dispatch("low0", 0), Dispatch("low1", 1)]
    assert submit("as-low", 10, 3) == []
    if scheduling_policy == "fcfs":
        assert submit("urgent0", -10, 4) == []
        return
    assert submit("urgent0", -10, 4) == [Dispatch("urgent0", 0)]
    assert submit("urgent1", -10, 5) == [Dispatch("urgent1", 1)]
    assert submit("urgent2", -10, 6) == []  # both low ones are displaced already
    assert [r.request_id for r in router.queue] == ["urgent2", "as-low"]
    assert router.on_complete(0, "urgent0") == [Dispatch("urgent2", 0)]  # low0 is there to displace again


def test_baselines_never_migrate():
    router = make_router("least-loaded", num_replicas=2)
    router.replicas[0].on_dispatch("a", [], 12, 4, 12)
    router.replicas[0].report(num_free_blocks=0, num_running=1, num_waiting=1)
    assert router.migration_candidates(0) == []


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "coordinated"])
def test_dead_replicas_get_nothing_until_they_rejoin(policy):
    router = make_router(policy, num_replicas=2)
    cache_on(router.replicas[0], list(range(100, 132)))
    router.replicas[0].on_dispatch("running", [], 12, 4, 0)
    router.mark_dead(0)
    assert not router.replicas[0].in_flight and router.replicas[0].prefix.is_stale
    assert [d.replica_id for d in router.submit(req("a")) + router.submit(req("b", seed=1))] == [1, 1]
    router.mark_dead(1)
    assert router.submit(req("c", seed=2)) == []  # nobody alive: it waits in the queue
    assert router.mark_alive(0) == [Dispatch("c", 0)]


def test_config_validation():
    assert RouterConfig(policy="least-loaded").policy is Policy.LEAST_LOADED
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="pending_prefix_weight"):
        RouterConfig(pending_prefix_weight=1.5)
    with pytest.raises(ValueError, match="max_overtakes"):
        RouterConfig(max_overtakes=-1)
    with pytest.raises(ValueError, match="more KV blocks"):
        make_router(num_blocks=2).submit(req("a", 16))


@pytest.mark.parametrize("finished", [True, False])
def test_requests_that_stop_early_teach_the_router_their_real_length(finished):
    """max_tokens 380 on a 400-token replica: planned in full, one request fits at a time. After
    eight stop at 20 tokens on their own, the next ones are planned at 20 and fit together;
    aborted or failed ones (finished=False) teach nothing."""
    router = make_router(num_replicas=1, num_blocks=100)
    assert router.submit(req("r0", 16, max_tokens=380)) == [Dispatch("r0", 0)]
    assert router.submit(req("r1", 16, max_tokens=380, seed=1)) == []
    for i in range(8):
        router.on_progress(0, f"r{i}", 20)
        assert router.on_complete(0, f"r{i}", finished=finished) == [Dispatch(f"r{i + 1}", 0)]
        if i < 7:
            assert router.submit(req(f"r{i + 2}", 16, max_tokens=380, seed=i + 2)) == []
    later = [d for i in range(10, 14) for d in router.submit(req(f"r{i}", 16, max_tokens=380, seed=i))]
    assert len(later) == (4 if finished else 0)


def test_a_queued_request_sees_a_replica_report_more_room():
    """What the router last computed for a queued request is reused only while the replica is
    unchanged: a report of more free blocks alone must let it in."""
    router = make_router(num_replicas=1, num_blocks=100)
    router.replicas[0].report(num_free_blocks=3, num_running=1, num_waiting=0)  # busy with work it never routed
    assert router.submit(req("a", 16, max_tokens=4)) == []  # needs 5 blocks now
    assert router.dispatch_ready() == []
    router.replicas[0].report(num_free_blocks=50, num_running=1, num_waiting=0)
    assert router.dispatch_ready() == [Dispatch("a", 0)]
