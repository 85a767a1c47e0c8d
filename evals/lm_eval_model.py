"""lm-eval model over the in-process engine, registered as `driftgate`.

In process rather than over HTTP so the gate scores exact token ids with exact prompt
logprobs. Scoring requests are ordered so that the choices of one multiple-choice item
(same context, different endings) run back to back and the engine's prefix cache serves
the shared context; the prefill tokens this saves are read from the engine's stats.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import lm_eval.models  # noqa: F401  -- registers lm-eval's own models too, so `local-completions` resolves
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from engine import LLM, SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """What lm-eval's string API drops but drift metrics need, per generated request."""

    token_ids: tuple[int, ...]
    finish_reason: str | None
    hit_max_tokens: bool


def _truncate_left(tokens: list[int], max_len: int) -> list[int]:
    return tokens[-max_len:] if len(tokens) > max_len else tokens


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Cut at the earliest stop string (the engine stops there too; this makes it certain)."""
    cut = len(text)
    for stop in stops:
        if stop and (pos := text.find(stop)) != -1:
            cut = min(cut, pos)
    return text[:cut]


def prefill_first(llm: LLM, prompts: Sequence[list[int]]) -> None:
    """Prefill the first prompt alone, so prompts sharing its prefix (few-shot exemplars) hit the cache.

    Prompts admitted in one step all compute their shared prefix; once one of them is
    cached, the rest reuse it. Costs one extra sampled token when nothing is shared.
    """
    if len(prompts) > 1:
        llm.generate(list(prompts[:1]), SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


log = logging.getLogger(__name__)


def _device(asked: str | None) -> str:
    """lm-eval's --device for our engine: its CLI asks for cuda:0 by default, which on a machine
    without CUDA means the CPU (as lm-eval's own HF model falls back, with a warning)."""
    if asked is None:
        return "auto"
    if asked.startswith("cuda") and not torch.cuda.is_available():
        log.warning("lm-eval asked for device %s, but torch sees no CUDA device: running on the CPU", asked)
        return "cpu"
    return asked


@register_model("driftgate")
class DriftgateLM(TemplateLM):
    """TemplateLM whose three request types map onto `LLM.generate`.

    Args:
        pretrained: model directory (ignored when `llm` is given).
        llm: an already built engine, so one engine can serve several evaluations.
        batch_size: requests handed to the engine per `generate` call (the engine batches
            internally; this only bounds memory for outputs and drives the progress bar).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        llm: LLM | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        batch_size: int | str | None = 256,
        max_batch_size: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__()
        if llm is None:
            if pretrained is None:
                raise ValueError("driftgate model needs pretrained=MODEL_DIR or an llm instance")
            llm = LLM(
                pretrained,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                device=_device(device),
            )
        self.llm = llm
        self.tokenizer = llm.tokenizer
        # "auto" (lm-eval's batch-size search) means nothing for an engine that batches itself.
        self.chunk_size = int(batch_size) if isinstance(batch_size, int) or str(batch_size).isdigit() else 256
        self.max_length = llm.engine.max_model_len
        # Scoring runs a prompt and samples one token, so a scored sequence leaves one slot free.
        self.max_score_len = self.max_length - 1
        self.generations: dict[str, GenerationRecord] = {}  # context text -> last generation for it

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- scoring -------------------------------------------------------------------------

    def score_sequences(
        self, sequences: Sequence[tuple[list[int], int]], *, desc: str = "scoring", disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """Sum of logprobs of each sequence's last `num_scored` tokens, and whether greedy.

        Args:
            sequences: (token_ids, num_scored) pairs; the scored tokens are the tail, and at
                least one token must precede them.
        """
        # Group identical prefixes: sort by the full token tuple so an item's choices (same
        # context) are adjacent and reach the engine together.
        order = sorted(range(len(sequences)), key=lambda i: sequences[i][0])
        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        bar = tqdm(total=len(sequences), desc=desc, disable=disable_tqdm)
        for start in range(0, len(order), self.chunk_size):
            chunk = order[start : start + self.chunk_size]
            # Leaders (the first sequence of each distinct context) run first, so when the
            # other choices of the same item are admitted their context is already cached.
            seen: set[tuple[int, ...]] = set()
            leaders, followers = [], []
            for i in chunk:
                tokens, num_scored = sequences[i]
                context = tuple(tokens[: len(tokens) - num_scored])
                (followers if context in seen else leaders).append(i)
                seen.add(context)
            for wave in (leaders, followers):
                if not wave:
                    continue
                # Only the scored tail needs logprobs, so a cached context is reused, not recomputed.
                params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                         prompt_logprobs_start=len(sequences[i][0]) - sequences[i][1]) for i in wave]
                outputs = self.llm.generate([sequences[i][0] for i in wave], params, use_tqdm=False)
                for i, out in zip(wave, outputs, strict=True):
                    tokens, num_scored = sequences[i]
                    results[i] = self._sum_tail_logprobs(out.prompt_logprobs, tokens, num_scored)
                bar.update(len(wave))
        bar.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _sum_tail_logprobs(
        prompt_logprobs: Sequence[dict[int, float] | None], tokens: Sequence[int], num_scored: int
    ) -> tuple[float, bool]:
        if num_scored < 1 or num_scored >= len(tokens):
            raise ValueError(f"cannot score {num_scored} of {len(tokens)} tokens (need one token of context)")
        total, is_greedy = 0.0, True
        for pos in range(len(tokens) - num_scored, len(tokens)):
            dist = prompt_logprobs[pos]  # logprobs of the token at `pos` given tokens[:pos]
            logprob = dist[tokens[pos]]
            total += logprob
            is_greedy = is_greedy and logprob >= max(dist.values())
        return total, is_greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        sequences = []
        for _, context_enc, continuation_enc in requests:
            tokens = _truncate_left(context_enc + continuation_enc, self.max_score_len)
            sequences.append((tokens, min(len(continuation_enc), len(tokens) - 1)))
        results = self.score_sequences(sequences, desc="loglikelihood", disable_tqdm=disable_tqdm)
        for (pair, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], int]] = []
        owner: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_score_len - 1,  # a disjoint window adds its one context token
                context_len=1,
            )
            for context, predicted in map(make_disjoint_window, rolling):
                windows.append((context + predicted, len(predicted)))
                owner.append(index)
        scores = self.score_sequences(windows, desc="loglikelihood_rolling", disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores, strict=True):
            totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for indices in groups.values():
            gen_kwargs = dict(requests[indices[0]].args[1])
            params, stops = self._sampling_params(gen_kwargs)
            for start in range(0, len(indices), self.chunk_size):
                chunk = indices[start : start + self.chunk_size]
                prompts = [
                    _truncate_left(self.tok_encode(requests[i].args[0]), self.max_length - params.max_tokens)
                    for i in chunk
                ]
                prefill_first(self.llm, prompts)
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
                for i, out in zip(chunk, outputs, strict=True):
                    completion = out.outputs[0]
                    text = _cut_at_stop(completion.text, stops)
                    results[i] = text
                    self.generations[requests[i].args[0]] = GenerationRecord(
                        token_ids=tuple(completion.token_ids),
                        finish_reason=completion.finish_reason,
                        hit_max_tokens=completion.finish_reason == "length",
                    )
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results

    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        until = gen_kwargs.pop("until", None) or []
        stops = [until] if isinstance(until, str) else list(until)
        eos_text = self.tok_decode([self.eot_token_id])
        if eos_text not in stops:
            stops.append(eos_text)
        max_tokens = int(gen_kwargs.pop("max_gen_toks", 256))
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=float(gen_kwargs.pop("top_p", 1.0)),
            stop=stops,
            seed=gen_kwargs.pop("seed", None),
        )
        return params, stops
