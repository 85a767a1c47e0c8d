"""The "priority" scheduling policy: lower values are admitted, budgeted and kept first."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Request
from tests.helpers import make_requests


def _scheduler(num_blocks: int = 64, max_num_seqs: int = 8, policy: str = "priority") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy),
                     BlockManager(num_blocks, 4))


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = _scheduler(max_num_seqs=2)
    requests = make_requests(4, 4)
    for request, priority in zip(requests, [1, 0, 1, 0], strict=True):
        request.priority = priority
        sched.add_request(request)
    assert [r.request_id for r in sched.waiting] == ["r1", "r3", "r0", "r2"]
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r1", "r3"]


def test_the_least_urgent_running_request_is_preempted():
    sched = _scheduler(num_blocks=3)
    low, high = make_requests(2, 4, max_tokens=8)
    low.priority, high.priority = 5, -1
    sched.add_request(low)
    sched.update_from_output(sched.schedule(), {low.request_id: [9]})  # low runs alone first
    sched.add_request(high)
    sched.update_from_output(sched.schedule(), {high.request_id: [9], low.request_id: [9]})
    assert [r.request_id for r in sched.running] == [high.request_id, low.request_id]
    # 3 blocks: both need a second one to go on; the later but more urgent request keeps running
    out = sched.schedule()
    assert out.preempted == [low] and [c.request for c in out.chunks] == [high]
    assert list(sched.waiting) == [low]


def _arrive_after(sched: Scheduler, priorities: list[int], steps: int) -> tuple[list[Request], SchedulerOutput]:
    """Requests of these priorities, all but the last running `steps` steps before the last
    arrives; returns them and the schedule of the step it arrives in."""
    requests = make_requests(len(priorities), 4, max_tokens=8)
    for request, priority in zip(requests, priorities, strict=True):
        request.priority = priority
    for request in requests[:-1]:
        sched.add_request(request)
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, {c.request.request_id: [9] for c in out.chunks if c.completes_sequence})
    sched.add_request(requests[-1])
    return requests, sched.schedule()


def test_an_urgent_arrival_preempts_the_least_urgent_for_blocks():
    sched = _scheduler(num_blocks=4)
    # after two steps each peer holds 2 of the 4 blocks
    (first, second, urgent), out = _arrive_after(sched, [5, 5, 0], steps=2)
    # the later of the two peers yields, and the urgent request starts in the same step
    assert out.preempted == [second]
    assert [c.request for c in out.chunks] == [first, urgent]
    assert list(sched.waiting) == [second] and sched.num_preemptions == 1


def test_an_urgent_arrival_preempts_for_a_seat():
    (low, lower, urgent), out = _arrive_after(_scheduler(max_num_seqs=2), [3, 4, 1], steps=1)
    assert out.preempted == [lower] and [c.request for c in out.chunks] == [low, urgent]


@pytest.mark.parametrize("policy, priorities", [("priority", [2, 2]), ("fcfs", [0, 0])])
def test_peers_and_fcfs_never_preempt_for_a_waiting_request(policy, priorities):
    (running, _), out = _arrive_after(_scheduler(max_num_seqs=1, policy=policy), priorities, steps=1)
    assert not out.preempted and [c.request for c in out.chunks] == [running]


def test_no_preemption_while_the_urgent_request_fits():
    (low, urgent), out = _arrive_after(_scheduler(num_blocks=8), [5, 0], steps=1)
    assert not out.preempted and [c.request for c in out.chunks] == [low, urgent]


def test_an_urgent_request_overtakes_a_running_one_which_still_answers_the_same(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("batch-job", [5, 6, 7, 8], params, 10)
    outputs = {}
    for _ in range(4):
        outputs.update({o.request_id: o for o in engine.step()})
    engine.add_request("interactive", [9, 10, 11], params, 0)
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
            finished += [out.request_id] if out.finished else []
    assert finished == ["interactive", "batch-job"]
    assert llm.stats().num_preemptions == 1
    # recomputed after the preemption, the batch job's tokens are those it gets alone
    alone = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64).generate(
        [[5, 6, 7, 8], [9, 10, 11]], params, use_tqdm=False)
    assert outputs["batch-job"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outputs["interactive"].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert llm.stats().num_blocks_used == 0


def test_fcfs_refuses_a_priority_it_would_ignore(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="priority scheduling policy"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="integer"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0.5])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[5, 6], [7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert llm.stats().num_waiting == 0 and not llm.engine.has_unfinished()


def test_one_slot_serves_the_most_urgent_first(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for name, priority in [("a", 3), ("b", 1), ("c", 2), ("d", 1)]:
        engine.add_request(name, [5, 6, 7], params, priority)
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["b", "d", "c", "a"]
    # the same outputs as in arrival order: priority changes when, not what
    plain = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    ours = llm.generate([[5, 6, 7]] * 2, params, use_tqdm=False, priority=[1, 0])
    theirs = plain.generate([[5, 6, 7]] * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
