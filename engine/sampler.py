"""Turn next-token logits into tokens, per request: constraints, penalties, greedy or filtered
sampling, logprobs.

Logprobs are reported from the raw model distribution (before penalties and temperature), as
vLLM does by default: they describe the model, which is what the evals compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.outputs import Logprob, LogprobsDict
from engine.sampling_params import SamplingParams
from engine.structured_output import mask_logits
from engine.thinking import ThinkingCounter


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from and what the request asks for."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded per request; None → the engine's generator
    matcher: Any = None  # the sequence's grammar matcher (structured outputs), advanced by each sampled token
    thinking: ThinkingCounter | None = None  # the request's thinking budget, committed to its output so far

    @property
    def grammar_active(self) -> bool:
        return self.matcher is not None and not self.matcher.is_terminated()

    @property
    def forced_token(self) -> int | None:
        """The one token the thinking budget allows next (its block's end), or None."""
        return self.thinking.forced_token(self.output_token_ids) if self.thinking is not None else None


def _banned(row: SamplingRow) -> list[int]:
    """Tokens the row may not take next: stop tokens and EOS before min_tokens, and the last token
    of every bad word whose other tokens end the output so far."""
    p, output = row.params, row.output_token_ids
    banned = [*p.stop_token_ids, *p.eos_token_ids] if len(output) < p.min_tokens else []
    for *head, last in p.bad_words_token_ids:
        if not head or output[-len(head):] == head:
            banned.append(last)
    return banned


def apply_constraints(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Grammars, allowed_token_ids, logit_bias, then bans (min_tokens, bad_words): vLLM's order,
    before penalties; a token the thinking budget forces overrides them all."""
    grammar_rows = [i for i, row in enumerate(rows) if row.grammar_active]
    if grammar_rows:
        mask_logits(logits, grammar_rows, [rows[i].matcher for i in grammar_rows])
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(p.allowed_token_ids)
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        if p.logit_bias:
            logits[i, torch.tensor(list(p.logit_bias))] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        banned = _banned(row)
        if banned:
            # only a row a grammar or allowed_token_ids narrowed can be left with nothing
            restricted = row.grammar_active or p.allowed_token_ids is not None
            kept = logits[i, banned].clone() if restricted else None
            logits[i, banned] = float("-inf")
            if kept is not None and not torch.isfinite(logits[i]).any():
                # the grammar (its output complete) or allowed_token_ids allow nothing but what
                # min_tokens or bad_words ban: they win, or the row would sample from nothing
                logits[i, banned] = kept
        if (row.grammar_active and p.allowed_token_ids is not None and p.stop_token_ids
                and not torch.isfinite(logits[i]).any()):
            # allowed_token_ids and the grammar share no token: the output ends at EOS (a grammar's
            # request stops there, its first stop token), where sampling from nothing gave token 0 to the end
            logits[i, p.stop_token_ids[0]] = 0.0
        forced = row.forced_token
        if forced is not None:
            logits[i] = float("-inf")
            logits[i, forced] = 0.0
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's order: the repetition penalty over prompt and output tokens, then OpenAI's frequency
    and presence penalties over output tokens."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)))
            seen = logits[i, ids]
            logits[i, ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            ids, counts = torch.tensor(row.output_token_ids).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's filters on temperature-scaled logits, rows in parallel: min_p against the likeliest
    token's probability; then top-k, keeping every token tied with the k-th; then top-p over what
    top-k left, renormalized: the unlikeliest tokens go while their mass stays within 1 − top_p
    (top_p 1 drops nothing, however small; the likeliest token always stays). Writes into
    `logits` (the sampler's own scaled copy)."""
    if bool((min_p > 0).any()):  # only these rows pay for a vocabulary-wide softmax
        rows = (min_p > 0).nonzero().squeeze(1)
        probs = logits[rows].softmax(dim=-1)
        floor = min_p[rows].unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits[rows] = logits[rows].masked_fill(probs < floor, float("-inf"))
    sorting = (top_k > 0) | (top_p < 1)  # only these rows pay for a vocabulary-wide sort
    if not bool(sorting.any()):
        return logits
    rows = sorting.nonzero().squeeze(1)
    ascending, order = logits[rows].sort(dim=-1)
    vocab = logits.shape[-1]
    kth = ascending.gather(1, (vocab - torch.where(top_k[rows] > 0, top_k[rows], vocab)).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p[rows]).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    logits[rows] = torch.empty_like(ascending).scatter_(1, order, ascending)
    return logits


def _adjusted(row: SamplingRow) -> bool:
    """Whether constraints or penalties change the row's logits (the common row skips both)."""
    p = row.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or row.grammar_active
                or p.allowed_token_ids is not None or p.logit_bias or p.bad_words_token_ids
                or ((p.stop_token_ids or p.eos_token_ids) and len(row.output_token_ids) < p.min_tokens)
                or row.forced_token is not None)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum, as torch's). On the CPU numpy's is ~10x faster for a
    vocabulary-wide fp32 row (4 against 54 µs here), a share of a small model's decode step."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
           ) -> tuple[list[int], list[LogprobsDict | None]]:
    """logits [N, vocab] fp32 → one token id per row, and top-n logprobs where asked."""
    adjusted = any(_adjusted(r) for r in rows)
    if logits.device.type != "cpu" and (adjusted or not all(r.params.is_greedy for r in rows)):
        # sampling parameters and per-request generators live on the CPU; greedy rows stay on the GPU
        logits = logits.cpu()
    logprobs_out: list[LogprobsDict | None] = [None] * len(rows)
    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(dim=-1) if want_logprobs else None

    if adjusted:
        logits = apply_penalties(apply_constraints(logits.clone(), rows), rows)
    tokens = _argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        sub = logits[random_rows]
        params = [rows[i].params for i in random_rows]
        sub = sub / torch.tensor([p.temperature for p in params]).unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            # a top_k past the vocabulary keeps every token (and would not fit an int64 tensor)
            sub = _filter(sub, torch.tensor([min(p.top_k, sub.shape[-1]) for p in params]),
                          torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
        probs = sub.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a CPU sync per row.
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=rows[i].generator or generator)
        tokens[random_rows] = _argmax(probs / noise)
    token_list = tokens.tolist()
    for row, token in zip(rows, token_list, strict=True):
        if row.grammar_active:
            row.matcher.accept_token(token)

    if want_logprobs:
        entries = _logprobs_entries(raw_logprobs, [token_list[i] for i in want_logprobs],
                                    [rows[i].params.logprobs for i in want_logprobs])
        for i, entry in zip(want_logprobs, entries, strict=True):
            logprobs_out[i] = entry
    return token_list, logprobs_out


