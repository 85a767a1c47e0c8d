"""The runner's cached int32 block rows follow each request's block list exactly, and go with it."""

from __future__ import annotations

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine


def test_cached_rows_track_growth_new_lists_and_release(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64))
    rows = engine.runner.block_rows
    engine.add_request("r", list(range(10, 19)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    request = engine.requests["r"].sequences[0].request
    seen_lengths = set()
    while engine.has_unfinished():
        engine.step()
        if "r" in rows:
            ids, row = rows["r"]
            assert ids is request.block_ids and row.tolist() == request.block_ids
            seen_lengths.add(len(row))
    assert len(seen_lengths) > 2  # the row was extended as blocks were added, not only built once
    assert "r" not in rows  # released with the request

    # a request whose blocks were freed and reallocated holds a new list: its row is rebuilt
    class Stub:
        request_id = "s"
        block_ids = [5, 6, 7]

    stub = Stub()
    assert engine.runner._block_row(stub).tolist() == [5, 6, 7]
    stub.block_ids = [9]
    assert engine.runner._block_row(stub).tolist() == [9]
