"""Per-request sampling parameters, in vLLM's shape so users' habits carry over."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from engine.structured_output import StructuredOutputs
from engine.thinking import ThinkingBudget

log = logging.getLogger(__name__)

POOLING_TYPES = ("last", "mean", "cls")
MIN_TEMPERATURE = 0.01  # vLLM's floor: far below it (1e-38) scaled logits overflow, the softmax gives NaN
_INT64 = 2**63
_INTEGER_FIELDS = ("n", "min_tokens", "top_k")
_OPTIONAL_INTEGER_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    temperature 0 means exact argmax (greedy). Penalties follow OpenAI's definitions
    (presence/frequency, additive on logits) and vLLM's repetition penalty (divide positive
    logits, multiply negative ones, over prompt and output tokens). Before them, as in vLLM, the
    logits are constrained: only `allowed_token_ids` stay, `logit_bias` is added (OpenAI's
    [-100, 100]), no stop token (nor EOS, even with `ignore_eos`) before `min_tokens`, and no token that would complete one of
    `bad_words` (the engine tokenizes them into `bad_words_token_ids`). `structured_outputs`
    holds the output to JSON, a schema, a regex, a choice or a grammar: from the first token, or,
    with `structured_outputs_after`, from the token after those ids in the prompt or the output (a
    reasoning model's end of thinking, so the constraint holds its answer, not its thoughts; a
    template that turns thinking off writes an empty block into the prompt) where no later
    `structured_outputs_reopened_by` (the block's start) opened another: an earlier turn's
    thoughts, or a user quoting the marker, leave the new block's thinking free, as vLLM's
    reasoning parsers read the last marker. `thinking_budget` caps the tokens a reasoning model
    spends inside a thinking block, then forces the block's end (engine/thinking.py); with a
    structured output and no `structured_outputs_after` the constraint waits while that block is
    open (from the first token where none is), or the grammar and the forced end would contradict
    each other.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: as many as the context leaves after the prompt
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None  # -1: none, as vLLM reads it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (the sampled one always included; -1: all)
    prompt_logprobs: int | None = None  # top-n per prompt token; 0 = only the prompt token's own; -1: all
    # First prompt position whose logprob is wanted (scoring a continuation after a shared
    # context): earlier positions may then come from the prefix cache and are reported as None.
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and so no stop strings), as vLLM's
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens (-1: the context's worth)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # filled by the engine from bad_words
    # filled by the engine: the model's EOS ids, which min_tokens bans even under ignore_eos (vLLM's)
    eos_token_ids: list[int] = field(default_factory=list)
    structured_outputs: StructuredOutputs | None = None
    structured_outputs_after: list[int] | None = None
    structured_outputs_reopened_by: list[int] | None = None
    thinking_budget: ThinkingBudget | None = None
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    # embed the prompt instead of generating: its final hidden states pooled ("last" token, "mean"
    # over its tokens, or its first, "cls"), returned as RequestOutput.embedding
    pooling: str | None = None

    def __post_init__(self) -> None:
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.bad_words = _as_list(self.bad_words)
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and not -_INT64 <= self.seed < _INT64:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        check_truncation(self.truncate_prompt_tokens)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %g is below vLLM's floor %g (scaled logits can overflow); sampling at %g "
                        "(0 is greedy)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's max_logprobs
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be at least 0, or -1 for the whole vocabulary, got {value}")
        if self.logit_bias is not None:
            bad = next((v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0), None)
            if bad is not None:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not word.strip() for word in self.bad_words):
            raise ValueError("bad_words must be non-empty words")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.pooling is not None and self.n != 1:
            raise ValueError("an embedding request (pooling) has one output: n must be 1")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if self.structured_outputs_after is not None and (not self.structured_outputs_after
                                                          or self.structured_outputs is None):
            raise ValueError("structured_outputs_after must be a non-empty list of token ids, with structured_outputs")
        if self.structured_outputs_reopened_by is not None and (not self.structured_outputs_reopened_by
                                                                or self.structured_outputs_after is None):
            raise ValueError("structured_outputs_reopened_by must be a non-empty list of token ids, with "
                             "structured_outputs_after")

    def _check_types(self) -> None:
        """Wrong types fail here, naming the field, not inside the engine's step (where one bad
        request would fail its whole batch)."""
        def is_integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in _INTEGER_FIELDS + _OPTIONAL_INTEGER_FIELDS:
            value = getattr(self, name)
            if not (is_integer(value) or (value is None and name in _OPTIONAL_INTEGER_FIELDS)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not all(is_integer(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers), got {self.stop_token_ids!r}")

    def output_budget(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """max_tokens, or (None) what the context leaves after the prompt, as vLLM reads it."""
        return self.max_tokens if self.max_tokens is not None else max(max_model_len - num_prompt_tokens, 1)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids the params name must be rows of the logits (ValueError naming the field)."""
        budget = self.thinking_budget
        markers = budget.start_ids + budget.end_ids if budget is not None else ()
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids),
                          ("stop_token_ids", self.stop_token_ids), ("thinking_budget", markers)):
            bad = next((t for t in ids or () if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} token id {bad} is outside the vocabulary (size {vocab_size})")

    def check_logprobs(self, limit: int, vocab_size: int) -> None:
        """At most `limit` alternatives per token (the engine's max_logprobs; ValueError naming the
        field); -1 asks for the whole vocabulary."""
        for name, count in self.logprob_counts(vocab_size).items():
            if count is not None and count > limit:
                asked = f"-1 (the whole vocabulary, {vocab_size})" if getattr(self, name) == -1 else count
                raise ValueError(f"{name} must be at most {limit} here (serve --max-logprobs N raises it; -1: "
                                 f"the whole vocabulary), got {asked}")

    def logprob_counts(self, vocab_size: int) -> dict[str, int | None]:
        """logprobs and prompt_logprobs with -1 as the vocabulary's size (what the sampler lists)."""
        return {name: vocab_size if (value := getattr(self, name)) == -1 else value
                for name in ("logprobs", "prompt_logprobs")}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` ids (-1: the context's worth; None: all)."""
    check_truncation(keep)
    return prompt_ids if keep is None else prompt_ids[-(max_model_len if keep == -1 else keep):]


def check_truncation(keep: int | None) -> None:
    if keep is not None and keep != -1 and keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")


def _as_list(value: object) -> list:
    """vLLM's leniency: one item for a list of one, None for an empty list."""
    if value is None:
        return []
    return [value] if isinstance(value, (str, int)) else list(value)