def _logprobs_entries(logprobs: torch.Tensor, tokens: list[int], top_ns: list[int]) -> list[LogprobsDict]:
    """logprobs [N, vocab] → per row its token's logprob and rank in the whole vocabulary (how many
    tokens are at least as likely), then the row's top-n, ranked in order (the token may be among
    them), for all rows at once."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # vLLM's: a tie takes the rank after the tokens it ties
    entries = [{token: Logprob(value, rank)}
               for token, value, rank in zip(tokens, chosen.squeeze(1).tolist(), ranks, strict=True)]
    if widest := max(top_ns):
        values, ids = logprobs.topk(widest, dim=-1)
        for entry, top_n, row_values, row_ids in zip(entries, top_ns, values.tolist(), ids.tolist(), strict=True):
            for rank, (token, value) in enumerate(zip(row_ids[:top_n], row_values[:top_n], strict=True), start=1):
                entry[token] = Logprob(value, rank)  # among the top-n, its place there (vLLM's, ties too)
    return entries


def verify(logits: torch.Tensor, row: SamplingRow, drafts: Sequence[int], generator: torch.Generator | None = None,
           ) -> tuple[list[int], list[LogprobsDict | None]]:
    """Speculative decoding's acceptance: logits [1 + len(drafts), vocab], row j scoring the token
    after draft j − 1 → the drafts kept, then one token of the model's own.

    Row j is sampled as plain decoding would sample it had drafts 0..j−1 been its earlier tokens
    (penalties, bans and grammar see them), and the walk stops at the first token that differs
    from its draft. For a draft proposed with certainty (prompt lookup), keeping it when the
    sample equals it is speculative sampling's rule (accept with probability p(draft), else draw
    from p without it), so every output token has the distribution plain decoding gives it, and
    a seeded request draws from its generator once per output token, as without drafts.
    """
    p = row.params
    if p.is_greedy and not _adjusted(row) and row.thinking is None:  # one argmax for all rows, nothing to thread through
        best = _argmax(logits).tolist()
        kept = next((j for j, draft in enumerate(drafts) if best[j] != draft), len(drafts))
        tokens = best[:kept + 1]
        if p.logprobs is None:
            return tokens, [None] * len(tokens)
        return tokens, _logprobs_entries(logits[:len(tokens)].log_softmax(dim=-1), tokens, [p.logprobs] * len(tokens))
    tokens: list[int] = []
    logprobs: list[LogprobsDict | None] = []
    for j in range(len(drafts) + 1):
        seen = replace(row, output_token_ids=row.output_token_ids + tokens) if tokens else row
        (token,), (entry,) = sample(logits[j:j + 1], [seen], generator)
        tokens.append(token)
        logprobs.append(entry)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, logprobs


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], top_n: int) -> list[LogprobsDict]:
    """logits [T, vocab] at prompt positions → entry t: the logprob and rank of next_tokens[t]
    (+ the top-n)."""
    return _logprobs_entries(logits.log_softmax(dim=-1), next_tokens, [top_n] * len(next_tokens))
