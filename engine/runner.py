"""The only place that builds tensors: one flat forward per step for mixed prefill + decode."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.layers import cpu_attention, triton_attention
from engine.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    ForwardContext,
    KVCache,
    PagedDecode,
    PagedPrefill,
    PrefillSpan,
    TritonBatch,
    attention_mask,
)
from engine.lora import LoRALayers
from engine.models.llama import LlamaForCausalLM
from engine.outputs import LogprobsDict
from engine.sampler import SamplingRow, prompt_logprobs, sample, verify
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.structured_output import new_matcher
from engine.thinking import BlockWalk, ThinkingCounter


@dataclass(slots=True)
class StepResult:
    # request id → its new tokens (chunks that complete their sequence): the next token, or the
    # drafts the sampler accepted and one more
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[LogprobsDict]]  # one entry per new token, for requests that asked
    # request id → (index of the first prompt token covered, entries), for prompt_logprobs requests
    prompt_logprobs: dict[str, tuple[int, list[LogprobsDict]]]
    # request id → its pooled final hidden state [hidden] fp32, for embedding requests whose prompt completed
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


def _length_groups(lengths: list[int], max_ratio: float = 1.5) -> list[tuple[int, int]]:
    """Split ascending `lengths` into runs whose longest is at most max_ratio × shortest (+16)."""
    groups, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] > max_ratio * lengths[start] + 16:
            groups.append((start, i))
            start = i
    return groups


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, seed: int | None = 0,
                 backend: str = "auto", lora: LoRALayers | None = None):
        self.model = model
        self.lora = lora  # the LoRA adapters' wrappers, told each step which rows are whose
        self.kv_cache = kv_cache
        self.block_size = block_size
        # the torch path's masks: causal for layers that attend fully, windowed for the others
        windows = model.args.layer_windows
        self.sliding_window = next((w for w in windows if w), None)
        self.full_attention = any(w is None for w in windows)
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()  # a nondeterministic one
        else:
            self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.request_matchers: dict[str, object] = {}  # request id → its grammar matcher (structured outputs)
        self.thinking_counters: dict[str, ThinkingCounter] = {}  # request id → its thinking budget's count
        self.grammar_waits_on: dict[str, BlockWalk] = {}  # request id → the block its grammar waits to close
        self.pooling_state: dict[str, torch.Tensor] = {}  # embedding requests: the running sum, or the first row
        # request id → (its block_ids list, that list as int32): see _block_row
        self.block_rows: dict[str, tuple[list[int], np.ndarray]] = {}
        self.device = kv_cache.k[0].device
        self.backend = self.default_backend(kv_cache) if backend == "auto" else backend
        if self.backend == "triton" and not triton_attention.available(self.device):
            raise ValueError("attention_backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        if self.backend == "c" and not cpu_attention.available(kv_cache.dtype, self.device):
            raise ValueError(f"attention_backend='c' needs a CPU, a C compiler and a {kv_cache.dtype} cache it reads")
        # the c backend's prompt kernel (else its prompts take the torch path)
        self.prefill_kernel_built = (cpu_attention.available(kv_cache.dtype, self.device, "prefill")
                                     and kv_cache.k[0].shape[-1] % cpu_attention.PREFILL_HEAD_DIM_MULTIPLE == 0)
        self.graphs: DecodeGraphs | None = None  # CUDA: set by the engine unless enforce_eager
        # sizes the Triton kernel's key-range splits for decode batches
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0

    @staticmethod
    def default_backend(kv_cache: KVCache) -> str:
        """triton (CUDA: every query), c (CPU: C kernels for decode and prompt queries), or torch (the oracle)."""
        device = kv_cache.k[0].device
        if device.type == "cuda" and triton_attention.available(device):
            return "triton"
        return "c" if cpu_attention.available(kv_cache.dtype, device) else "torch"

    def _decode_slots(self, decodes: list[ScheduledChunk]) -> torch.Tensor:
        """Cache slots of single-token chunks (each token sits at position c.start), in plain ints:
        a handful of tensor ops per step cost more than the arithmetic."""
        bs = self.block_size
        return torch.tensor([c.request.block_ids[c.start // bs] * bs + c.start % bs for c in decodes])

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of token positions [start, end) of one request."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def build_metadata(self, chunks: list[ScheduledChunk], input_ids: list[int] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks must have the single-token ones first. → (input_ids, positions, metadata).

        `input_ids` overrides the tokens read from the requests (a draft has no place there yet).
        """
        positions = []
        for c in chunks:
            positions.extend(range(c.start, c.start + c.num_tokens))
        if input_ids is None:
            input_ids = [t for c in chunks for t in c.request.all_token_ids[c.start:c.start + c.num_tokens]]
        input_ids_t = torch.tensor(input_ids, dtype=torch.long)
        positions_t = torch.tensor(positions, dtype=torch.long)
        decodes = [c for c in chunks if c.num_tokens == 1]
        if self.backend == "triton":
            meta = self._triton_metadata(chunks, positions_t, len(decodes))
        else:
            meta = self._torch_metadata(chunks, decodes)
        return input_ids_t, positions_t, meta

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata on the cache's GPU (built on the CPU; graphs copy it themselves)."""
        to, triton = self.device, meta.triton
        if triton is not None:
            triton = replace(triton, block_tables=triton.block_tables.to(to),
                             query_start_loc=triton.query_start_loc.to(to), seq_lens=triton.seq_lens.to(to))
        def moved(mask: torch.Tensor | None) -> torch.Tensor | None:
            return None if mask is None else mask.to(to)

        groups = [DecodeGroup(g.row_start, g.slots.to(to), moved(g.mask), moved(g.window_mask))
                  for g in meta.decode_groups]
        prefills = [PrefillSpan(p.token_start, p.num_query_tokens, p.context_slots.to(to), moved(p.mask),
                                moved(p.window_mask)) for p in meta.prefills]
        return AttentionMetadata(meta.slot_mapping.to(to), meta.num_decode_tokens, groups, prefills,
                                 meta.paged_decode, meta.paged_prefill, triton)

    def _triton_metadata(self, chunks: list[ScheduledChunk], positions: torch.Tensor,
                         num_decodes: int) -> AttentionMetadata:
        """One TritonBatch for the whole step."""
        tables = self._block_tables(chunks, torch.int32)
        lengths = [c.num_tokens for c in chunks]
        query_start, seq_lens = self._query_start(chunks), self._context_lens(chunks)
        bs, splits = self.block_size, 1
        if num_decodes == len(chunks):
            slots = self._decode_slots(chunks)
            if self.num_sms:
                splits = triton_attention.decode_splits(len(chunks), self.kv_cache.k[0].shape[1], self.num_sms)
        else:
            owner = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lengths))
            slots = tables[owner, positions // bs].long() * bs + positions % bs
        batch = TritonBatch(tables, query_start, seq_lens, max(lengths), bs, splits)
        return AttentionMetadata(slots, num_decodes, [], [], triton=batch)

    def _torch_metadata(self, chunks: list[ScheduledChunk], decodes: list[ScheduledChunk]) -> AttentionMetadata:
        """Decode groups and one span per prompt chunk, or the C kernels' tables in their place."""
        nd = len(decodes)
        slot_parts, groups, kernel_decode = [], [], None
        if decodes and self.backend == "c":
            kernel_decode = self._paged_decode(decodes)
            slot_parts.append(self._decode_slots(decodes))
        elif decodes:
            groups = self._decode_groups(decodes, slot_parts)
        prefill_chunks, prefills, kernel_prefill = chunks[nd:], [], None
        if prefill_chunks and self.backend == "c" and self.prefill_kernel_built:
            kernel_prefill = self._paged_prefill(prefill_chunks)
            slot_parts += [self._slots(c.request.block_ids, c.start, c.start + c.num_tokens) for c in prefill_chunks]
        else:
            prefills = self._prefill_spans(prefill_chunks, nd, slot_parts)
        slots = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
        return AttentionMetadata(slots, nd, groups, prefills, kernel_decode, kernel_prefill)

    def _prefill_spans(self, prefill_chunks: list[ScheduledChunk], row: int,
                       slot_parts: list[torch.Tensor]) -> list[PrefillSpan]:
        """Torch path: one span (context slots, causal mask) per prompt chunk; appends its tokens' write slots."""
        prefills = []
        for c in prefill_chunks:
            end = c.start + c.num_tokens
            context = self._slots(c.request.block_ids, 0, end)
            slot_parts.append(context[c.start:])
            # queries sit at the end of the context: query i sees keys ≤ start + i (and within its window)
            queries = torch.arange(c.start, end)
            mask = attention_mask(queries, end, None) if c.start else None
            window_mask = None
            if self.sliding_window and end > self.sliding_window:
                window_mask = attention_mask(queries, end, self.sliding_window)
            prefills.append(PrefillSpan(row, c.num_tokens, context, mask, window_mask))
            row += c.num_tokens
        return prefills

    def _paged_prefill(self, prefill_chunks: list[ScheduledChunk]) -> PagedPrefill:
        return PagedPrefill(self._block_tables(prefill_chunks, torch.int32), self._query_start(prefill_chunks),
                            self._context_lens(prefill_chunks), self.block_size)

    def _block_tables(self, chunks: list[ScheduledChunk], dtype: torch.dtype) -> torch.Tensor:
        """[n, max_blocks] block ids of each chunk's request, right-padded with block 0."""
        rows = [self._block_row(c.request) for c in chunks]
        table = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        return torch.from_numpy(table).to(dtype)

    def _block_row(self, request) -> np.ndarray:
        """The request's block ids as int32, converted once and extended as blocks are added.

        Converting whole lists each step cost ~1 ms at batch 8 with 32k-token contexts. A block
        list only grows until the blocks are freed, and freeing gives the request a new list, so
        a cached row is reused while it comes from the same list object.
        """
        ids = request.block_ids
        cached = self.block_rows.get(request.request_id)
        if cached is not None and cached[0] is ids:
            row = cached[1]
            if len(row) == len(ids):
                return row
            row = np.concatenate([row, np.asarray(ids[len(row):], dtype=np.int32)])
        else:
            row = np.asarray(ids, dtype=np.int32)
        self.block_rows[request.request_id] = (ids, row)
        return row

    @staticmethod
    def _context_lens(chunks: list[ScheduledChunk]) -> torch.Tensor:
        """int32 [n]: each chunk's request length once this step's tokens are in."""
        return torch.tensor([c.start + c.num_tokens for c in chunks], dtype=torch.int32)

    @staticmethod
    def _query_start(chunks: list[ScheduledChunk]) -> torch.Tensor:
        """int32 [n + 1]: where each chunk's rows start in the flat batch of these chunks."""
        return torch.tensor([0] + [c.num_tokens for c in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def _paged_decode(self, decodes: list[ScheduledChunk]) -> PagedDecode:
        return PagedDecode(self._block_tables(decodes, torch.int32), self._context_lens(decodes), self.block_size)

    def _decode_groups(self, decodes: list[ScheduledChunk], slot_parts: list[torch.Tensor]) -> list[DecodeGroup]:
        """Torch path: decode batches of similar context length; appends each token's write slot."""
        bs, groups = self.block_size, []
        for start, end in _length_groups([c.start + 1 for c in decodes]):
            group = decodes[start:end]
            context_lens = torch.tensor([c.start + 1 for c in group])
            tables = self._block_tables(group, torch.long)
            pos = torch.arange(int(context_lens.max()))
            slots = tables[:, pos // bs] * bs + pos % bs  # [n, max_len]
            queries, num_keys = context_lens - 1, len(pos)
            mask = attention_mask(queries, num_keys, None)[:, None, None, :] if self.full_attention else None
            window_mask = (attention_mask(queries, num_keys, self.sliding_window)[:, None, None, :]
                           if self.sliding_window else None)
            groups.append(DecodeGroup(start, slots, mask, window_mask))
            slot_parts.append(slots.gather(1, (context_lens - 1).unsqueeze(1)).squeeze(1))
        return groups

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk], input_ids: list[int] | None = None) -> torch.Tensor:
        """Run the model over `chunks` (single-token ones first); hidden states [num_tokens, hidden]."""
        input_ids, positions, meta = self.build_metadata(chunks, input_ids)
        num_tokens = input_ids.shape[0]
        adapted = self.lora is not None and self.lora.begin_step([(c.request.lora_index, c.num_tokens) for c in chunks])
        if (not adapted and self.graphs is not None and meta.num_decode_tokens == num_tokens
                and self.graphs.padded_size(num_tokens) is not None):
            return self.graphs.run(input_ids, positions, meta)
        if self.device.type != "cpu":
            input_ids, positions, meta = input_ids.to(self.device), positions.to(self.device), self._to_device(meta)
        ctx = ForwardContext(meta, self.kv_cache)
        try:
            return self.model(input_ids, positions, ctx)
        finally:
            if adapted:
                self.lora.end_step()

    @staticmethod
    def _queries(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[int]]:
        """The forward's rows and their tokens: a decode with drafts becomes one single-token query
        per token, at consecutive positions of its sequence. Each sees the keys up to its own
        position, all written before attention reads any, so the causal mask comes free and the
        drafts ride the decode kernels (5 queries cost 1.4x one here, a prompt-style chunk 2x)."""
        queries, input_ids = [], []
        for c in chunks:
            known = c.request.all_token_ids[c.start:c.start + c.num_tokens - len(c.draft_token_ids)]
            input_ids += known
            if c.draft_token_ids:
                input_ids += c.draft_token_ids
                queries += [ScheduledChunk(c.request, c.start + j, 1) for j in range(c.num_tokens)]
            else:
                queries.append(c)
        return queries, input_ids

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        # decodes (with or without drafts) first, shortest context first, so similar lengths share a decode group
        chunks = sorted(out.chunks, key=lambda c: (not c.is_decode, c.start if c.is_decode else 0))
        hidden = self.forward(*self._queries(chunks))

        result = StepResult({}, {}, {})
        # Rows whose logits are needed: the last row of completing chunks, every row of a decode
        # with drafts, and every prompt row of requests that asked for prompt logprobs.
        sample_rows, rows, prompt_spans = [], [], []
        plain = []  # indices into sample_rows of the rows that sample one token
        drafted = []  # (chunk, its first index into sample_rows, its sampling row)
        offset = 0
        for c in chunks:
            request = c.request
            if request.params.prompt_logprobs is not None:
                # logits at position p score prompt token p + 1; rows before prompt_logprobs_start − 1
                # score tokens nobody asked for, and the vocab-wide logits are a large share of a step
                first = max(c.start, request.params.prompt_logprobs_start - 1)
                last = min(c.start + c.num_tokens, request.num_prompt_tokens - 1)
                if first < last:
                    prompt_spans.append((c, offset + first - c.start, first, last - first))
            if request.params.pooling is not None:  # embedded, not sampled
                self._pool(c, hidden[offset:offset + c.num_tokens], result)
            elif c.draft_token_ids:
                drafted.append((c, len(sample_rows), self._sampling_row(request)))
                sample_rows += range(offset, offset + c.num_tokens)
            elif c.completes_sequence:
                plain.append(len(sample_rows))
                sample_rows.append(offset + c.num_tokens - 1)
                rows.append(self._sampling_row(request))
            offset += c.num_tokens

        if sample_rows:
            # every row (a decode-only step): no gather, no index tensor to send to a GPU
            logits = self.model.compute_logits(hidden if len(sample_rows) == len(hidden) else hidden[sample_rows])
            if drafted:
                for c, first, row in drafted:
                    tokens, logprobs = verify(logits[first:first + c.num_tokens], row, c.draft_token_ids,
                                              self.generator)
                    self._record(result, c.request.request_id, tokens, logprobs)
                logits = logits[plain]
            tokens, logprobs = sample(logits, rows, self.generator) if rows else ([], [])
            done = [c for c in chunks if c.completes_sequence and not c.draft_token_ids
                    and c.request.params.pooling is None]
            for c, tok, lp in zip(done, tokens, logprobs, strict=True):
                self._record(result, c.request.request_id, [tok], [lp])
        for c, row_start, first, count in prompt_spans:
            logits = self.model.compute_logits(hidden[row_start:row_start + count])
            targets = c.request.all_token_ids[first + 1:first + 1 + count]
            result.prompt_logprobs[c.request.request_id] = (first + 1, prompt_logprobs(
                logits, targets, c.request.params.prompt_logprobs))
        return result

    @staticmethod
    def _record(result: StepResult, request_id: str, tokens: list[int], logprobs: list[LogprobsDict | None]) -> None:
        result.sampled[request_id] = tokens
        if logprobs[0] is not None:
            result.logprobs[request_id] = logprobs

    def _sampling_row(self, request) -> SamplingRow:
        gen = None
        if request.params.seed is not None and not request.params.is_greedy:
            gen = self.request_generators.get(request.request_id)
            if gen is None:
                gen = torch.Generator().manual_seed(request.params.seed)
                self.request_generators[request.request_id] = gen
        matcher = self.request_matchers.get(request.request_id)
        if matcher is None and request.grammar is not None and not self.grammar_waits(request):
            matcher = self.request_matchers[request.request_id] = new_matcher(request.grammar)
            self.grammar_waits_on.pop(request.request_id, None)  # the wait is over for good
        return SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids, gen, matcher,
                           self._thinking_counter(request))

    def _thinking_counter(self, request) -> ThinkingCounter | None:
        budget = request.params.thinking_budget
        if budget is None:
            return None
        counter = self.thinking_counters.get(request.request_id)
        if counter is None:
            counter = self.thinking_counters[request.request_id] = ThinkingCounter(budget, request.prompt_token_ids)
        counter.commit(request.output_token_ids)
        return counter

    def grammar_waits(self, request) -> bool:
        """Whether the request's grammar has yet to start (structured_outputs_after not seen; with a
        thinking budget and no such marker, while the budget's block is open: the constraint holds
        the answer, and would refuse the block's forced end): once it has a matcher it holds, so only
        a waiting request scans its tokens."""
        if request.grammar is None or request.request_id in self.request_matchers:
            return False
        params = request.params
        if params.structured_outputs_after is None:
            return params.thinking_budget is not None and self._thinking_counter(request).is_open()
        block = self.grammar_waits_on.get(request.request_id)
        if block is None:
            block = self.grammar_waits_on[request.request_id] = BlockWalk(
                params.structured_outputs_reopened_by or (), params.structured_outputs_after, request.prompt_token_ids,
                open_at_start=True)
        block.commit(request.output_token_ids)
        return block.is_open()

    def _pool(self, chunk: ScheduledChunk, hidden: torch.Tensor, result: StepResult) -> None:
        """Fold an embedding request's chunk into its pooled state; the chunk that completes its
        prompt puts the result in `result.pooled`. Mean and first-token pooling see every prompt
        token (the block manager gives them no prefix-cache hit); a recomputed prompt starts over."""
        request_id, kind = chunk.request.request_id, chunk.request.params.pooling
        if kind == "mean":
            total = hidden.float().sum(dim=0)
            if chunk.start > 0:
                total += self.pooling_state[request_id]
            self.pooling_state[request_id] = total
        elif kind == "cls" and chunk.start == 0:
            self.pooling_state[request_id] = hidden[0].float()
        if chunk.completes_sequence:
            if self.model.score is not None:  # a classifier: its head on the last token, as HF pools it
                result.pooled[request_id] = self.model.classify(hidden[-1:])[0].cpu()
                return
            if kind == "last":
                pooled = hidden[-1].float()
            elif kind == "mean":
                pooled = self.pooling_state[request_id] / chunk.request.num_prompt_tokens
            else:
                pooled = self.pooling_state[request_id]
            result.pooled[request_id] = pooled.cpu()

    def release(self, request_id: str) -> None:
        self.pooling_state.pop(request_id, None)
        self.request_generators.pop(request_id, None)
        self.request_matchers.pop(request_id, None)
        self.thinking_counters.pop(request_id, None)
        self.grammar_waits_on.pop(request_id, None)
        self.block_rows.pop(request_id, None)
