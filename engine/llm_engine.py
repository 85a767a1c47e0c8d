"""The synchronous engine: requests in, one scheduled forward per `step()`, outputs out."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from engine import host_memory
from engine.block_manager import BlockManager
from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig, check_priority
from engine.cuda_graphs import DecodeGraphs
from engine.detokenizer import IncrementalDetokenizer, find_stop
from engine.generation_config import sequence_end_ids
from engine.layers.attention import KVCache
from engine.layers.linear import describe_kernels, matmul_kernels
from engine.loader import apply_kv_scales, defer_kv_scales, load_model, resolve_dtype
from engine.lora import LoRALayers, LoRARequest
from engine.outputs import CompletionOutput, EngineStats, LogprobsDict, RequestOutput
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams, truncate_prompt
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.sequence import Request, RequestStatus
from engine.spec_decode import propose_ngram
from engine.structured_output import GrammarCompiler
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _SequenceState:
    """One of a request's n sequences: the scheduler's Request plus its decoded text."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0  # of its tokens, where logprobs are kept

    def shown_text(self, params: SamplingParams) -> str:
        """The text an output may show so far. Until the sequence ends, its last (longest stop string
        - 1) characters wait: they may begin a stop string the next tokens complete, which would take
        them back out, and a stream cannot unsend what it sent (vLLM holds back the same)."""
        text = self.detok.text
        if self.finish_reason is not None or not params.stop or params.include_stop_str_in_output:
            return text
        return text[: max(0, len(text) - max(map(len, params.stop)) + 1)]


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_SequenceState]
    prompt_logprobs: list[LogprobsDict | None] | None
    embedding: torch.Tensor | None = None  # an embedding request's pooled hidden state, once computed

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def to_output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(i, s.shown_text(self.params), list(s.request.output_token_ids),
                             list(s.logprobs) if s.logprobs is not None else None,
                             s.finish_reason, s.request.stop_reason,
                             s.cumulative_logprob if s.logprobs is not None else None)
            for i, s in enumerate(self.sequences)
        ]
        cached = max(self.sequences[0].request.num_cached_tokens, 0)
        prompt_lp = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        embedding = None if self.embedding is None else self.embedding.tolist()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.finished, prompt_lp, cached, embedding, self.sequences[0].request.queue_time_s)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the runner."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            # checked here, where the engine runs: a cluster's API process may have no GPU itself
            raise ValueError(f"device {config.device!r}: torch {torch.__version__} sees no CUDA device here "
                             f"(use --device cpu, or auto)")
        allocated_before = torch.cuda.memory_allocated(config.device) if config.device.startswith("cuda") else 0
        self.model, self.hf_config = load_model(config.model, config.dtype, config.device, config.max_model_len,
                                                config.hf_overrides, prepack=True)
        self.lora = LoRALayers(self.model, config.max_lora_rank, config.max_cpu_loras) if config.enable_lora else None
        for name, path in (config.lora_modules or {}).items():
            self.lora.add(LoRARequest(name, len(self.lora.paths) + 1, path))
        self.model.prepack_for_cpu()
        log.info("matmul kernels: %s", describe_kernels(matmul_kernels(self.model)))
        # what this engine's weights (and adapters) hold on the GPU: its share of gpu_memory_utilization
        self._weight_bytes = (torch.cuda.memory_allocated(config.device) - allocated_before
                              if config.device.startswith("cuda") else 0)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        args = self.model.args
        longest = args.max_position_embeddings
        self.max_model_len = min(config.max_model_len or longest, longest)
        if config.max_model_len and config.max_model_len > longest:
            log.warning("max_model_len %d is beyond what %s was trained for (max_position_embeddings %d): "
                        "serving %d", config.max_model_len, config.model, longest, longest)
        # most alternatives a request's logprobs may ask for (-1 in the config: every token)
        self.max_logprobs = args.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        kv_dtype = self._kv_dtype()
        num_blocks = config.num_kv_blocks or self._num_blocks_for_memory(kv_dtype)
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            # one sequence must always fit, or it would preempt itself forever
            if config.max_model_len is not None:
                raise ValueError(f"the KV cache holds {capacity} tokens, less than max_model_len="
                                 f"{config.max_model_len}; raise kv_cache_memory_bytes (on CUDA: gpu_memory_utilization) "
                                 "or lower max_model_len")
            self.max_model_len = capacity
            self.model.serve_context(capacity)
        # a mixture of experts picks each expert's rows per step: shapes a graph cannot replay
        use_graphs = config.device.startswith("cuda") and not config.enforce_eager and not args.is_moe
        # CUDA graphs pad decode batches; the padding rows write to one spare slot past the blocks
        self.kv_cache = KVCache(args.num_layers, capacity + (1 if use_graphs else 0), args.num_kv_heads,
                                args.head_dim, kv_dtype, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          record_events=config.record_kv_events)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.max_prefill_tokens_with_decodes, config.scheduling_policy, args.window_everywhere),
            self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, config.seed,
                                  config.attention_backend, self.lora)
        if use_graphs and self.runner.backend == "triton":
            self.runner.graphs = DecodeGraphs(self.model, self.kv_cache, config.block_size, config.max_num_seqs,
                                              self.max_model_len, pad_slot=capacity)
        self.eos_token_ids = sequence_end_ids(self.hf_config, config.model, self.tokenizer)
        host_memory.return_freed_memory()  # what loading freed, kept resident by the C heap
        self.grammars = GrammarCompiler(self.tokenizer, args.vocab_size, self.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self._seq_owner: dict[str, _RequestState] = {}  # sequence id → its request
        self._counter = itertools.count()
        self._scoring = False  # a score_chunks sequence holds the KV cache's '__score__' request
        self.num_generation_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and those the sampler kept
        self.num_accepted_draft_tokens = 0
        self._drafts_kept: dict[str, float] = {}  # sequence id → drafts it kept per step, moving average

    def _kv_dtype(self) -> torch.dtype:
        model_dtype = self.model.dtype
        if self.config.kv_cache_dtype == "auto":
            return model_dtype
        if self.config.kv_cache_dtype == "float32":  # named, e.g. to keep a checkpoint's fp8 cache out
            if model_dtype != torch.float32:
                raise ValueError(f"kv_cache_dtype=float32 needs float32 activations (dtype='float32'); a "
                                 f"{str(model_dtype).removeprefix('torch.')} model's cache is auto or bfloat16")
            return torch.float32
        if self.config.kv_cache_dtype == "bfloat16":  # an fp32 model's KV at half the bytes (no scales)
            return torch.bfloat16
        if self.config.kv_cache_dtype == "fp8_e5m2":  # e5m2's range holds K and V unscaled: no calibration
            return torch.float8_e5m2
        if self.config.kv_scales == "dynamic":
            defer_kv_scales(self.model)
            return torch.float8_e4m3fn
        try:
            apply_kv_scales(self.model)
        except ValueError as e:
            raise ValueError(f"kv_cache_dtype={self.config.kv_cache_dtype} needs calibrated k/v scales in the "
                             f"checkpoint ({e}); make one with `quantize MODEL --calib data.jsonl --kv-cache fp8 ...`, "
                             "or choose uncalibrated scales explicitly with kv_scales='dynamic' (--kv-scales dynamic)"
                             ) from e
        return torch.float8_e4m3fn

    def _num_blocks_for_memory(self, kv_dtype: torch.dtype) -> int:
        args = self.model.args
        per_slot = KVCache.bytes_per_slot(args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype)
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.config.device.startswith("cuda"):
            gc.collect()  # an engine dropped before this one (the gate's noise-floor arm) frees its cache,
            torch.cuda.empty_cache()  # and the allocator gives it back, so it counts as free
            free, total = torch.cuda.mem_get_info(self.config.device)
            budget = cuda_kv_budget(total, free, self._weight_bytes, self._working_memory_bytes(),
                                    self.config.gpu_memory_utilization)
        elif budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // (per_slot * self.config.block_size)
        if num_blocks < 1:
            raise ValueError(f"a KV cache of {budget} bytes cannot hold one block of {self.config.block_size} tokens; "
                             "raise kv_cache_memory_bytes (on CUDA: gpu_memory_utilization)")
        return int(num_blocks)

    def _working_memory_bytes(self) -> int:
        """An estimate of a full prefill step's memory beyond weights and cache: fp32 logits and their
        log-softmax over the vocabulary for every row (score() computes them all) and the MLP's
        widest activations, for max_num_batched_tokens tokens."""
        args = self.model.args
        width = 4 * args.hidden_size + 3 * max(args.intermediate_size, args.expert_intermediate_size)
        element = resolve_dtype(self.config.dtype, self.config.device).itemsize
        return self.config.max_num_batched_tokens * (2 * 4 * args.vocab_size + element * width)

    # ---- requests in -------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.model.args.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.model.args.vocab_size})")
        return list(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, lora: str | None = None) -> str:
        """Validate and queue a request; every foreseeable mistake is a ValueError here, not later."""
        request_id = request_id if request_id is not None else f"req-{next(self._counter)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.submit(self.make_request(request_id, prompt, params, priority, lora))

    def add_lora(self, request: LoRARequest) -> None:
        """Load a LoRA adapter requests can then name (between steps: LLM, or AsyncEngine's thread)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True (serve --enable-lora or --lora-modules)")
        self.lora.add(request, self._adapters_in_use())

    def _adapters_in_use(self) -> frozenset[str]:
        """The adapters requests in flight hold (never evicted)."""
        return frozenset(s.sequences[0].request.lora for s in self.requests.values()) - {None}

    def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter no request in flight uses (between steps)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora)")
        if users := [s.request_id for s in self.requests.values() if s.sequences[0].request.lora == name]:
            raise ValueError(f"LoRA adapter {name!r} serves {len(users)} request(s) in flight; retry once they end")
        self.lora.remove(name)
        self.block_manager.forget_adapter(name)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     priority: int = 0, lora: str | None = None) -> _RequestState:
        """Tokenize and validate without touching engine state (safe from any thread). `lora` names
        a loaded adapter to serve the request with."""
        check_priority(priority, self.config.scheduling_policy)
        lora = lora if lora is not None else self.config.default_lora
        if lora is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {lora!r} asked for, but this engine serves none (enable_lora)")
        if lora is not None:
            self.lora.check(lora)
        if self.model.args.num_labels:
            self._check_classifier_request(params)
        prompt_ids = truncate_prompt(self.tokenize_prompt(prompt), params.truncate_prompt_tokens, self.max_model_len)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len")
        blocks_needed = -(-len(prompt_ids) // self.config.block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"the prompt needs {blocks_needed} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}; raise kv_cache_memory_bytes")
        params.check_vocabulary(self.model.args.vocab_size)
        params.check_logprobs(self.max_logprobs, self.model.args.vocab_size)
        stop_ids = list(params.stop_token_ids)
        # a structured output ends with its grammar, ignore_eos or not: the grammar then allows only
        # EOS, and a sequence going on past it would run unconstrained
        if not params.ignore_eos or params.structured_outputs is not None:  # EOS first: the sampler's way out
            stop_ids = [*self.eos_token_ids, *(t for t in stop_ids if t not in self.eos_token_ids)]
        seq_params = dataclasses.replace(params, stop_token_ids=stop_ids, eos_token_ids=list(self.eos_token_ids),
                                         **params.logprob_counts(self.model.args.vocab_size),
                                         max_tokens=params.output_budget(len(prompt_ids), self.max_model_len),
                                         bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        sequences = []
        for i in range(params.n):
            p = seq_params if params.seed is None or i == 0 else dataclasses.replace(seq_params, seed=params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            sequences.append(_SequenceState(Request(seq_id, prompt_ids, p, grammar=grammar, priority=priority,
                                                    lora=lora),
                                            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids),
                                            [] if params.logprobs is not None else None))
        return _RequestState(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params,
                             sequences, [None] * len(prompt_ids) if params.prompt_logprobs is not None else None)

    def _check_classifier_request(self, params: SamplingParams) -> None:
        """A sequence classifier has a score head and no LM head: it classifies its prompts, pooled at
        the last token, and nothing else."""
        if params.pooling is None:
            raise ValueError(f"this model ({self.hf_config['architectures'][0]}) is a sequence classifier: it "
                             "classifies and scores inputs (LLM.classify / LLM.score, POST /classify, /score, "
                             "/rerank) and does not generate text")
        if params.pooling != "last" or params.prompt_logprobs is not None:
            raise ValueError("a sequence classifier pools the last token and has no token logprobs")

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as it would appear at the start of the text and after a space."""
        variants = {tuple(self.tokenizer.encode(prefix + word.strip(), add_special_tokens=False))
                    for word in words for prefix in ("", " ")}
        return sorted(list(v) for v in variants if v)

    def submit(self, state: _RequestState) -> str:
        """Queue a request made by `make_request` (engine thread only)."""
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        first = state.sequences[0].request
        if first.lora is not None:
            if first.lora not in self.lora.paths:
                raise ValueError(f"LoRA adapter {first.lora!r} was unloaded")  # between make_request and now
            index = self.lora.resident_index(first.lora, self._adapters_in_use())
            for seq in state.sequences:
                seq.request.lora_index = index
        self.requests[state.request_id] = state
        for seq in state.sequences:
            self._seq_owner[seq.request.request_id] = state
            self.scheduler.add_request(seq.request)
        return state.request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its KV blocks; False if it is unknown or already done."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.sequences:
            self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
            self._release(seq.request.request_id)
        return True

    def withdraw_request(self, request_id: str) -> bool:
        """Forget a request the scheduler never admitted; False (and no change) once it started."""
        state = self.requests.get(request_id)
        if state is None or not self.scheduler.withdraw([s.request for s in state.sequences]):
            return False
        del self.requests[request_id]
        for seq in state.sequences:
            self._release(seq.request.request_id)
        return True

    def _release(self, seq_id: str) -> None:
        self._seq_owner.pop(seq_id, None)
        self._drafts_kept.pop(seq_id, None)
        self.runner.release(seq_id)

    # ---- the step ----------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, update; returns outputs of requests that changed."""
        if self.config.speculative_config is not None:
            self._propose_drafts()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out)
        self.scheduler.update_from_output(out, result.sampled)
        if result.pooled:  # an embedding request ends with its prompt
            for chunk in out.chunks:
                if chunk.request.request_id in result.pooled:
                    self.scheduler.finish(chunk.request, RequestStatus.FINISHED_STOPPED)
        return self._process(out, result)

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for each decoding sequence, never past its max_tokens or the context.

        A lone sequence gets num_speculative_tokens: its step is bound by reading the weights, and
        4 more query rows cost 1.4x one on the CPU. In a batch, rows cost compute, so each
        sequence gets one draft more than it has lately kept per step (a moving average).
        """
        spec = self.config.speculative_config
        running = self.scheduler.running
        if spec.disable_by_batch_size and len(running) > spec.disable_by_batch_size:
            return
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still in its prompt
            if self.runner.grammar_waits(request):
                continue  # a draft could carry the grammar's start, which verification would not see
            kept = self._drafts_kept.setdefault(request.request_id, float(spec.num_speculative_tokens))
            wanted = spec.num_speculative_tokens if len(running) == 1 else min(spec.num_speculative_tokens, int(kept) + 1)
            room = min(wanted, request.params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens)
            request.spec_token_ids = propose_ngram(request.all_token_ids, room, spec.prompt_lookup_min,
                                                   spec.prompt_lookup_max)

    def _process(self, out, result) -> list[RequestOutput]:
        touched: dict[str, _RequestState] = {}
        for chunk in out.chunks:
            req = chunk.request
            state = self._seq_owner.get(req.request_id)
            if state is None:
                continue
            self.num_prompt_tokens_computed += max(0, min(chunk.start + chunk.num_tokens, req.num_prompt_tokens)
                                                   - chunk.start)
            if req.request_id in result.prompt_logprobs:
                first, entries = result.prompt_logprobs[req.request_id]
                if state.prompt_logprobs is not None and req is state.sequences[0].request:
                    state.prompt_logprobs[first:first + len(entries)] = entries
            if req.request_id in result.pooled:
                state.embedding = result.pooled[req.request_id]
                state.sequences[0].finish_reason = "stop"
                touched[state.request_id] = state
                continue
            tokens = result.sampled.get(req.request_id)
            if tokens is None:
                continue
            if chunk.draft_token_ids:
                self.num_draft_tokens += len(chunk.draft_token_ids)
                self.num_accepted_draft_tokens += len(tokens) - 1
                self._drafts_kept[req.request_id] = (self._drafts_kept[req.request_id] + len(tokens) - 1) / 2
            seq = next(s for s in state.sequences if s.request is req)
            first_output = req.num_output_tokens - len(tokens)  # the scheduler appended them all
            for i, token in enumerate(tokens):
                if seq.logprobs is not None:
                    seq.logprobs.append(entry := result.logprobs[req.request_id][i])
                    seq.cumulative_logprob += entry[token]
                if self._append_text(seq, token, first_output + i + 1, i == len(tokens) - 1):
                    req.truncate_output(first_output + i + 1)  # a stop string ended it before the drafts did
                    break
            self.num_generation_tokens += len(seq.request.output_token_ids) - first_output
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            output = state.to_output()
            outputs.append(output)
            if output.finished:
                del self.requests[state.request_id]
                for seq in state.sequences:
                    self._release(seq.request.request_id)
        return outputs

    def _append_text(self, seq: _SequenceState, token: int, num_output: int, last: bool) -> bool:
        """Detokenize the sequence's output token number `num_output`; True if it ends the sequence.

        Only the step's `last` token can be one the scheduler finished the sequence at (EOS,
        length); a stop string can end it at any token.
        """
        req = seq.request
        finished = last and req.status.is_finished
        # the token that stopped the sequence (EOS, a stop_token_id) is not text, even where
        # skip_special_tokens=False shows special tokens (vLLM's rule)
        stopped_by_token = finished and req.status == RequestStatus.FINISHED_STOPPED
        ended_by_eos = not req.params.ignore_eos or req.params.structured_outputs is not None  # a grammar's end too
        if stopped_by_token and token == self.tokenizer.eos_token_id and ended_by_eos:
            req.stop_reason = None  # vLLM names only a stop_token_id, not the model's end of sequence
        shown = req.params.detokenize and (req.params.include_stop_str_in_output or not stopped_by_token)
        new_text = seq.detok.append(token) if shown else ""
        stops = req.params.stop
        # a stop string the length limit's last token completes still stops it (and is cut); as a stop
        # token, one can end the output from the token after the first min_tokens (vLLM's rule)
        if stops and new_text and not stopped_by_token and num_output > req.params.min_tokens:
            hit = find_stop(seq.detok.text, len(new_text), stops)
            if hit is not None:
                idx, stop = hit
                seq.detok.text = seq.detok.text[: idx + len(stop) if req.params.include_stop_str_in_output else idx]
                req.stop_reason = stop
                if finished:
                    req.status = RequestStatus.FINISHED_STOPPED  # already finished (blocks freed) at its length
                else:
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                finished = True
        if finished:
            seq.finish_reason = "length" if req.status == RequestStatus.FINISHED_LENGTH else "stop"
        return finished

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Full next-token log-probabilities [T, vocab] (fp32) of one sequence, row t after tokens[:t+1]."""
        return torch.cat(list(self.score_chunks(token_ids)))

    def score_chunks(self, token_ids: list[int]) -> Iterator[torch.Tensor]:
        """`score`'s rows a prefill chunk at a time ([n, vocab] each, in order), so a caller comparing
        two engines over a long sequence holds one chunk of each, not two [T, vocab] tensors.

        Goes through the paged KV cache in chunks of max_num_batched_tokens, so an fp8 cache and
        chunking are exercised exactly as in serving. Only while no request is running, one
        sequence at a time (checked when the first chunk is asked for).
        """
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        if self._scoring:
            raise RuntimeError("score() takes one sequence at a time: finish the other one first")
        token_ids = self.tokenize_prompt(token_ids)
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"score() takes 1..{self.max_model_len} tokens, got {len(token_ids)}")
        lora = self.config.default_lora
        request = Request("__score__", token_ids, SamplingParams(temperature=0.0), lora=lora,
                          lora_index=None if lora is None else self.lora.resident_index(lora, frozenset()))
        self._scoring = True
        try:
            budget = self.config.max_num_batched_tokens
            for start in range(0, len(token_ids), budget):
                n = min(budget, len(token_ids) - start)
                if not self.block_manager.allocate(request, n):
                    raise ValueError(f"{len(token_ids)} tokens do not fit in the KV cache")
                with torch.inference_mode():
                    hidden = self.runner.forward([ScheduledChunk(request, start, n)])
                    rows = self.model.compute_logits(hidden).log_softmax(dim=-1)
                request.num_computed_tokens = start + n
                yield rows
        finally:
            self.block_manager.free(request)
            self.runner.release(request.request_id)
            self._scoring = False

    def stats(self) -> EngineStats:
        """A snapshot (AsyncEngine takes one after every step: keep it cheap)."""
        bm = self.block_manager
        loras = {} if self.lora is None else {  # walks the queues: only where adapters are served
            "running_loras": _adapter_names(self.scheduler.running),
            "waiting_loras": _adapter_names(self.scheduler.waiting),
            "max_loras": self.lora.max_resident or len(self.lora.paths)}
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_blocks - bm.num_free_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_free_blocks,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            **loras,
        )


def cuda_kv_budget(total: int, free: int, weight_bytes: int, working_bytes: int, utilization: float) -> int:
    """Bytes for the KV cache on a GPU, as vLLM's gpu_memory_utilization: this engine may hold
    `utilization` of the device's `total` memory (its weights and working memory included), and
    never more than is `free` now, after what other engines and processes hold."""
    return max(0, min(int(utilization * total) - weight_bytes, free) - working_bytes)


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora for r in requests if r.lora is not None}))

