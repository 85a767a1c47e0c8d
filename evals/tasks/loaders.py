"""`custom_dataset` hooks for the task YAMLs in this folder (lm-eval resolves `!function` here).

lm-eval calls each hook with the task metadata as keyword arguments; the gate passes the
resolved `data_dir` through `TaskManager(metadata=...)`, and without it the documented
resolution order applies.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import datasets

from evals import data


def _split(load: Callable[[Path], list[dict]], data_dir: str | None) -> datasets.DatasetDict:
    docs = load(data.resolve_data_dir(data_dir))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def arc_easy(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(lambda d: data.load_arc(d, "easy"), data_dir)


def arc_challenge(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(lambda d: data.load_arc(d, "challenge"), data_dir)


def hellaswag(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(data.load_hellaswag, data_dir)


def piqa(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(data.load_piqa, data_dir)


def winogrande(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(data.load_winogrande, data_dir)


def gsm8k(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(data.load_gsm8k, data_dir)


def wikitext(data_dir: str | None = None, **_: object) -> datasets.DatasetDict:
    return _split(data.load_wikitext, data_dir)


def wikitext_results(doc: dict, results: tuple[float]) -> dict[str, tuple[float, int]]:
    """Per-document (loglikelihood, size) pairs that lm-eval's perplexity aggregations expect."""
    (loglikelihood,) = results
    num_words = len(re.split(r"\s+", doc["page"]))
    num_bytes = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, num_words),
        "byte_perplexity": (loglikelihood, num_bytes),
        "bits_per_byte": (loglikelihood, num_bytes),
    }
