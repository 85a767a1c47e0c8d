"""Drift metrics between a baseline and a candidate that saw identical inputs.

Tier 0 compares full next-token distributions on the same token sequences (teacher
forcing, no sampling noise). Tier 1 joins per-item lm-eval results and turns them into
paired statistics. Tier 2 compares greedy generations token by token. Everything here is
computation on results; running the engines is the gate's job.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from evals import stats

# token_parity works through rows in chunks of about this many values: the float64 temporaries of a
# whole [8192, 49k] pair at once took over 20 GB
PARITY_CHUNK_VALUES = 1 << 25
# Token positions where KV-cache drift shows: it grows with how much cache a token attends to.
POSITION_BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 256), (256, 1024), (1024, 4096), (4096, None))
# Tier 0's intervals resample runs of this many consecutive positions (a bucket bound is a multiple
# of it, so no run spans two buckets): a token's KL is correlated with its neighbours'.
BOOTSTRAP_BLOCK_TOKENS = 64

# token ids [T] -> the next-token log-probabilities of consecutive positions, a chunk at a time:
# [rows, vocab] each (row t of the whole is the distribution after tokens[: t + 1]), with the residual
# stream after every decoder layer [layers, rows, hidden] when the engine reports it (it locates
# drift), else None. Chunks keep memory flat: a whole [T, vocab] pair is gigabytes at long context.
ScoreChunks = Callable[[Sequence[int]], Iterable[tuple[torch.Tensor, torch.Tensor | None]]]


def bucket_name(bucket: tuple[int, int | None]) -> str:
    low, high = bucket
    return f"{low}+" if high is None else f"{low}-{high}"


# ---------------------------------------------------------------------------------------
# Tier 0: logit parity


@dataclass(frozen=True, slots=True)
class ParityStats:
    """Per-token agreement of two distributions over one set of positions."""

    num_tokens: int
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    nll_delta_mean: float  # candidate NLL minus baseline NLL of the actual next token (nats)


@dataclass(frozen=True, slots=True)
class LayerDrift:
    """Where inside the network the candidate's hidden states part from the baseline's.

    Logit KL says that an output drifted; this says which layer put the drift there: a
    damaged or badly quantized layer shows as one large step, where its inputs still agree.
    """

    relative_drift: tuple[float, ...]  # per decoder layer: mean over tokens of |h_c - h_b| / |h_b|
    largest_step_layer: int | None  # the layer that adds the most drift to what it received; None: no drift

    @property
    def steps(self) -> tuple[float, ...]:
        return _drift_steps(self.relative_drift)

    @classmethod
    def from_drift(cls, relative_drift: Sequence[float]) -> LayerDrift:
        drift = tuple(float(d) for d in relative_drift)
        steps = _drift_steps(drift)
        return cls(relative_drift=drift, largest_step_layer=int(np.argmax(steps)) if max(steps) > 0 else None)


def _drift_steps(drift: tuple[float, ...]) -> tuple[float, ...]:
    """Drift each layer adds: its drift minus the previous layer's (the first counts from 0)."""
    return tuple(b - a for a, b in zip((0.0, *drift[:-1]), drift, strict=True))


@dataclass(frozen=True, slots=True)
class LogitParity:
    overall: ParityStats
    by_position: dict[str, ParityStats]  # bucket name -> stats; empty buckets left out
    by_layer: LayerDrift | None = None  # when both arms report their layer states
    # block-bootstrap intervals of the figures the gate checks: kl_mean, kl_p99,
    # top1_agreement (overall) and kl_growth (when two buckets are populated)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class _TokenArrays:
    kl: list[np.ndarray] = field(default_factory=list)
    top1_equal: list[np.ndarray] = field(default_factory=list)
    nll_delta: list[np.ndarray] = field(default_factory=list)

    def summarize(self) -> ParityStats:
        kl = np.concatenate(self.kl)
        nll = np.concatenate(self.nll_delta) if self.nll_delta else np.zeros(0)
        return ParityStats(
            num_tokens=int(kl.size),
            kl_mean=float(kl.mean()),
            kl_p99=_p99(kl),
            top1_agreement=float(np.concatenate(self.top1_equal).mean()),
            nll_delta_mean=float(nll.mean()) if nll.size else 0.0,
        )


