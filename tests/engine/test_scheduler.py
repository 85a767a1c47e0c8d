"""Scheduler policy on fabricated requests: budget, chunking, decode priority, preemption."""

from __future__ import annotations

import pytest

from engine.sequence import RequestStatus
from tests.helpers import make_requests, make_scheduler


def _run_step(sched, token=7):
    out = sched.schedule()
    sampled = {c.request.request_id: [token] for c in out.chunks if c.completes_sequence}
    return out, sched.update_from_output(out, sampled)


def test_token_budget_chunks_prefill():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=10)
    (req,) = make_requests(1, 25)
    sched.add_request(req)
    sizes = []
    while req.num_output_tokens == 0:
        out, _ = _run_step(sched)
        sizes.append(out.num_batched_tokens)
    assert sizes == [10, 10, 5]


def test_running_decodes_come_before_new_prefills():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    a, b = make_requests(2, 6, max_tokens=10)
    sched.add_request(a)
    _run_step(sched)
    sched.add_request(b)
    out, _ = _run_step(sched)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r1", 6)]


def test_prefill_cap_bounds_prompt_chunks_only_while_something_decodes():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=5)
    a, b, c = make_requests(3, [12, 30, 9], max_tokens=20)
    sched.add_request(a)
    out, _ = _run_step(sched)
    assert out.num_batched_tokens == 12  # nothing decodes yet: the whole prompt in one step
    sched.add_request(b)
    sched.add_request(c)
    steps = []
    while b.num_output_tokens == 0 or c.num_output_tokens == 0:
        out, _ = _run_step(sched)
        # (request, prompt tokens in this chunk): decode chunks start past the prompt
        steps.append([(ch.request.request_id, max(0, min(ch.num_tokens, ch.request.num_prompt_tokens - ch.start)))
                      for ch in out.chunks])
    # every step decodes r0 and gives the two prompts 5 tokens between them, in arrival order
    assert steps[0] == [("r0", 0), ("r1", 5)]
    assert all(s[0] == ("r0", 0) and sum(n for _, n in s) <= 5 for s in steps)
    assert sum(n for s in steps for rid, n in s if rid == "r1") == 30
    assert sum(n for s in steps for rid, n in s if rid == "r2") == 9
    assert len(steps) == -(-(30 + 9) // 5)  # the cap is used in full: no step wasted


def test_prefill_cap_must_not_be_negative():
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        make_scheduler(num_blocks=8, max_prefill_tokens_with_decodes=-1)


def test_max_num_seqs_caps_running():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for r in make_requests(4, 3):
        sched.add_request(r)
    out, _ = _run_step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 2


def test_queue_time_runs_from_arrival_to_first_admission_only():
    """What /metrics' request_queue_time_seconds reads: a resume after preemption does not reset it."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    first, second = make_requests(2, 3, max_tokens=2)
    first.arrival_time -= 5.0  # as if it had arrived 5 s ago
    sched.add_request(first)
    sched.add_request(second)
    assert first.queue_time_s is None
    _run_step(sched)
    assert 5.0 <= first.queue_time_s < 6.0 and second.queue_time_s is None  # max_num_seqs=1: still waiting
    while first.num_output_tokens < 2:
        _run_step(sched)
    _run_step(sched)
    admitted_after = second.queue_time_s
    assert admitted_after is not None and admitted_after >= 0
    sched._preempt(sched.running.pop())
    _run_step(sched)
    assert second.queue_time_s == admitted_after


def test_preemption_recomputes_and_puts_victim_first():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    reqs = make_requests(2, 7, max_tokens=10)  # 17 tokens: each alone fits in 5 blocks, not both
    for r in reqs:
        sched.add_request(r)
    preempted = []
    for _ in range(30):
        out, _ = _run_step(sched)
        preempted += out.preempted
        if not sched.has_unfinished():
            break
    assert preempted, "two requests growing in 5 blocks of 4 must collide"
    victim = preempted[0]
    assert victim.request_id == "r1", "the newest running request is the victim"
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == 10 for r in reqs)
    assert sched.block_manager.num_free_blocks == 5
    assert sched.num_preemptions == len(preempted)


def test_finish_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8)
    (req,) = make_requests(1, 9, max_tokens=50)
    sched.add_request(req)
    _run_step(sched)
    assert sched.block_manager.num_free_blocks < 8
    sched.finish(req, RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()


def test_stop_token_and_length():
    sched = make_scheduler(num_blocks=16)
    a, b = make_requests(2, 4, max_tokens=3)
    a.params.stop_token_ids = [7]
    sched.add_request(a)
    sched.add_request(b)
    _, finished = _run_step(sched, token=7)
    assert finished == [a] and a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 7
    for _ in range(2):
        _run_step(sched, token=7)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 3


def test_prefix_hits_are_counted_once():
    sched = make_scheduler(num_blocks=32)
    shared = list(range(100, 116))
    a, b = make_requests(2, 3, prefix=shared)
    sched.add_request(a)
    _run_step(sched)
    sched.add_request(b)
    out, _ = _run_step(sched)
    chunk_b = next(c for c in out.chunks if c.request is b)
    assert chunk_b.start == 16 and b.num_cached_tokens == 16
    assert sched.prefix_hits == 16


def test_withdraw_takes_back_only_requests_never_admitted():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=1)
    running, waiting = make_requests(2, 7, max_tokens=10)
    sched.add_request(running)
    sched.add_request(waiting)
    _run_step(sched)
    free = sched.block_manager.num_free_blocks
    assert not sched.withdraw([running])  # admitted: it stays
    assert not sched.withdraw([running, waiting])  # all or none
    assert list(sched.waiting) == [waiting] and sched.running == [running]
    assert sched.withdraw([waiting])
    assert not sched.waiting and waiting.status is RequestStatus.WAITING  # ready for another scheduler
    assert sched.block_manager.num_free_blocks == free  # it held nothing, frees nothing
    assert not sched.withdraw([waiting])  # no longer here


def test_a_preempted_request_is_not_withdrawn():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    reqs = make_requests(2, 7, max_tokens=10)
    for r in reqs:
        sched.add_request(r)
    while not any(r.status is RequestStatus.PREEMPTED for r in reqs):
        _run_step(sched)
    victim = next(r for r in reqs if r.status is RequestStatus.PREEMPTED)
    assert victim in sched.waiting and not sched.withdraw([victim])
