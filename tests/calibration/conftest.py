"""Shared fixtures: the tiny tokenizer and a tiny model folder, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_tiny_model_dir, write_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
