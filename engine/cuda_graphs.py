"""Decode steps replayed from CUDA graphs: one graph per padded batch size, captured on first use.

A decode step of a small model is hundreds of short kernel launches; launching them from
Python costs more than running them. A graph records the launches once and replays them with
one call. Replays read their inputs from fixed buffers, so each step copies its token ids,
positions, cache slots and block tables into those, pads the batch to the next captured size
(padding rows write their K/V to a spare slot no sequence owns and attend one key), and
replays. Capture happens the first time a size is seen, after prompts ran, so dynamic fp8 KV
scales are already set.
"""

from __future__ import annotations

import torch

from engine.layers import triton_attention
from engine.layers.attention import AttentionMetadata, ForwardContext, KVCache, TritonBatch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs (padding under 8 rows)."""
    candidates = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [s for s in candidates if s < max_num_seqs] + [next(s for s in candidates if s >= max_num_seqs)]


class DecodeGraphs:
    """Static input buffers and the graphs captured over them, keyed by batch size."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, max_num_seqs: int,
                 max_model_len: int, pad_slot: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.sizes = capture_sizes(max_num_seqs)
        device = kv_cache.k[0].device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), pad_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, -(-max_model_len // block_size), dtype=torch.int32, device=device)
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by every graph (they never run at once)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step (CPU tensors, meta built for the Triton backend) → hidden [num_seqs, hidden].

        Inputs go straight from the CPU into the fixed buffers: one copy each, no device temporaries.
        """
        n = input_ids.shape[0]
        size = self.padded_size(n)
        tables = meta.triton.block_tables
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        # columns past this step's widest table keep stale ids: the kernel stops at each seq_len
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        self.seq_lens[:n].copy_(meta.triton.seq_lens)
        if n < size:  # padding rows: token 0 at position 0, written to the spare slot, seeing one key
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.block_tables[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        splits = triton_attention.decode_splits(size, self.kv_cache.k[0].shape[1], self.sms)
        batch = TritonBatch(self.block_tables[:size], self.query_start[:size + 1], self.seq_lens[:size], 1,
                            self.block_size, splits)
        ctx = ForwardContext(AttentionMetadata(self.slot_mapping[:size], size, [], [], triton=batch), self.kv_cache)
        ids = self.input_ids[:size]
        # Warm up on a side stream (compiles kernels, creates library handles); it also runs this
        # step for real, and the replay that follows recomputes the same values.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(ids, self.positions[:size], ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            # a fresh view: the rotary table reuses its lookup while it sees the same positions
            # tensor, and the graph must record the lookup itself
            hidden = self.model(ids, self.positions[:size], ctx)
        self.pool = graph.pool()
        return graph, hidden