def token_parity(
    base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor, next_tokens: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position KL(base || cand), top-1 equality, and NLL change of the next token.

    Computed where the rows are (a GPU's stay there); only the per-position results come back.

    Args:
        base_logprobs, cand_logprobs: [T, vocab] log-probabilities (re-normalized here).
        next_tokens: the tokens that follow positions 0, 1, ... (T of them, or T - 1 when the
            last row ends the sequence).
    """
    step = max(1, PARITY_CHUNK_VALUES // base_logprobs.shape[-1])
    next_tokens = next_tokens.to(base_logprobs.device)
    kl, top1_equal, nll_delta = [], [], []
    for start in range(0, base_logprobs.shape[0], step):
        base = torch.log_softmax(base_logprobs[start:start + step].double(), dim=-1)  # [rows, V]
        cand = torch.log_softmax(cand_logprobs[start:start + step].double(), dim=-1)
        kl.append((base.exp() * (base - cand)).sum(dim=-1).clamp_min(0.0))
        top1_equal.append(base.argmax(dim=-1) == cand.argmax(dim=-1))
        following = next_tokens[start:start + step]
        rows = torch.arange(following.numel(), device=base.device)
        nll_delta.append(base[rows, following] - cand[rows, following])
    return tuple(torch.cat(parts).cpu().numpy() for parts in (kl, top1_equal, nll_delta))


def layer_drift_sums(base_states: torch.Tensor, cand_states: torch.Tensor) -> np.ndarray:
    """Per layer, the sum over tokens of |h_c - h_b| / |h_b| (states [layers, T, hidden])."""
    base, cand = base_states.double(), cand_states.double()
    ratio = (cand - base).norm(dim=-1) / base.norm(dim=-1).clamp_min(1e-12)  # [layers, T]
    return ratio.sum(dim=-1).cpu().numpy()


_Chunk = tuple[torch.Tensor, torch.Tensor | None]


def _split(chunk: _Chunk, rows: int) -> tuple[_Chunk, _Chunk | None]:
    """A chunk's first `rows` rows, and the rest (None when nothing is left)."""
    logprobs, states = chunk
    head = (logprobs[:rows], None if states is None else states[:, :rows])
    if rows == logprobs.shape[0]:
        return head, None
    return head, (logprobs[rows:], None if states is None else states[:, rows:])


def in_lockstep(base_chunks: Iterable[_Chunk], cand_chunks: Iterable[_Chunk]) -> Iterator[tuple[_Chunk, _Chunk]]:
    """Two arms' chunk streams as pairs of equally long spans of the same positions (the arms may
    chunk differently: one engine's token budget need not be the other's)."""
    base_iter, cand_iter = iter(base_chunks), iter(cand_chunks)
    base = cand = None
    try:
        while True:
            base = next(base_iter, None) if base is None else base
            cand = next(cand_iter, None) if cand is None else cand
            if base is None or cand is None:
                if base is not None or cand is not None:
                    raise ValueError("the arms scored different numbers of positions")
                return
            rows = min(base[0].shape[0], cand[0].shape[0])
            (base_head, base), (cand_head, cand) = _split(base, rows), _split(cand, rows)
            yield base_head, cand_head
    finally:  # an arm left half-way (an error) gives its KV blocks back now, not when collected
        for stream in (base_iter, cand_iter):
            if isinstance(stream, Generator):
                stream.close()


@dataclass(slots=True)
class _LayerDriftSums:
    """Per-layer drift summed over the tokens seen, while every span came with both arms' states."""

    sums: np.ndarray | None = None
    tokens: int = 0
    comparable: bool = True

    def add(self, base_states: torch.Tensor | None, cand_states: torch.Tensor | None) -> None:
        if base_states is None or cand_states is None or base_states.shape != cand_states.shape:
            self.comparable = False
        if not self.comparable:
            return
        sums = layer_drift_sums(base_states, cand_states.to(base_states.device))
        self.sums = sums if self.sums is None else self.sums + sums
        self.tokens += base_states.shape[1]

    def result(self) -> LayerDrift | None:
        return LayerDrift.from_drift(self.sums / self.tokens) if self.comparable and self.sums is not None else None


class NonFiniteLogitsError(FloatingPointError):
    """An arm's logits were NaN or infinite: no drift can be measured, and the checkpoint is broken."""


def _sequence_parity(tokens: Sequence[int], spans: Iterable[tuple[_Chunk, _Chunk]],
                     layers: _LayerDriftSums) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """token_parity over one sequence's spans: per-position KL, top-1 equality, NLL change (NaN at
    the last position, which has no next token)."""
    following = torch.as_tensor(tokens[1:], dtype=torch.long)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    position = 0
    for (base, base_states), (cand, cand_states) in spans:
        if base.shape != cand.shape:
            raise ValueError(f"arms returned shapes {tuple(base.shape)} and {tuple(cand.shape)} for the same rows")
        for arm, rows in (("baseline", base), ("candidate", cand)):
            # a NaN anywhere, or a row with no finite entry, is no distribution (-inf alone is a banned token)
            if torch.isnan(rows).any() or not torch.isfinite(rows).any(-1).all():
                raise NonFiniteLogitsError(f"the {arm} gave NaN or infinite logits in a Tier 0 sequence")
        layers.add(base_states, cand_states)
        rows = base.shape[0]
        parts.append(token_parity(base, cand.to(base.device), following[position:position + rows]))
        position += rows
    if position != len(tokens):
        raise ValueError(f"arms scored {position} positions of a {len(tokens)}-token sequence")
    kl, top1, nll = (np.concatenate(column) for column in zip(*parts, strict=True))
    return kl, top1, np.append(nll, np.nan)


def logit_parity(sequences: Iterable[Sequence[int]], baseline: ScoreChunks, candidate: ScoreChunks, *,
                 interval_level: float = 0.9, num_resamples: int = 1000, seed: int = 0) -> LogitParity:
    """Score each sequence with both arms, a chunk of each at a time, and summarize, overall and by
    position bucket, with two-sided `interval_level` bootstrap intervals of the checked figures.

    When both arms also return layer states the result says, per layer, how far the hidden
    states drifted, and which layer added the most.
    """
    overall = _TokenArrays()
    buckets = {bucket: _TokenArrays() for bucket in POSITION_BUCKETS}
    layers = _LayerDriftSums()
    for tokens in sequences:
        with contextlib.closing(in_lockstep(baseline(tokens), candidate(tokens))) as spans:
            kl, top1, nll = _sequence_parity(tokens, spans, layers)
        for arrays, sl in [(overall, slice(None))] + [
            (buckets[b], slice(b[0], b[1])) for b in POSITION_BUCKETS
        ]:
            part_kl = kl[sl]
            if part_kl.size == 0:
                continue
            arrays.kl.append(part_kl)
            arrays.top1_equal.append(top1[sl])
            part_nll = nll[sl]
            arrays.nll_delta.append(part_nll[~np.isnan(part_nll)])
    if not overall.kl:
        raise ValueError("no tokens to compare")
    populated = [a for a in buckets.values() if a.kl]
    return LogitParity(
        overall=overall.summarize(),
        by_position={bucket_name(b): a.summarize() for b, a in buckets.items() if a.kl},
        by_layer=layers.result(),
        intervals=_parity_intervals(overall, populated[0], populated[-1] if len(populated) > 1 else None,
                                    confidence=interval_level, num_resamples=num_resamples, seed=seed),
    )


def _blocks(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [part[i:i + BOOTSTRAP_BLOCK_TOKENS] for part in parts for i in range(0, part.size, BOOTSTRAP_BLOCK_TOKENS)]


def _p99(kl: np.ndarray) -> float:
    return float(np.quantile(kl, 0.99))


def _parity_intervals(overall: _TokenArrays, first: _TokenArrays, last: _TokenArrays | None,
                      **bootstrap) -> dict[str, tuple[float, float]]:
    """How far each checked Tier 0 figure would move had other stretches of text been scored."""
    kl = _blocks(overall.kl)
    intervals = {
        "kl_mean": stats.block_bootstrap_interval([kl], np.mean, **bootstrap),
        "kl_p99": stats.block_bootstrap_interval([kl], _p99, **bootstrap),
        "top1_agreement": stats.block_bootstrap_interval([_blocks(overall.top1_equal)], np.mean, **bootstrap),
    }
    if last is not None:
        intervals["kl_growth"] = stats.block_bootstrap_interval(
            [_blocks(first.kl), _blocks(last.kl)], lambda a, b: _growth(_p99(a), _p99(b)), **bootstrap)
    return intervals


# ---------------------------------------------------------------------------------------
# Tier 1: paired per-item task results


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One arm's outcome on one item, extracted from an lm-eval sample."""

    doc_id: int
    prompt_hash: str
    correct: bool
    choice_scores: tuple[float, ...] | None = None  # decision scores per choice (MC; see items_from_samples)
    choice_logprobs: tuple[float, ...] | None = None  # raw summed logprobs per choice (MC)
    answer: str = ""  # chosen choice index or extracted answer
    response: str = ""  # raw generation (generative tasks)
    is_invalid: bool = False  # the extraction found nothing
    hit_max_tokens: bool = False


INVALID_ANSWER = "[invalid]"  # what lm-eval's regex filter yields when nothing matches


def items_from_samples(
    samples: Iterable[dict], metric: str, runaway_contexts: frozenset[str] = frozenset(),
    target_delimiter: str = " ",
) -> dict[int, ItemResult]:
    """Per-item results for one task and one `metric,filter` key (e.g. "acc_norm,none").

    Args:
        runaway_contexts: prompts whose generation stopped at the token limit (lm-eval's
            string API does not carry finish reasons, so the adapter reports them).
        target_delimiter: the task's delimiter, which lm-eval puts before each scored choice
            but leaves out of the length acc_norm divides by.
    """
    name, _, filter_name = metric.partition(",")
    filter_name = filter_name or "none"
    items: dict[int, ItemResult] = {}
    for sample in samples:
        if sample.get("filter", "none") != filter_name:
            continue
        if name not in sample:
            raise KeyError(f"metric {name!r} not in sample of doc {sample['doc_id']} (has {sample.get('metrics')})")
        doc_id = int(sample["doc_id"])
        resps = sample["filtered_resps"]
        if resps and isinstance(resps[0], list | tuple):  # multiple choice: [(logprob, is_greedy), ...]
            logprobs = tuple(float(r[0]) for r in resps)
            scores = logprobs
            if name == "acc_norm":  # lm-eval divides by the choice's character length, delimiter excluded
                lengths = [len(arg[1].removeprefix(target_delimiter)) for arg in sample["arguments"]]
                # ... here then times the choices' mean length: the same ordering, on the scale of a
                # whole choice's log-likelihood, so a softmax margin over them (how sure the baseline
                # was) means what it does for acc; per character, nearly every item looked unsure
                mean_length = sum(lengths) / len(lengths)
                scores = tuple(lp / n * mean_length for lp, n in zip(logprobs, lengths, strict=True))
            # a NaN score is no answer (lm-eval's argmax would take it as choice 0, right where that is gold)
            finite = all(math.isfinite(score) for score in scores)
            items[doc_id] = ItemResult(
                doc_id=doc_id,
                prompt_hash=sample["prompt_hash"],
                correct=bool(sample[name]) and finite,
                choice_scores=scores,
                choice_logprobs=logprobs,
                answer=str(int(np.argmax(scores))) if finite else INVALID_ANSWER,
                is_invalid=not finite,
            )
        else:
            answer = str(resps[0]) if resps else INVALID_ANSWER
            raw = sample["resps"][0][0] if sample["resps"] and sample["resps"][0] else ""
            items[doc_id] = ItemResult(
                doc_id=doc_id,
                prompt_hash=sample["prompt_hash"],
                correct=bool(sample[name]),
                answer=answer,
                response=str(raw),
                is_invalid=answer == INVALID_ANSWER,
                hit_max_tokens=sample["arguments"][0][0] in runaway_contexts,
            )
    return items


def softmax(scores: Sequence[float]) -> np.ndarray:
    x = np.asarray(scores, dtype=np.float64)
    x = np.exp(x - x.max())
    return x / x.sum()


def top_margin(scores: Sequence[float]) -> float:
    """Top-1 minus top-2 probability after a softmax over the choices' scores."""
    probs = np.sort(softmax(scores))[::-1]
    return float(probs[0] - probs[1]) if probs.size > 1 else 1.0


def choice_kl(base_logprobs: Sequence[float], cand_logprobs: Sequence[float]) -> float:
    """KL between the two arms' distributions over the answer choices."""
    p, q = softmax(base_logprobs), softmax(cand_logprobs)
    return float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))


class PromptMismatchError(ValueError):
    """The two arms did not see identical items and prompts; nothing paired can be claimed."""


@dataclass(frozen=True, slots=True)
class FlippedItem:
    doc_id: int
    baseline_answer: str
    candidate_answer: str
    baseline_margin: float | None
    baseline_response: str
    candidate_response: str


@dataclass(frozen=True, slots=True)
class TaskComparison:
    """Everything Tier 1 says about one task (or the pooled endpoint)."""

    task: str
    metric: str
    table: stats.PairedTable
    delta_interval: tuple[float, float]  # Newcombe, at the gate's two-sided level
    bootstrap_interval: tuple[float, float]
    mcnemar_p: float
    mcnemar_drop_p: float  # one-sided, "candidate worse"
    min_detectable_drop: float
    num_confident_items: int
    num_confident_flips: int  # right -> wrong among items the baseline was confident on
    choice_kl_mean: float | None
    choice_kl_p95: float | None
    answer_change_rate: float
    baseline_invalid_rate: float
    candidate_invalid_rate: float
    baseline_max_tokens_rate: float
    candidate_max_tokens_rate: float
    worst_flips: tuple[FlippedItem, ...]

    @property
    def drop_upper_bound(self) -> float:
        """One-sided upper confidence bound of the accuracy drop (baseline - candidate)."""
        return -self.delta_interval[0]


def compare_items(
    task: str,
    metric: str,
    baseline: dict[int, ItemResult],
    candidate: dict[int, ItemResult],
    *,
    confidence: float = 0.95,
    confident_margin: float = 0.2,
    num_resamples: int = 2000,
    seed: int = 0,
    num_worst: int = 20,
    strata: dict[int, str] | None = None,
) -> TaskComparison:
    """Join two arms on doc id (prompts must match) and compute the paired statistics.

    `confidence` is one-sided: the interval is two-sided at 1 - 2 * (1 - confidence), so
    its lower end is the one-sided bound the decision uses.
    """
    if baseline.keys() != candidate.keys():
        only = sorted(baseline.keys() ^ candidate.keys())[:10]
        raise PromptMismatchError(f"{task}: arms scored different items (e.g. doc ids {only})")
    doc_ids = sorted(baseline)
    mismatched = [d for d in doc_ids if baseline[d].prompt_hash != candidate[d].prompt_hash]
    if mismatched:
        raise PromptMismatchError(f"{task}: prompt hashes differ for {len(mismatched)} items (e.g. {mismatched[:10]})")
    if not doc_ids:
        raise ValueError(f"{task}: no items")
    base = [baseline[d] for d in doc_ids]
    cand = [candidate[d] for d in doc_ids]
    base_correct = np.array([b.correct for b in base])
    cand_correct = np.array([c.correct for c in cand])
    table = stats.PairedTable.from_outcomes(base_correct, cand_correct)
    two_sided = stats.two_sided_level(confidence)
    margins = [top_margin(b.choice_scores) if b.choice_scores else None for b in base]
    confident = np.array([m is not None and m > confident_margin for m in margins])
    right_to_wrong = base_correct & ~cand_correct
    kls = [choice_kl(b.choice_logprobs, c.choice_logprobs) for b, c in zip(base, cand, strict=True)
           if b.choice_logprobs and c.choice_logprobs]
    flips = [int(i) for i in np.flatnonzero(right_to_wrong)]
    flips.sort(key=lambda i: -(margins[i] or 0.0))
    worst = tuple(
        FlippedItem(
            doc_id=base[i].doc_id,
            baseline_answer=base[i].answer,
            candidate_answer=cand[i].answer,
            baseline_margin=margins[i],
            baseline_response=base[i].response,
            candidate_response=cand[i].response,
        )
        for i in flips[:num_worst]
    )
    n = len(doc_ids)
    return TaskComparison(
        task=task,
        metric=metric,
        table=table,
        delta_interval=stats.newcombe_paired_interval(table, two_sided),
        bootstrap_interval=stats.paired_bootstrap_interval(
            base_correct, cand_correct, confidence=two_sided, num_resamples=num_resamples, seed=seed,
            strata=[strata[d] for d in doc_ids] if strata else None,
        ) if n >= 2 else (table.delta, table.delta),
        mcnemar_p=stats.mcnemar_exact_p(table.num_right_to_wrong, table.num_wrong_to_right),
        mcnemar_drop_p=stats.mcnemar_one_sided_drop_p(table.num_right_to_wrong, table.num_wrong_to_right),
        # Power at the upper Wilson bound of the flip rate: with few or no observed flips the
        # point rate would claim a resolution the run does not have.
        min_detectable_drop=stats.min_detectable_drop(
            n, stats.wilson_interval(table.num_flips, n, two_sided)[1], alpha=1 - confidence),
        num_confident_items=int(confident.sum()),
        num_confident_flips=int((confident & right_to_wrong).sum()),
        choice_kl_mean=float(np.mean(kls)) if kls else None,
        choice_kl_p95=float(np.quantile(kls, 0.95)) if kls else None,
        answer_change_rate=sum(b.answer != c.answer for b, c in zip(base, cand, strict=True)) / n,
        baseline_invalid_rate=sum(b.is_invalid for b in base) / n,
        candidate_invalid_rate=sum(c.is_invalid for c in cand) / n,
        baseline_max_tokens_rate=sum(b.hit_max_tokens for b in base) / n,
        candidate_max_tokens_rate=sum(c.hit_max_tokens for c in cand) / n,
        worst_flips=worst,
    )


def pool_items(per_task: dict[str, dict[int, ItemResult]]) -> tuple[dict[int, ItemResult], dict[int, str]]:
    """Merge several tasks' items into one endpoint with fresh ids and a task label per id."""
    pooled: dict[int, ItemResult] = {}
    strata: dict[int, str] = {}
    for task in sorted(per_task):
        for doc_id in sorted(per_task[task]):
            new_id = len(pooled)
            item = per_task[task][doc_id]
            pooled[new_id] = ItemResult(**{**_as_dict(item), "doc_id": new_id})
            strata[new_id] = task
    return pooled, strata


def _as_dict(item: ItemResult) -> dict:
    return {name: getattr(item, name) for name in ItemResult.__slots__}


# ---------------------------------------------------------------------------------------
# Tier 2: greedy generations


def first_divergence(base_tokens: Sequence[int], cand_tokens: Sequence[int]) -> int | None:
    """Index of the first generated token that differs (the shorter one's length where one is a
    prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(base_tokens, cand_tokens, strict=False)):
        if a != b:
            return i
    if len(base_tokens) != len(cand_tokens):
        return min(len(base_tokens), len(cand_tokens))
    return None


@dataclass(frozen=True, slots=True)
class GenerationAgreement:
    num_prompts: int
    num_identical: int
    divergence_positions: tuple[int, ...]  # one per diverging prompt
    mean_agreed_prefix: float  # tokens, counting identical generations at full length
    min_agreed_prefix: int
    mean_agreed_prefix_interval: tuple[float, float]  # bootstrap over the prompts


def generation_agreement(
    baseline: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]], *,
    interval_level: float = 0.9, num_resamples: int = 1000, seed: int = 0,
) -> GenerationAgreement:
    """Summarize where each prompt's greedy generations first part ways (the mean agreed prefix
    with a two-sided `interval_level` bootstrap interval over the prompts)."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("need the same, non-zero number of generations per arm")
    prefixes: list[int] = []
    positions: list[int] = []
    for base, cand in zip(baseline, candidate, strict=True):
        where = first_divergence(base, cand)
        if where is None:
            prefixes.append(len(base))
        else:
            positions.append(where)
            prefixes.append(where)
    return GenerationAgreement(
        num_prompts=len(baseline),
        num_identical=len(baseline) - len(positions),
        divergence_positions=tuple(positions),
        mean_agreed_prefix=float(np.mean(prefixes)),
        min_agreed_prefix=int(min(prefixes)),
        mean_agreed_prefix_interval=stats.block_bootstrap_interval(
            [[np.array([p]) for p in prefixes]], np.mean, confidence=interval_level, num_resamples=num_resamples,
            seed=seed),
    )


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where one prompt's greedy generations part, as text a reviewer can read."""

    prompt_index: int
    position: int  # generated tokens both arms agree on before they part
    prompt_tail: str  # the prompt's end
    agreed: str  # the end of what both wrote
    baseline_next: str  # what each wrote from there
    candidate_next: str


