"""Tokenizer loading (HF fast tokenizers from the model folder, never from the hub)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The folder's tokenizer, loaded offline; a clear error when it has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json / tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError) as exc:  # a damaged tokenizer.json's JSON error names no file
        raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from None
