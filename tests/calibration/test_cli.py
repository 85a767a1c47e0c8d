"""The ``quantize`` command: user errors are one line and exit 2 with nothing written; success reloads."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from calibration.cli import main
from tests.calibration.factories import write_calib_file, write_jsonl


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    return write_calib_file(tmp_path_factory.mktemp("calib") / "calib.jsonl", 24)


def _quantize(model_dir, calib, out, *extra: str) -> int:
    return main([str(model_dir), "--calib", str(calib), "-o", str(out), "--num-samples", "8",
                 "--num-heldout", "4", *extra])


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_malformed_jsonl_names_the_line(tmp_path, tiny_model_dir, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": "ok"}, '{"messages": "not a list"}'])
    assert _quantize(tiny_model_dir, bad, tmp_path / "out", "--scheme", "w4a16") == 2
    line = _one_line_error(capsys)
    assert f"{bad}:3:" in line and '"messages"' in line
    assert not (tmp_path / "out").exists()


def test_empty_calibration_file(tmp_path, tiny_model_dir, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _quantize(tiny_model_dir, empty, tmp_path / "out", "--scheme", "w4a16") == 2
    assert "empty" in _one_line_error(capsys)


def test_missing_model_folder(tmp_path, calib_file, capsys):
    assert _quantize(tmp_path / "no-model", calib_file, tmp_path / "out", "--scheme", "w4a16") == 2
    assert "model folder not found" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_model_without_tokenizer_files_or_a_folder_as_calibration_file_says_so(tmp_path, tiny_model_dir,
                                                                                   calib_file, capsys):
    """transformers blamed a missing sentencepiece for the first; the second read "not found"."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    assert _quantize(bare, calib_file, tmp_path / "out", "--scheme", "w8a16") == 2
    assert "has no tokenizer.json / tokenizer_config.json" in _one_line_error(capsys)
    assert _quantize(tiny_model_dir, tmp_path, tmp_path / "out", "--scheme", "w8a16") == 2
    assert f"{tmp_path} is a folder; give the calibration file itself" in _one_line_error(capsys)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, tiny_model_dir, calib_file, capsys, monkeypatch):
    import calibration.run

    def interrupted(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration.run, "quantize", interrupted)
    assert _quantize(tiny_model_dir, calib_file, tmp_path / "out", "--scheme", "w8a16") == 130
    assert "interrupted; a checkpoint is published whole" in _one_line_error(capsys)


def test_unknown_scheme(tmp_path, tiny_model_dir, calib_file, capsys):
    with pytest.raises(SystemExit) as info:
        _quantize(tiny_model_dir, calib_file, tmp_path / "out", "--scheme", "w3a16")
    assert info.value.code == 2
    assert "invalid choice: 'w3a16'" in _one_line_error(capsys)


def test_group_size_that_does_not_divide(tmp_path, tiny_model_dir, calib_file, capsys):
    assert _quantize(tiny_model_dir, calib_file, tmp_path / "out", "--scheme", "w4a16", "--group-size", "128") == 2
    assert "--group-size 128 does not divide the input size 64" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--scheme", "none"], "--kv-cache fp8"),
    (["--scheme", "fp8-dynamic", "--algo", "gptq"], "--algo gptq applies to"),
    (["--scheme", "w8a16", "--group-size", "64"], "--group-size applies to w4a16"),
    (["--scheme", "w4a16", "--group-size", "48"], "--group-size must be auto or one of"),
    (["--scheme", "w4a16", "--ignore", "model.layers.0.mlp.down_proj"], "keep lm_head in --ignore"),
    (["--scheme", "w4a16", "--ignore", "lm_head", "model.layers.0.self_attn.q_proj"], "all or none"),
    (["--scheme", "w4a16", "--ignore", "lm_head", "re:["], "'re:[' is not a regular expression"),
])
def test_argument_combinations_that_cannot_work(tmp_path, tiny_model_dir, calib_file, capsys, args, message):
    assert _quantize(tiny_model_dir, calib_file, tmp_path / "out", *args) == 2
    assert message in _one_line_error(capsys)


