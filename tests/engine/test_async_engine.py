"""AsyncEngine's withdraw and abort on a tiny random model: only a request that never started comes
back; an abort ends the request's stream."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.async_engine import EngineError


@pytest.fixture(scope="module")
def one_slot_engine(tiny_model_dir):
    """One sequence at a time, so a second request waits while the first runs."""
    engine = AsyncEngine(EngineConfig(str(tiny_model_dir), block_size=4, num_kv_blocks=64, max_num_seqs=1))
    engine.start()
    yield engine
    engine.shutdown()


def test_withdraw_a_waiting_request_but_not_a_running_one(one_slot_engine):
    engine = one_slot_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario():
        running = engine.generate([5, 6, 7], params, "running")
        first = await anext(running)  # it has a token: started
        outputs = []

        async def consume_waiting():
            async for out in engine.generate([8, 9, 10], params, "waiting"):
                outputs.append(out)
            return "ended"

        waiting = asyncio.create_task(consume_waiting())
        while engine.stats().num_waiting == 0:
            await asyncio.sleep(0.005)
        assert not await engine.withdraw("running")
        assert await engine.withdraw("waiting")
        assert await asyncio.wait_for(waiting, 5) == "ended" and outputs == []  # nothing ever streamed
        assert not await engine.withdraw("waiting")  # gone
        assert not await engine.withdraw("never-submitted")
        outs = [first] + [out async for out in running]  # the running one was not touched
        return outs[-1]

    last = asyncio.run(scenario())
    assert last.finished and len(last.outputs[0].token_ids) == 40
    assert "waiting" not in engine.engine.requests and not engine.engine.has_unfinished()


def test_an_abort_from_outside_ends_the_stream_and_frees_the_request(one_slot_engine):
    """A router aborts a replica's request while its stream is still open (the cluster's caller
    left): the stream ends with an error rather than waiting forever, and the id is free again."""
    engine = one_slot_engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario() -> list:
        stream = engine.generate([5, 6, 7], params, "aborted")
        outputs = [await anext(stream)]
        engine.abort("aborted")
        with pytest.raises(EngineError, match="aborted"):
            async for out in stream:
                outputs.append(out)
        again = [out async for out in engine.generate([5, 6, 7], params, "aborted")]  # the id is free
        return outputs, again

    outputs, again = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert not outputs[-1].finished and again[-1].finished
    assert not engine.engine.has_unfinished()
