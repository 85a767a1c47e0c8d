"""Which batch sizes decode graphs are captured for (the replays themselves run in the `cuda` tests
of test_engine_vs_hf.py: greedy tokens equal HF's with graphs on)."""

from __future__ import annotations

import pytest

from engine.cuda_graphs import capture_sizes


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_every_batch_size_pads_to_a_captured_one(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes
    for n in range(1, max_num_seqs + 1):  # the padding a batch of n rows gets stays under 8 rows
        padded = next(s for s in sizes if s >= n)
        assert padded - n < 8