def test_existing_output_is_kept_without_overwrite(tmp_path, tiny_model_dir, calib_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w4a16") == 2
    assert "exists; pass --overwrite" in _one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces a checkpoint, not a folder of other files
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w4a16", "--overwrite") == 2
    assert "holds files but no quantized checkpoint" in _one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w8a16", "--overwrite") == 0  # an empty folder
    capsys.readouterr()
    (out / "keep.txt").write_text("beside the checkpoint")
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w4a16", "--overwrite") == 0
    assert not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left next to it
    report = json.loads((out / "calibration.json").read_text())
    # RTN with no KV scales reads no activations: only the held-out samples ran, for the error report
    assert report["dataset"]["num_tokens_observed"] == 0 and report["layers"][0]["input_absmax"] == {}
    assert report["layers"][0]["output_error"] > 0


def _file_digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_an_output_that_is_or_holds_the_model_is_refused(tmp_path, tiny_model_dir, calib_file, capsys):
    """--overwrite onto the model folder, or onto a folder holding it, would delete what is being read."""
    model = tmp_path / "work" / "model"
    shutil.copytree(tiny_model_dir, model)
    before = _file_digests(model)
    for out in (model, model.parent):
        assert _quantize(model, calib_file, out, "--scheme", "w8a16", "--overwrite") == 2
        assert "is (or holds) the model folder" in _one_line_error(capsys)
    assert _file_digests(model) == before


def test_overwrite_never_deletes_the_calibration_file_or_the_current_folder(tmp_path, tiny_model_dir, calib_file,
                                                                             capsys, monkeypatch):
    out = tmp_path / "out"
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w8a16") == 0
    capsys.readouterr()
    calib = out / "calib.jsonl"
    shutil.copy(calib_file, calib)
    assert _quantize(tiny_model_dir, calib, out, "--scheme", "w8a16", "--overwrite") == 2
    assert "holds the calibration file" in _one_line_error(capsys)
    monkeypatch.chdir(out)
    for here in (Path("."), Path("..") / "out"):
        assert _quantize(tiny_model_dir, calib_file, here, "--scheme", "w8a16", "--overwrite") == 2
        assert "is (or holds) the current folder" in _one_line_error(capsys)
    assert calib.exists() and (out / "config.json").exists()


def test_an_output_that_cannot_be_written_stops_before_calibrating(tmp_path, tiny_model_dir, calib_file, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert _quantize(tiny_model_dir, calib_file, a_file / "out", "--scheme", "w8a16") == 2
    assert f"{a_file} is a file, not a folder" in _one_line_error(capsys)
    assert _quantize(tiny_model_dir, calib_file, a_file, "--scheme", "w8a16", "--overwrite") == 2
    assert f"{a_file} is a file, not a folder" in _one_line_error(capsys)
    assert a_file.read_text() == "mine"


def test_a_quantized_checkpoint_is_not_quantized_again(tmp_path, tiny_model_dir, calib_file, capsys):
    assert _quantize(tiny_model_dir, calib_file, tmp_path / "q", "--scheme", "w8a16") == 0
    capsys.readouterr()
    assert _quantize(tmp_path / "q", calib_file, tmp_path / "qq", "--scheme", "w8a16") == 2
    assert "is already quantized (pack-quantized); quantize the model it came from" in _one_line_error(capsys)


@pytest.mark.parametrize("damage", ["truncated weights", "no num_attention_heads", "a list for a config"])
def test_a_damaged_model_folder_is_one_line(tmp_path, tiny_model_dir, calib_file, capsys, damage):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights, config_path = model / "model.safetensors", model / "config.json"
    config = json.loads(config_path.read_text())
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        expected = "model.safetensors"
    elif damage == "no num_attention_heads":
        del config["num_attention_heads"]
        config_path.write_text(json.dumps(config))
        expected = "config.json lacks 'num_attention_heads'"
    else:
        config_path.write_text(json.dumps([config]))
        expected = "holds a JSON list"
    assert _quantize(model, calib_file, tmp_path / "out", "--scheme", "w8a16") == 2
    assert expected in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_console_script_exit_code(tmp_path, tiny_model_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"text": 1}'])
    proc = subprocess.run([sys.executable, "-m", "calibration.cli", str(tiny_model_dir), "--calib", str(bad),
                           "-o", str(tmp_path / "out"), "--scheme", "w4a16"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f'quantize: error: {bad}:1: "text" is not a non-empty string; '
                                                'expected a JSON object with "messages" (list of {"role", '
                                                '"content"} strings), "prompt" and "completion" (strings), '
                                                'or "text" (string)']


def test_w4a16_with_kv_reloads_and_records_its_run(tmp_path, tiny_model_dir, calib_file):
    from engine.loader import load_model
    from quant.checkpoint import load_kv_scales, read_quantization_config

    out = tmp_path / "w4"
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "w4a16", "--kv-cache", "fp8") == 0
    config = read_quantization_config(out)
    assert config.scheme_for("model.layers.0.mlp.down_proj").weights.group_size == 64  # auto: 128 ∤ 64
    assert config.kv_cache_scheme is not None and config.ignore == ("lm_head",)
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    kv = load_kv_scales(tensors, num_layers=2, num_kv_heads=2)

    report = json.loads((out / "calibration.json").read_text())
    assert report["group_size"] == 64 and report["group_size_requested"] == "auto"
    assert report["dataset"]["num_samples"] == 8 and report["dataset"]["num_heldout"] == 4
    assert report["dataset"]["sha256"] == hashlib.sha256(calib_file.read_bytes()).hexdigest()
    assert report["dataset"]["num_tokens_observed"] == report["dataset"]["num_tokens"] > 8
    assert report["tools"]["torch"].startswith(torch.__version__.split("+")[0])
    assert report["wall_seconds"] > 0
    for layer_idx, layer in enumerate(report["layers"]):
        assert 0 < layer["output_error"] < 1
        assert len(layer["weight_errors"]) == 7  # q, k, v, o, gate, up, down
        k_scale = kv[layer_idx].k.max().item()
        assert k_scale == pytest.approx(max(layer["k_absmax"]) / 448, rel=1e-6)

    model, _ = load_model(out, dtype=torch.float32)
    ids = torch.tensor([5, 17, 42, 9])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(4)))
    assert torch.isfinite(logits).all()


