"""`driftgate bench vllm`: our side of the comparison, the statistics, vLLM's refusals, and (where a
Python with vLLM exists: scripts/setup_vllm_cpu.sh) a real checkpoint through both engines."""

from __future__ import annotations

import pytest
import torch

from bench.vllm_interop import (
    EngineRun,
    Tokens,
    VllmFailed,
    VllmUnavailable,
    compare,
    failure_reason,
    kernels_chosen,
    logprob_gap,
    run_driftgate,
    run_vllm,
    vllm_python,
)
from engine import LLM

WINDOWS = [[5, 17, 42, 99, 3, 250, 7, 64], [128, 11, 200, 31, 8, 77, 150, 19, 240]]
PROMPTS = [[3, 9, 27, 81], [2, 4, 8, 16, 32]]


def test_our_side_scores_each_token_after_the_first_as_the_full_logprobs_do(tiny_model_dir):
    """Entry i of a window's row is log p(token i+1 | tokens ≤ i), read where score_full_logprobs puts it."""
    run = run_driftgate(tiny_model_dir, Tokens(WINDOWS, PROMPTS, 5), dtype="float32", kv_cache_dtype="auto",
                        max_model_len=64)
    llm = LLM(str(tiny_model_dir))
    for ids, row in zip(WINDOWS, run.logprobs, strict=True):
        full = llm.score_full_logprobs(ids)
        expected = full[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(torch.tensor(row), expected, atol=1e-5, rtol=0)
    assert [len(g) for g in run.greedy] == [5, 5] and run.kv_cache_dtype == "auto"


def test_gap_and_agreement_of_two_runs(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    a = EngineRun([[-1.0, -2.0], [-0.5]], [[1, 2, 3], [4, 5, 6]], "auto")
    b = EngineRun([[-1.5, -2.0], [-0.5]], [[1, 2, 3], [4, 9, 6]], "fp8")
    gap = logprob_gap(a, b)
    assert gap["mean_abs"] == pytest.approx(0.5 / 3) and gap["max_abs"] == 0.5
    assert gap["nll_a"] == pytest.approx(3.5 / 3) and gap["nll_b"] == pytest.approx(4.0 / 3)
    row = compare("x", tmp_path, a, a, b, base=b, error=None)
    assert row["vllm"]["greedy"] == {"identical": 1, "of": 2, "mean_agreed_prefix": 2.0}
    assert row["vllm"]["kv_cache_dtype"] == "fp8" and row["vllm"]["nll"] == pytest.approx(4.0 / 3)
    assert row["vs_unquantized"]["logprob_gap"]["max_abs"] == 0.5
    assert row["driftgate_fp32"]["logprob_gap"]["max_abs"] == 0 and row["driftgate_fp32"]["greedy"]["identical"] == 2
    assert row["quantization"] is None and row["driftgate_nll"] == pytest.approx(3.5 / 3)
    refused = compare("y", tmp_path, a, b, None, None, "no kernel")
    assert refused["vllm_error"] == "no kernel" and "vllm" not in refused and "vs_unquantized" not in refused
    assert refused["driftgate_fp32"]["logprob_gap"]["mean_abs"] == pytest.approx(0.5 / 3)
    with pytest.raises(ValueError, match="scored 3 and 2 tokens"):
        logprob_gap(a, EngineRun([[-1.0, -2.0]], [], "auto"))


def test_a_refusal_is_vllms_own_reason():
    """What vLLM 0.32's CPU build logged for a w8a16 checkpoint: the root error with the lines its
    message runs on, not the engine's generic wrapper."""
    worker = "(Worker pid=14787) ERROR 12-06 15:27:31 [multiproc_executor.py:953] "
    log = "\n".join([
        worker + "Traceback (most recent call last):",
        worker + '  File "vllm/model_executor/kernels/linear/__init__.py", line 930, in choose_mp_linear_kernel',
        worker + "    raise ValueError(",
        worker + "ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: ",
        worker + " CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported",
        "(EngineCore pid=14769) INFO 12-06 15:27:32 [multiproc_executor.py:479] [shutdown] Executor: waiting",
        "(EngineCore pid=14769) ERROR 12-06 15:27:34 [core.py:1510] EngineCore failed to start.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert failure_reason(log) == ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
                                   "Reasons: CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) "
                                   "not supported")
    assert failure_reason("loading...\nKilled\n") == "Killed"
    chosen = "\n".join([
        "(Worker pid=14381) INFO 12-06 15:15:55 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear",
        "(Worker pid=14381) INFO 12-06 15:15:55 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for "
        "CompressedTensorsWNA16",
        "(Worker pid=14381) INFO 12-06 15:15:56 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear",
        "(EngineCore pid=14369) INFO 12-06 15:15:59 [utils.py:347] Using LBHNC KV cache layout.",
        "(Worker pid=14282) INFO 12-06 15:15:17 [__init__.py:846] Selected CPUInt8ScaledMMLinearKernel for "
        "CompressedTensorsW8A8Int8"])
    assert kernels_chosen(chosen) == ["Using CPUWNA16LinearKernel for mixed-precision linear",
                                      "Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
                                      "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"]
    assert failure_reason("") == "no output"


def test_without_vllm_the_message_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))
    monkeypatch.delenv("DRIFTGATE_VLLM_PYTHON", raising=False)
    with pytest.raises(VllmUnavailable, match="scripts/setup_vllm_cpu.sh"):
        vllm_python(None)
    monkeypatch.setenv("DRIFTGATE_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(VllmUnavailable, match="nowhere"):
        vllm_python(None)
    # a "Python" that never answers, with a worker process of its own as vLLM has: both are ended
    hang = tmp_path / "hang"
    hang.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path}/worker.pid\nwait\n")
    hang.chmod(0o755)
    with pytest.raises(VllmFailed, match="no result within 1 s"):
        run_vllm(hang, tmp_path, Tokens(WINDOWS, PROMPTS, 2), dtype="bfloat16", kv_cache_dtype="auto",
                 max_model_len=64, timeout_s=1)
    assert not _running(int((tmp_path / "worker.pid").read_text()))


def _running(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` still runs after up to `wait_s` (a killed process may stay a zombie until reaped)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


@pytest.mark.real_model
def test_vllm_reads_our_w4a16_checkpoint_as_we_do(real_model_dir, tmp_path):
    """A W4A16 checkpoint from `quantize` through vLLM's CPU build and through driftgate: on the
    same tokens the two engines differ by about what driftgate's own bf16 and fp32 runs of it
    differ by, far less than quantization moved the model. (A nibble order, scale or zero point
    read otherwise would put the engines as far apart as the quantized and unquantized models.)"""
    from calibration.cli import main as quantize
    from tests.calibration.factories import write_calib_file

    try:
        python = vllm_python(None)
    except VllmUnavailable as exc:
        pytest.skip(str(exc))
    checkpoint = tmp_path / "w4a16"
    assert quantize([str(real_model_dir), "--calib", str(write_calib_file(tmp_path / "calib.jsonl", 8)), "-o",
                     str(checkpoint), "--scheme", "w4a16", "--algo", "rtn", "--num-samples", "8",
                     "--num-heldout", "0"]) == 0
    llm = LLM(str(real_model_dir), max_model_len=512)
    text = llm.tokenizer.encode(" ".join(["The engine stores keys and values in blocks of sixteen tokens, and the "
                                          "scheduler admits a waiting request when its blocks fit."] * 12))
    tokens = Tokens([text[i:i + 128] for i in range(0, 384, 128)],
                    [llm.tokenizer.encode("Question: what is 12 times 7? Answer:")], 16)
    settings = {"kv_cache_dtype": "auto", "max_model_len": 512}
    ours = run_driftgate(checkpoint, tokens, dtype="bfloat16", **settings)
    ours_fp32 = run_driftgate(checkpoint, tokens, dtype="float32", **settings)
    base = run_driftgate(real_model_dir, tokens, dtype="bfloat16", **settings)
    theirs = run_vllm(python, checkpoint, tokens, dtype="bfloat16", timeout_s=600, **settings)
    assert any("WNA16" in kernel for kernel in theirs.kernels)
    engines, floor, moved = (logprob_gap(ours, other)["mean_abs"] for other in (theirs, ours_fp32, base))
    assert engines < 2 * floor + 0.05 and engines < moved / 3, (engines, floor, moved)
