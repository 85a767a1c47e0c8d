"""Beam search over the engine, driven as vLLM drives it (`LLM.beam_search`, the API's
`use_beam_search`), hypotheses kept and scored as HF transformers' (the oracle it is tested on;
vLLM's length counts the prompt, and it keeps every EOS extension).

Each step submits every live beam (prompt + its tokens) as a one-token request asking for the
top 2 × beam_width next-token logprobs; the prefix cache serves all but the beam's last partial
block, so a step costs about one decode token per beam. The beam_width most probable extensions
(by summed logprob) that do not end in EOS go on; one ending in EOS that ranks among the
beam_width best is set aside as a finished hypothesis (HF transformers' rule).
After max_tokens steps, or when no beam is left, hypotheses are ranked by summed logprob over
generated length ** length_penalty (EOS not counted) and the best beam_width returned.

`BeamSearch` holds one prompt's beams and does no I/O: `LLM.beam_search` drives it with
`generate`, the server with the async engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None  # as SamplingParams': the beams share blocks only with this salt

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 10:  # each step asks for 2 x beam_width logprobs, at most 20
            raise ValueError(f"beam_width must be in [1, 10], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks for: its 2 × beam_width most probable next tokens."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * self.beam_width,
                              cache_salt=self.cache_salt)


@dataclass(slots=True)
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated, the prompt not included
    # each token's step: the 2 × beam_width most probable next tokens there (it among them), by logprob
    alternatives: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False  # ended with EOS

    def score(self, length_penalty: float) -> float:
        length = len(self.tokens) - self.finished
        return self.cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One prompt's search: `pending()` are the sequences to extend by a token; `advance()` takes
    each one's top next tokens; `done`, then `best()`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int],
                 max_model_len: int):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.beams = [Beam()]
        self.hypotheses: list[Beam] = []  # finished with EOS
        self.steps = 0
        # as plain generation does, a beam stops at the context's end ("length")
        self.max_steps = min(params.max_tokens, max_model_len - len(self.prompt_token_ids))

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.max_steps

    def pending(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.tokens for beam in self.beams]

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """top_logprobs[i]: the next-token logprobs of pending()[i] (at least beam_width of them)."""
        if len(top_logprobs) != len(self.beams):
            raise ValueError(f"{len(top_logprobs)} expansions for {len(self.beams)} beams")
        candidates = []
        for beam, top in zip(self.beams, top_logprobs, strict=True):
            for token, logprob in top.items():
                ends = token in self.eos_token_ids and not self.params.ignore_eos
                candidates.append(Beam(beam.tokens + [token], beam.alternatives + [top], beam.cum_logprob + logprob,
                                       ends))
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        width = self.params.beam_width
        self.hypotheses += [c for c in candidates[:width] if c.finished]
        self.beams = [c for c in candidates if not c.finished][:width]
        self.steps += 1

    def best(self) -> list[Beam]:
        """The beam_width best hypotheses, finished or not, by length-penalized score."""
        ranked = sorted(self.hypotheses + self.beams, key=lambda b: b.score(self.params.length_penalty), reverse=True)
        return ranked[:self.params.beam_width]

    def output(self, request_id: str, prompt: str | None, tokenizer) -> RequestOutput:
        """The best hypotheses as one finished request of beam_width completions, best first (the
        text without its EOS or special tokens)."""
        completions = [
            CompletionOutput(index=i, text=tokenizer.decode(beam.tokens[:len(beam.tokens) - beam.finished],
                                                            skip_special_tokens=True),
                             token_ids=beam.tokens,
                             logprobs=list(beam.alternatives),
                             finish_reason="stop" if beam.finished else "length",
                             stop_reason=beam.tokens[-1] if beam.finished else None,
                             cumulative_logprob=beam.cum_logprob)
            for i, beam in enumerate(self.best())]
        return RequestOutput(request_id, prompt, self.prompt_token_ids, completions, finished=True)

    def vllm_output(self, tokenizer) -> BeamSearchOutput:
        """The best hypotheses in vLLM's offline shape (`LLM.beam_search`)."""
        sequences = []
        for beam in self.best():
            tokens = self.prompt_token_ids + beam.tokens[:len(beam.tokens) - beam.finished]
            sequences.append(BeamSearchSequence(tokens, list(beam.alternatives), beam.cum_logprob,
                                                tokenizer.decode(tokens), "stop" if beam.finished else "length",
                                                beam.tokens[-1] if beam.finished else None))
        return BeamSearchOutput(sequences)


@dataclass(slots=True)
class BeamSearchSequence:
    """vLLM's: one hypothesis, its `tokens` and `text` with the prompt's in front (the EOS that
    finished it is left out of both, its logprobs entry kept, as vLLM does)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    text: str
    finish_reason: str
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's `LLM.beam_search` result for one prompt: the best hypotheses, best first."""

    sequences: list[BeamSearchSequence]


async def search_async(generate: Callable[..., AsyncIterator[RequestOutput]], search: BeamSearch, request_id: str,
                       priority: int = 0) -> None:
    """Run `search` to its end through an async engine's `generate` (AsyncEngine, ClusterEngine),
    each step's beams as concurrent one-token requests; cancelling it aborts those."""
    step = search.params.step_params()

    async def next_token_logprobs(i: int, token_ids: list[int]) -> dict[int, float]:
        async for out in generate(token_ids, step, f"{request_id}-beam{search.steps}-{i}", priority):
            last = out
        return last.outputs[0].logprobs[0]

    while not search.done:
        search.advance(await asyncio.gather(*(next_token_logprobs(i, ids) for i, ids in enumerate(search.pending()))))
