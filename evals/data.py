"""Find and read the local evaluation data, so the gate never needs the network.

The data directory is resolved once, in a fixed order: an explicit `--data-dir`, then
`$DRIFTGATE_DATA`, then `../shared/data` next to the repository root. Every loader returns
records in file order, which is what keeps item ids stable between the two arms and
across runs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from engine.file_hash import file_sha256

DATA_ENV_VAR = "DRIFTGATE_DATA"
REPO_ROOT = Path(__file__).resolve().parents[1]

# Files each task reads, relative to the data directory (also hashed into the report manifest).
TASK_FILES: dict[str, tuple[str, ...]] = {
    "driftgate_arc_easy": ("arc/arc_easy.jsonl",),
    "driftgate_arc_challenge": ("arc/arc_challenge.jsonl",),
    "driftgate_hellaswag": ("hellaswag/hellaswag_val_full.jsonl",),
    "driftgate_piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "driftgate_winogrande": ("winogrande/winogrande.jsonl",),
    "driftgate_gsm8k_cot": ("gsm8k/test.jsonl",),
    "driftgate_wikitext": ("wikitext/wiki.test.raw",),
}


class DataMissingError(FileNotFoundError):
    """A data directory or a file a task needs is not there."""


class UnknownTaskError(ValueError):
    """A policy names a task the gate has no data for (a misspelt name, usually)."""


def resolve_data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Return the data directory from the first source that is set; it must exist."""
    if explicit is not None:
        source, path = "--data-dir", Path(explicit)
    elif os.environ.get(DATA_ENV_VAR):
        source, path = f"${DATA_ENV_VAR}", Path(os.environ[DATA_ENV_VAR])
    else:
        source, path = "the default ../shared/data", REPO_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        raise DataMissingError(f"evaluation data directory {path} (from {source}) does not exist")
    return path.resolve()


def task_file(data_dir: Path, relative: str) -> Path:
    """Path of one data file, with an error that names it when it is missing."""
    path = Path(data_dir) / relative
    if not path.is_file():
        raise DataMissingError(f"missing data file {path}")
    return path


def check_task_files(data_dir: Path, task_names: list[str]) -> dict[str, str]:
    """Verify every file the tasks need exists; return {relative path: sha256} for the manifest."""
    if unknown := [name for name in task_names if name not in TASK_FILES]:
        raise UnknownTaskError(f"unknown task {', '.join(map(repr, unknown))} in the policy; known tasks: "
                               f"{', '.join(sorted(TASK_FILES))}")
    hashes: dict[str, str] = {}
    for name in task_names:
        for relative in TASK_FILES[name]:
            hashes[relative] = file_sha256(task_file(data_dir, relative))
    return hashes


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_arc(data_dir: Path, subset: str) -> list[dict]:
    """ARC test split in llm-foundry's format: query ("Question: ..."), choices, gold index."""
    return read_jsonl(task_file(data_dir, f"arc/arc_{subset}.jsonl"))


def load_hellaswag(data_dir: Path) -> list[dict]:
    """HellaSwag validation: ctx ("activity: context"), endings, label."""
    return read_jsonl(task_file(data_dir, "hellaswag/hellaswag_val_full.jsonl"))


def load_piqa(data_dir: Path) -> list[dict]:
    """PIQA validation with the labels (kept in a separate file upstream) joined in as `label`."""
    docs = read_jsonl(task_file(data_dir, "piqa/valid.jsonl"))
    labels = task_file(data_dir, "piqa/valid-labels.lst").read_text().split()
    if len(labels) != len(docs):
        raise ValueError(f"PIQA has {len(docs)} questions but {len(labels)} labels")
    return [{**doc, "label": int(label)} for doc, label in zip(docs, labels, strict=True)]


def load_winogrande(data_dir: Path) -> list[dict]:
    """Winogrande dev in partial-scoring form: context_options, continuation, gold."""
    return read_jsonl(task_file(data_dir, "winogrande/winogrande.jsonl"))


def load_gsm8k(data_dir: Path) -> list[dict]:
    """GSM8K test: question, answer (worked solution ending in '#### n')."""
    return read_jsonl(task_file(data_dir, "gsm8k/test.jsonl"))


_ARTICLE_TITLE = re.compile(r"^ ?= [^=].* = ?$")
_NUMBER_SEPARATORS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))


def load_wikitext(data_dir: Path) -> list[dict]:
    """WikiText-2 test as one document per article (split at top-level ' = Title = ' lines).

    Only the number-separator markers are undone; the text is otherwise the raw test
    file, so perplexities are comparable between arms, not to published figures.
    """
    text = task_file(data_dir, "wikitext/wiki.test.raw").read_text(encoding="utf-8")
    articles: list[list[str]] = []
    for line in text.splitlines():
        if _ARTICLE_TITLE.match(line) or not articles:
            articles.append([])
        articles[-1].append(line.strip())
    docs = []
    for lines in articles:
        page = "\n".join(lines)
        for marker, plain in _NUMBER_SEPARATORS:
            page = page.replace(marker, plain)
        docs.append({"page": page})
    return docs
