"""`driftgate import-model --gguf`: what it does with an existing --dest, bad GGUF files, and permissions.

Every test runs on a tiny Llama GGUF written here (vocab 64, hidden 32, one layer); nothing
reaches the network.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from engine import model_import
from engine.cli import main
from engine.model_import import is_imported

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS = 64, 32, 64, 4, 2


def write_tiny_gguf(path: Path, *, scores: bool = True) -> Path:
    """A valid Llama GGUF with random f32 weights and a byte-level vocabulary (with its token
    scores, the `tokenizer.ggml.scores` that transformers needs when there are no merges, unless `scores=False`)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_file_type(0)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(97 + i % 26) + (str(i) if i >= 26 else "") for i in range(3, VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * VOCAB)
    if scores:
        w.add_token_scores([0.0] * VOCAB)
        w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    kv = HIDDEN * KV_HEADS // HEADS
    tensor("token_embd.weight", VOCAB, HIDDEN)
    tensor("output.weight", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    for name, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                        ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                        ("ffn_down", (HIDDEN, FFN))]:
        tensor(f"blk.0.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def import_cli(capsys, *args: str | Path) -> tuple[int, list[str]]:
    """Run `driftgate import-model ARGS`: its exit code and its `error:` lines."""
    rc = main(["import-model", *map(str, args)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    return rc, errors


def user_folder(path: Path) -> Path:
    """A folder of someone's work, which an import must not delete."""
    (path / "src").mkdir(parents=True)
    (path / "notes.txt").write_text("important\n")
    return path


def assert_untouched(path: Path) -> None:
    assert (path / "notes.txt").read_text() == "important\n" and (path / "src").is_dir()
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")], "temporary folder left behind"


@pytest.mark.parametrize("how", ["gguf", "name"])
def test_a_folder_that_is_not_an_import_is_refused_without_force(tmp_path, tiny_gguf, capsys, monkeypatch, how):
    def no_download(*_):
        raise AssertionError("the refusal must come before the download")

    monkeypatch.setattr(model_import, "_download_gguf", no_download)
    dest = user_folder(tmp_path / "myproject")
    rc, errors = import_cli(capsys, *(["--gguf", tiny_gguf] if how == "gguf" else ["smollm2-135m"]), "--dest", dest)
    assert rc == 2 and len(errors) == 1 and str(dest) in errors[0] and "--force" in errors[0]
    assert_untouched(dest)


def test_a_file_as_dest_is_refused(tmp_path, tiny_gguf, capsys):
    dest = tmp_path / "afile.txt"
    dest.write_text("important\n")
    for force in ([], ["--force"]):
        rc, errors = import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest, *force)
        assert rc == 2 and errors == [f"error: {dest} is a file, not a folder"]
    assert dest.read_text() == "important\n"


def test_import_fills_an_empty_folder_readable_by_all_and_is_cached(tmp_path, tiny_gguf, capsys, monkeypatch):
    dest = tmp_path / "model"
    dest.mkdir()
    with umask(0o022):
        assert import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest) == (0, [])
    assert is_imported(dest)
    # mkdtemp's 0700 and safetensors' 0600 would keep a server running as another user out
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()} == {
        p.name: 0o644 for p in dest.iterdir()}

    def no_convert(*_):
        raise AssertionError("an existing import is kept without --force")

    monkeypatch.setattr(model_import, "convert_gguf", no_convert)
    assert import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest) == (0, [])


def test_force_replaces_a_folder_only_with_a_complete_import(tmp_path, tiny_gguf, capsys, monkeypatch):
    from transformers import GenerationConfig

    dest = user_folder(tmp_path / "myproject")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    rc, errors = import_cli(capsys, "--gguf", truncated, "--dest", dest, "--force")
    assert rc == 2 and len(errors) == 1
    assert_untouched(dest)

    def disk_full(*_, **__):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # the last file of the new folder fails to write
        m.setattr(GenerationConfig, "save_pretrained", disk_full)
        rc, errors = import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest, "--force")
    assert rc == 2 and errors == ["error: [Errno 28] No space left on device"]
    assert_untouched(dest)

    assert import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest, "--force") == (0, [])
    assert is_imported(dest) and not (dest / "notes.txt").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("make,expected", [
    pytest.param(lambda data: data[:2000], "truncated or corrupt", id="header-only"),
    pytest.param(lambda data: data[:8], "truncated or corrupt", id="8-bytes"),
    pytest.param(lambda data: data[: len(data) // 2], "truncated or corrupt", id="half"),
    pytest.param(lambda data: bytes(range(256)) * 20, "truncated or corrupt", id="not-gguf"),
    pytest.param(None, "its metadata has no 'scores' entry", id="no-token-scores"),
])
def test_an_unreadable_gguf_is_one_line_naming_it(tmp_path, tiny_gguf, capsys, make, expected):
    path = tmp_path / "bad.gguf"
    if make is None:
        write_tiny_gguf(path, scores=False)
    else:
        path.write_bytes(make(tiny_gguf.read_bytes()))
    rc, errors = import_cli(capsys, "--gguf", path, "--dest", tmp_path / "out")
    assert rc == 2 and len(errors) == 1 and str(path) in errors[0] and expected in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_an_import_of_another_gguf_or_a_missing_one_is_not_taken_for_this_one(tmp_path, tiny_gguf, capsys):
    """An existing import is kept only for the GGUF it came from: a mistyped --gguf says the file is
    missing, and another file asks for --force instead of printing the old folder as if imported."""
    dest = tmp_path / "model"
    assert import_cli(capsys, "--gguf", tiny_gguf, "--dest", dest) == (0, [])
    before = (dest / "model.safetensors").read_bytes()
    rc, errors = import_cli(capsys, "--gguf", tmp_path / "typo.gguf", "--dest", dest)
    assert rc == 2 and errors == [f"error: GGUF file not found: {tmp_path / 'typo.gguf'}"]
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes() + b"\0")  # another file (a byte of padding past the data)
    rc, errors = import_cli(capsys, "--gguf", other, "--dest", dest)
    assert rc == 2 and len(errors) == 1
    assert f"holds the import of {tiny_gguf.name}" in errors[0] and "--force" in errors[0]
    assert (dest / "model.safetensors").read_bytes() == before