def earliest_divergences(prompts: Sequence[Sequence[int]], baseline: Sequence[Sequence[int]],
                         candidate: Sequence[Sequence[int]], decode: Callable[[Sequence[int]], str], *,
                         limit: int = 3, context: int = 24, after: int = 12) -> list[Divergence]:
    """The `limit` prompts whose generations part first, with `context` tokens before the split
    (of the generation, else of the prompt) and `after` tokens of each arm's continuation."""
    parted = sorted((where, i) for i, (b, c) in enumerate(zip(baseline, candidate, strict=True))
                    if (where := first_divergence(b, c)) is not None)
    return [Divergence(prompt_index=i, position=where, prompt_tail=decode(prompts[i][-context:]),
                       agreed=decode(baseline[i][max(0, where - context):where]),
                       baseline_next=decode(baseline[i][where:where + after]),
                       candidate_next=decode(candidate[i][where:where + after]))
            for where, i in parted[:limit]]


@dataclass(frozen=True, slots=True)
class LengthBucket:
    """Paired accuracy of the items whose baseline generation length falls in [min_chars, max_chars]."""

    min_chars: int
    max_chars: int
    num_items: int
    baseline_accuracy: float
    candidate_accuracy: float


def accuracy_by_generation_length(baseline: dict[int, ItemResult], candidate: dict[int, ItemResult],
                                  num_buckets: int = 4) -> list[LengthBucket]:
    """A generative task's accuracy in equal-count buckets of the baseline's generation length.

    Both arms are scored on the same items in each bucket, so a candidate that holds up on short
    answers and falls off on long chains of thought (the signature of a drifting KV cache)
    shows as a gap that widens with length. Length is in characters: it needs no tokenizer and
    means the same for an in-process arm and a served one.
    """
    ids = sorted(baseline.keys() & candidate.keys(), key=lambda i: (len(baseline[i].response), i))
    if not ids:
        return []
    buckets = []
    for chunk in np.array_split(np.asarray(ids), min(num_buckets, len(ids))):
        lengths = [len(baseline[int(i)].response) for i in chunk]
        buckets.append(LengthBucket(
            min_chars=min(lengths), max_chars=max(lengths), num_items=len(chunk),
            baseline_accuracy=float(np.mean([baseline[int(i)].correct for i in chunk])),
            candidate_accuracy=float(np.mean([candidate[int(i)].correct for i in chunk]))))
    return buckets


def kl_growth(parity: LogitParity) -> float | None:
    """p99 KL in the longest populated position bucket over the first bucket's (FP8-KV signature)."""
    names = [bucket_name(b) for b in POSITION_BUCKETS if bucket_name(b) in parity.by_position]
    if len(names) < 2:
        return None
    return _growth(parity.by_position[names[0]].kl_p99, parity.by_position[names[-1]].kl_p99)


def _growth(first_p99: float, last_p99: float) -> float:
    return math.inf if first_p99 == 0 and last_p99 > 0 else (last_p99 / first_p99 if first_p99 else 1.0)
