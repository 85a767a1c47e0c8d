"""Prompt sets for `driftgate bench serve`: ShareGPT, random tokens, and a shared long prefix.

Every sample carries its prompt length measured with the model's tokenizer and the number of
tokens to ask for. The local ShareGPT files hold first human turns only (no replies), so
output lengths come from a stated distribution instead of the reply: log-normal with median
`output_len` and sigma 0.7 (a right-skewed spread like chat replies), clipped to [4, 1024].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evals.data import resolve_data_dir

SHAREGPT_FILE = "sharegpt/ShareGPT_V3_filtered_1000.json"
OUTPUT_LEN_SIGMA = 0.7
_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's ShareGPT pruning rule


@dataclass(slots=True)
class Sample:
    prompt: str
    prompt_len: int
    output_len: int


def find_data_dir(data_dir: str | None) -> Path:
    """--data-dir, then $DRIFTGATE_DATA, then ../shared/data next to the repository (one rule for all tools)."""
    return resolve_data_dir(data_dir)


def _output_lens(rng: np.random.Generator, median: int, count: int, fixed: bool) -> np.ndarray:
    if fixed:
        return np.full(count, median, dtype=np.int64)
    draws = rng.lognormal(mean=np.log(median), sigma=OUTPUT_LEN_SIGMA, size=count)
    return np.clip(np.rint(draws), _MIN_LEN, 1024).astype(np.int64)


def sharegpt(tokenizer, data_dir: Path, num_prompts: int, output_len: int, fixed_output_len: bool,
             rng: np.random.Generator) -> list[Sample]:
    """First human turns, shuffled, pruned like vLLM's ShareGPT loader (4–1024 prompt tokens)."""
    records = json.loads((data_dir / SHAREGPT_FILE).read_text())
    order = rng.permutation(len(records))
    wanted = _output_lens(rng, output_len, len(records), fixed_output_len)
    samples: list[Sample] = []
    for i in order:
        turns = records[i].get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = turns[0]["value"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = int(wanted[i])
        if prompt_len < _MIN_LEN or prompt_len > _MAX_PROMPT_LEN or prompt_len + out_len > _MAX_TOTAL_LEN:
            continue
        samples.append(Sample(prompt, prompt_len, out_len))
        if len(samples) == num_prompts:
            return samples
    raise ValueError(f"only {len(samples)} ShareGPT prompts pass the length filter; asked for {num_prompts}")


def _text_vocabulary(tokenizer) -> np.ndarray:
    """Token ids to draw random prompts from: not special, and each decodes to whole characters
    (a lone byte of a multi-byte character decodes to U+FFFD, which encodes back as three tokens)."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[t] for t in range(len(tokenizer))])
    return np.array([t for t, text in enumerate(texts) if t not in special and "\ufffd" not in text])


def _random_text(tokenizer, vocab: np.ndarray, rng: np.random.Generator, num_tokens: int, tries: int = 10) -> str:
    """Text that encodes to `num_tokens` tokens, as vLLM's random dataset makes it: decoded random ids
    merge and split when encoded again, so the encoding is cut to the length, or random ids are
    added, and decoded again, until it fits (or `tries` run out)."""
    ids = rng.choice(vocab, size=num_tokens).tolist()
    for _ in range(tries):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == num_tokens:
            break
        ids = ids[:num_tokens] + rng.choice(vocab, size=max(0, num_tokens - len(ids))).tolist()
    return text


def random_prompts(tokenizer, num_prompts: int, input_len: int, output_len: int,
                   rng: np.random.Generator) -> list[Sample]:
    """Random token ids as text of `input_len` tokens; lengths are measured, since a few may miss."""
    vocab = _text_vocabulary(tokenizer)
    samples = []
    for _ in range(num_prompts):
        prompt = _random_text(tokenizer, vocab, rng, input_len)
        samples.append(Sample(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len))
    return samples


def prefix_shared(tokenizer, num_prompts: int, prefix_len: int, input_len: int, output_len: int,
                  rng: np.random.Generator, num_prefixes: int = 1) -> list[Sample]:
    """A long common system prompt, then a distinct `input_len`-token question per request.

    Measures what a prefix cache saves: every request after the first can reuse the prefix.
    With `num_prefixes` > 1 each request draws one of several system prompts at random, as
    several tenants or agents would: it shows whether a router keeps each on one replica.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    vocab = _text_vocabulary(tokenizer)
    prefixes = [_random_text(tokenizer, vocab, rng, prefix_len) for _ in range(num_prefixes)]
    samples = []
    for _ in range(num_prompts):
        prefix = prefixes[int(rng.integers(num_prefixes))] if num_prefixes > 1 else prefixes[0]
        prompt = prefix + "\n" + _random_text(tokenizer, vocab, rng, input_len)
        samples.append(Sample(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len))
    return samples
