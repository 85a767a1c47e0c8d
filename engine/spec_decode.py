"""Speculative decoding by prompt lookup (vLLM's "ngram" method): no draft model, no torch.

A sequence whose last few tokens occurred earlier in its prompt or output probably goes on as it
did then (code edits, quoting, summaries, retrieval answers). The tokens that followed that
earlier occurrence are proposed as drafts; the runner scores them all in one forward, as
single-token queries of the same sequence, and the sampler keeps the longest prefix it would have
sampled itself. The output distribution is unchanged (see `sampler.verify`); only the number of
forwards per token falls, when drafts are right.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from engine.json_object import parse_json_object

SPEC_METHODS = ("ngram",)


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys for the ngram method."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix that counts as a match
    # no drafts while more sequences than this are running: a big batch already fills the CPU,
    # and verifying drafts that miss costs more than it saves (0: always draft)
    disable_by_batch_size: int = 2

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)} (prompt lookup); "
                             f"got {self.method!r}: draft models and EAGLE heads are not supported")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 0:
            raise ValueError(f"disable_by_batch_size must be 0 (never) or positive, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict, or the JSON text the CLIs take; unknown keys are errors."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = parse_json_object(value)
            except ValueError as e:
                raise ValueError(f"speculative config: {e}: {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__slots__))
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(cls.__slots__)}")
        for key, item in value.items():
            if key != "method" and (not isinstance(item, int) or isinstance(item, bool)):
                raise ValueError(f"speculative config {key} must be an integer, got {item!r}")
        return cls(**value)


def speculative_config_arg(value: str) -> SpeculativeConfig:
    """argparse type for --speculative-config: our message, not argparse's generic one."""
    try:
        return SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SPECULATIVE_CONFIG_HELP = ('speculative decoding by prompt lookup, vLLM\'s JSON: \'{"method": "ngram", '
                           '"num_speculative_tokens": 4}\' (also prompt_lookup_max, prompt_lookup_min, '
                           'disable_by_batch_size); same outputs, fewer forwards when text repeats')


def propose_ngram(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed an earlier occurrence of the longest suffix of
    `token_ids` (between min_n and max_n tokens long); [] when none occurred.

    The latest occurrence with `num_drafts` tokens after it wins (recent text predicts best);
    failing that, the earliest (the most tokens after it, as in a run of one repeated token).
    One pass finds the earlier places of the last token; only those are extended backwards, so a
    step costs O(context + matches x max_n), whatever max_n is.
    """
    if num_drafts < 1 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids)
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence could end
    lengths = np.ones(len(ends), dtype=np.int64)  # how many tokens of the suffix each one matches
    alive = np.ones(len(ends), dtype=bool)
    for k in range(1, min(max_n, last)):
        alive &= ends >= k
        alive[alive] = tokens[ends[alive] - k] == tokens[last - k]
        if not alive.any():
            break
        lengths += alive
    if not len(ends) or lengths.max() < min_n:
        return []
    hits = ends[lengths == lengths.max()]
    full = hits[hits + 1 + num_drafts <= len(tokens)]
    start = int(full[-1] if len(full) else hits[0]) + 1
    return tokens[start:start + num_drafts].tolist()