def test_fp8_static_writes_one_input_scale_for_fused_shards(tmp_path, tiny_model_dir, calib_file):
    out = tmp_path / "fp8"
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "fp8-static") == 0
    tensors = load_file(out / "model.safetensors")
    report = json.loads((out / "calibration.json").read_text())
    scales = [tensors[f"model.layers.1.self_attn.{n}_proj.input_scale"] for n in "qkv"]
    assert scales[0].shape == (1,) and all(torch.equal(s, scales[0]) for s in scales)
    absmax = report["layers"][1]["input_absmax"]["self_attn.qkv_proj"]
    assert scales[0].item() == pytest.approx(absmax / 448, rel=1e-6)
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_kv_only_checkpoint_keeps_weights_dense(tmp_path, tiny_model_dir, calib_file):
    out = tmp_path / "kv"
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", "none", "--kv-cache", "fp8",
                     "--kv-scale-strategy", "head") == 0
    tensors = load_file(out / "model.safetensors")
    source = load_file(tiny_model_dir / "model.safetensors")
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], source["model.layers.0.self_attn.q_proj.weight"])
    assert tensors["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"] == {} and config["format"] == "dense"
    assert config["kv_cache_scheme"]["strategy"] == "attn_head"


@pytest.mark.parametrize(("scheme", "algo"), [
    ("fp8-dynamic", "rtn"), ("w8a8-int8", "rtn"), ("w8a8-int8", "gptq"),
    ("w8a16", "rtn"), ("w8a16", "gptq"), ("w8a16", "awq"), ("w4a16", "gptq"), ("w4a16", "awq"),
    ("w4a16-asym", "rtn"), ("w4a16-asym", "gptq"), ("w4a16-asym", "awq"),
    ("w4a8", "rtn"), ("w4a8", "gptq"), ("w4a8", "awq"),
])
def test_every_scheme_and_algorithm_reloads(tmp_path, tiny_model_dir, calib_file, scheme, algo):
    from engine.loader import load_model
    from quant.checkpoint import read_quantization_config

    out = tmp_path / f"{scheme}-{algo}"
    assert _quantize(tiny_model_dir, calib_file, out, "--scheme", scheme, "--algo", algo) == 0
    scheme_read = read_quantization_config(out).scheme_for("model.layers.1.mlp.up_proj")
    assert scheme_read is not None and scheme_read.weights.symmetric == (scheme != "w4a16-asym")
    report = json.loads((out / "calibration.json").read_text())
    assert report["algorithm"] == algo
    assert all(0 < layer["output_error"] < 1 for layer in report["layers"])
    model, _ = load_model(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model.compute_logits(model(torch.tensor([4, 8, 15]), torch.arange(3)))).all()
