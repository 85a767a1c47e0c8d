"""The "priority" scheduling policy: lower values are admitted, budgeted and kept first."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig
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
