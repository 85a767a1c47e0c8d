"""`driftgate gate` end to end on the tiny model: exit codes, reports, verdict, baseline cache."""

from __future__ import annotations

import argparse
import json
import shutil
from xml.etree import ElementTree

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals import data, verdict
from evals.cli import EXIT_DRIFT, EXIT_ERROR, EXIT_PASS, add_gate_args, run_gate
from tests.helpers import make_tiny_model_dir

TINY_POLICY = """
[engine]
max_model_len = 512
[noise_floor]
max_num_batched_tokens = 64
[tier0]
num_documents = 1
max_tokens_per_sequence = 128
[tier1]
max_pooled_drop = 0.5
max_flip_rate_above_floor = 0.2
max_confident_flip_rate = 1.0
[[tier1.tasks]]
name = "driftgate_arc_easy"
metric = "acc_norm,none"
items = 8
[[tier1.tasks]]
name = "driftgate_piqa"
metric = "acc,none"
items = 8
[[tier1.tasks]]
name = "driftgate_gsm8k_cot"
metric = "exact_match,strict-match"
items = 2
[tier2]
num_prompts = 1
max_new_tokens = 8
min_mean_agreed_prefix = 1
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("gate")
    baseline = make_tiny_model_dir(root / "baseline")
    policy = root / "tiny.toml"
    policy.write_text(TINY_POLICY)
    return root, baseline, policy


def _gate(baseline, candidate, policy, root, *extra):
    parser = argparse.ArgumentParser()
    add_gate_args(parser)
    args = parser.parse_args(["--baseline", str(baseline), "--candidate", str(candidate), "--policy", str(policy),
                              "--cache-dir", str(root / "cache"), "--report-dir", str(root / "report"), *extra])
    return run_gate(args)


def test_missing_candidate_is_exit_2(setup, capsys):
    root, baseline, policy = setup
    assert _gate(baseline, root / "nope", policy, root) == EXIT_ERROR
    assert "candidate directory" in capsys.readouterr().err


def test_corrupt_safetensors_is_exit_2(setup, capsys):
    root, baseline, policy = setup
    bad = root / "corrupt"
    shutil.copytree(baseline, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    assert _gate(baseline, bad, policy, root) == EXIT_ERROR
    assert "not readable safetensors" in capsys.readouterr().err


def test_a_sequence_classifier_or_a_broken_config_is_exit_2(setup, capsys):
    root, baseline, policy = setup
    classifier = make_tiny_model_dir(root / "classifier", architecture="LlamaForSequenceClassification")
    assert _gate(baseline, classifier, policy, root) == EXIT_ERROR
    assert "is a sequence classifier (LlamaForSequenceClassification), which does not generate" in \
        capsys.readouterr().err
    (classifier / "config.json").write_text("{not json")
    assert _gate(baseline, classifier, policy, root) == EXIT_ERROR
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_bad_policy_key_is_exit_2_and_named(setup, capsys):
    root, baseline, _ = setup
    policy = root / "typo.toml"
    policy.write_text(TINY_POLICY.replace("max_pooled_drop", "max_poled_drop"))
    assert _gate(baseline, baseline, policy, root) == EXIT_ERROR
    assert "tier1.max_poled_drop" in capsys.readouterr().err


def test_missing_data_file_is_exit_2(setup, tmp_path, capsys):
    root, baseline, policy = setup
    (tmp_path / "arc").mkdir()
    assert _gate(baseline, baseline, policy, root, "--data-dir", str(tmp_path)) == EXIT_ERROR
    assert "missing data file" in capsys.readouterr().err


@pytest.mark.parametrize(("policy_text", "message"), [
    (TINY_POLICY.replace("max_new_tokens = 8", 'max_new_tokens = "8"'), "tier2.max_new_tokens must be an integer"),
    (TINY_POLICY.replace('"driftgate_arc_easy"', '"driftgate_arc_eazy"'),
     "unknown task 'driftgate_arc_eazy' in the policy; known tasks: driftgate_arc_challenge"),
    (TINY_POLICY.replace("[tier2]", "# caf\xe9\n[tier2]").encode("latin-1"), "is not UTF-8 text"),
])
def test_a_bad_policy_is_exit_2_without_a_traceback(setup, tmp_path, capsys, policy_text, message):
    root, baseline, _ = setup
    policy = tmp_path / "bad.toml"
    policy.write_bytes(policy_text if isinstance(policy_text, bytes) else policy_text.encode())
    assert _gate(baseline, baseline, policy, root) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "cannot evaluate" in err and message in err and "Traceback" not in err


def test_a_folder_as_policy_says_so(setup, tmp_path, capsys):
    root, baseline, _ = setup
    assert _gate(baseline, baseline, tmp_path, root) == EXIT_ERROR
    assert f"policy {tmp_path} is a folder; give a TOML file" in capsys.readouterr().err


def test_a_report_dir_that_cannot_be_created_is_exit_2_before_any_arm_runs(setup, tmp_path, capsys, monkeypatch):
    """The reports are written last; a bad --report-dir must not cost the arms' run first."""
    from evals import arms

    monkeypatch.setattr(arms, "run_arm", lambda *a, **k: pytest.fail("an arm ran before --report-dir was checked"))
    root, baseline, policy = setup
    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    for report_dir in (a_file, a_file / "below"):
        assert _gate(baseline, baseline, policy, root, "--report-dir", str(report_dir)) == EXIT_ERROR
        err = capsys.readouterr().err
        assert f"cannot evaluate: report directory {report_dir} is not a writable directory" in err
        assert "Traceback" not in err


@pytest.mark.slow
def test_self_copy_passes_then_reuses_the_cached_baseline(setup, capsys):
    root, baseline, policy = setup
    candidate = root / "copy"
    shutil.copytree(baseline, candidate)
    assert _gate(baseline, candidate, policy, root) == EXIT_PASS
    verdict.check_verdict(candidate)
    judged = json.loads((candidate / "verdict.json").read_text())["serving"]
    assert judged == {"dtype": "float32", "kv_cache_dtype": "auto", "kv_scales": None}  # what serve --require-gate compares
    report = json.loads((root / "report" / "report.json").read_text())
    assert report["verdict"] == "pass"
    assert report["tier1"]["pooled"]["right_to_wrong"] == 0 and report["tier1"]["pooled"]["wrong_to_right"] == 0
    point_checks = [c for c in report["checks"] if c["name"].startswith(("tier0.", "tier2."))]
    assert len(point_checks) >= 4 and all(c["interval"] is not None and not c["marginal"] for c in point_checks)
    assert "[gate] verdict PASS; reports in" in capsys.readouterr().out  # a marginal check would be named here
    assert (root / "report" / "report.md").read_text().startswith("# Gate verdict: **PASS**")
    assert "data:image/png;base64" in (root / "report" / "report.html").read_text()
    assert ElementTree.parse(root / "report" / "report.junit.xml").getroot().get("failures") == "0"
    assert not report["manifest"]["baseline_cached"]
    prefix = report["manifest"]["prefix_cache"]
    assert set(prefix) == {"baseline", "noise_floor", "candidate"}
    for arm in prefix.values():  # each ARC item's four choices share its context: the cache serves part of it
        assert 0 < arm["prefill_tokens_saved"] < arm["task_prompt_tokens"]
    assert "Prefill tokens saved by the prefix cache" in (root / "report" / "report.md").read_text()
    by_length = report["tier2_accuracy_by_length"]
    assert list(by_length) == ["driftgate_gsm8k_cot"] and sum(b["num_items"] for b in by_length[
        "driftgate_gsm8k_cot"]) == 2  # the generative task, paired per item
    capsys.readouterr()
    assert _gate(baseline, candidate, policy, root) == EXIT_PASS
    assert "baseline: cached" in capsys.readouterr().out


def test_own_prompts_drive_tier2_and_a_bad_line_stops_the_gate_at_once(setup, capsys):
    """--prompts: the user's request bodies are Tier 2's prompts (and, with the baseline's
    generations, Tier 0's sequences); those that say what they expect are judged right or wrong in
    both arms and paired; the report says so; the baseline cache keys on them; a bad line is exit
    2 naming it, before either model runs."""
    root, baseline, policy = setup
    traffic = root / "traffic.jsonl"
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick"}]}
    traffic.write_text("\n".join(json.dumps(line) for line in (chat, {"prompt": "brown fox", "expected": "the"},
                                                                {"custom_id": "1", "body": {"prompt": "jumps"},
                                                                 "expected": ["over", "a"]})))
    candidate = root / "copy-prompts"
    shutil.copytree(baseline, candidate)
    # two labelled prompts cannot bound a drop below the margin: inconclusive, and the policy fails closed
    assert _gate(baseline, candidate, policy, root, "--prompts", str(traffic)) == EXIT_DRIFT
    report = json.loads((root / "report" / "report.json").read_text())
    assert [(c["name"], c["status"]) for c in report["checks"] if c["status"] != "pass"] == [
        ("tier2.expected_answers", "inconclusive")]
    assert report["tier2"]["num_prompts"] == 3 and report["tier2"]["num_identical"] == 3  # GSM8K gives 1 here
    assert report["manifest"]["tier2_prompts"] == {"source": str(traffic.resolve()),
                                                   "sha256": data.file_sha256(traffic)}
    assert f"(prompts: {traffic.resolve()})" in (root / "report" / "report.md").read_text()
    answers = report["tier2_expected_answers"]  # the two lines that say what they expect, paired
    assert answers["n"] == 2 and answers["right_to_wrong"] == answers["wrong_to_right"] == 0
    assert "tier2.expected_answers" in {c["name"] for c in report["checks"]}
    assert "baseline: cached" not in capsys.readouterr().out  # not GSM8K's cached baseline
    bad = root / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"messages": "not a list"}\n')
    assert _gate(baseline, candidate, policy, root, "--prompts", str(bad)) == EXIT_ERROR
    err = capsys.readouterr()
    assert "bad.jsonl:2: messages" in err.err and "[gate] candidate" not in err.out


def test_the_candidate_is_judged_in_the_dtype_it_will_be_served(setup, capsys):
    """--dtype bfloat16 (a GPU's auto) runs the candidate so, against the baseline at auto, and
    the verdict binds it: serve --require-gate takes that dtype and refuses fp32. Numeric flags
    with --server (whose numerics are its server's) and a --device this machine lacks are exit 2."""
    from engine.config import serving_setting

    root, baseline, policy = setup
    candidate = root / "copy-bf16"
    shutil.copytree(baseline, candidate)
    assert _gate(baseline, candidate, policy, root, "--dtype", "bfloat16", "--device", "cpu") == EXIT_PASS
    assert "[gate] candidate: lm-eval" in capsys.readouterr().out
    report = json.loads((root / "report" / "report.json").read_text())
    assert report["tier0"]["overall"]["kl_mean"] > 0  # a self-copy in fp32 scores exactly 0: it did run in bf16
    manifest = report["manifest"]
    assert (manifest["device"], manifest["dtype"], manifest["kv_cache_dtype"]) == ("cpu", "bfloat16", "auto")
    assert "Candidate judged on cpu with bfloat16 activations and KV cache auto." in \
        (root / "report" / "report.md").read_text()
    body = json.loads((candidate / "verdict.json").read_text())
    assert body["serving"] == serving_setting(str(candidate), "bfloat16", "cpu", "auto", "checkpoint")
    verdict.check_verdict(candidate, serving_setting(str(candidate), "bfloat16", "cpu", "auto", "checkpoint"))
    with pytest.raises(verdict.VerdictError, match="bfloat16 activations and KV cache auto, not float32"):
        verdict.check_verdict(candidate, serving_setting(str(candidate), "auto", "cpu", "auto", "checkpoint"))
    for flags, named in ((["--server", "http://127.0.0.1:9", "--dtype", "bfloat16"], "--dtype set an in-process"),
                         (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto, got 'tpu'")):
        assert _gate(baseline, candidate, policy, root, *flags) == EXIT_ERROR
        assert named in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert _gate(baseline, candidate, policy, root, "--device", "cuda") == EXIT_ERROR
        assert "torch sees no CUDA device here" in capsys.readouterr().err


@pytest.mark.slow
def test_damaged_checkpoint_fails_with_a_failing_verdict(setup, capsys):
    root, baseline, policy = setup
    damaged = root / "damaged"
    shutil.copytree(baseline, damaged)
    tensors = load_file(damaged / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            tensors[name] = tensor + torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    assert _gate(baseline, damaged, policy, root) == EXIT_DRIFT
    report = json.loads((root / "report" / "report.json").read_text())
    failed = {c["name"] for c in report["checks"] if c["status"] in ("fail", "inconclusive")}
    assert failed & {"tier1.pooled_drop", "tier1.flip_rate_above_floor", "tier2.mean_agreed_prefix"}
    marginal = [c["name"] for c in report["checks"] if c["marginal"]]
    verdict_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[gate] verdict"))
    assert verdict_line.startswith("[gate] verdict FAIL" + (f" (marginal: {', '.join(marginal)})" if marginal else "")
                                   + "; reports in")
    (parted,) = report["tier2_divergences"]  # the one Tier 2 prompt, shown where the arms part
    assert f"parts after {parted['position']} tokens" in (root / "report" / "report.md").read_text()
    suite = ElementTree.parse(root / "report" / "report.junit.xml").getroot()  # for CI test reporters
    assert int(suite.get("tests")) == len(report["checks"])
    assert {case.get("name") for case in suite if case.find("failure") is not None} == failed
    with pytest.raises(verdict.VerdictError, match="failing"):
        verdict.check_verdict(damaged)


@pytest.fixture(scope="module")
def served_baseline(setup):
    """The tiny baseline model behind a live OpenAI-compatible server: a deployed candidate."""
    from engine import AsyncEngine, EngineConfig
    from server.app import build_app
    from server.config import ServerConfig
    from tests.server.live import serve_in_thread

    _, baseline, _ = setup
    engine = AsyncEngine(EngineConfig(model=str(baseline), max_num_seqs=8, max_num_batched_tokens=512, seed=0))
    engine.start()
    try:
        config = ServerConfig(served_model_name="served", model_root=str(baseline.resolve()))
        with serve_in_thread(build_app(engine, config)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_gating_a_live_server_scores_what_it_serves(setup, served_baseline):
    root, baseline, policy = setup
    assert _gate(baseline, baseline, policy, root, "--server", served_baseline) == EXIT_PASS
    report = json.loads((root / "report" / "report.json").read_text())
    assert report["manifest"]["candidate_server"]["url"] == served_baseline
    assert report["manifest"]["candidate_server"]["model"]["id"] == "served"
    assert report["manifest"]["candidate_server"]["exact_token_ids"]  # our server returns token ids
    assert report["manifest"]["candidate_server"]["serves_candidate"]  # its model card names the folder
    # Same weights over HTTP: every choice's log-likelihood equals the in-process baseline's.
    base, cand = report["items"]["baseline"], report["items"]["candidate"]
    compared = 0
    for task, rows in base.items():
        served = {row["doc_id"]: row for row in cand[task]}
        for row in rows:
            assert served[row["doc_id"]]["choice_logprobs"] == pytest.approx(row["choice_logprobs"], abs=1e-3)
            compared += 1
    assert compared == 16 + 2
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["tier0"]["status"] == "skipped" and "HTTP" in checks["tier0"]["detail"]
    assert checks["tier2.mean_agreed_prefix"]["status"] == "pass"
    assert report["tier2"]["num_identical"] == report["tier2"]["num_prompts"] == 1


@pytest.mark.slow
def test_gating_a_live_server_on_own_prompts(setup, served_baseline, tmp_path):
    """--prompts with --server: the served arm generates from the user's prompts and its answers
    are judged against the expected ones (end-of-sequence ids read from the candidate's folder)."""
    root, baseline, policy = setup
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(json.dumps(line) for line in (
        {"messages": [{"role": "user", "content": "the quick"}], "expected": "the"}, {"prompt": "brown fox"})))
    loose = tmp_path / "loose.toml"  # one labelled prompt: let the undecided endpoint warn, not fail
    loose.write_text("inconclusive = \"pass\"\n" + TINY_POLICY)
    assert _gate(baseline, baseline, loose, root, "--server", served_baseline, "--prompts", str(traffic)) == EXIT_PASS
    report = json.loads((root / "report" / "report.json").read_text())
    assert report["tier2"]["num_identical"] == report["tier2"]["num_prompts"] == 2
    answers = report["tier2_expected_answers"]
    assert answers["n"] == 1 and answers["baseline_acc"] == answers["candidate_acc"]
    assert {c["name"]: c["status"] for c in report["checks"]}["tier2.expected_answers"] == "warn"


def test_servers_without_token_ids_fall_back_to_text():
    from evals import remote

    assert remote._token_ids({"logprobs": {"tokens": ["token_id:5", "token_id:17"]}}) == [5, 17]
    assert remote._token_ids({"logprobs": {"tokens": ["Hello", " world"]}}) is None  # the extension was ignored
    assert remote._token_ids({"text": "Hello world", "logprobs": None}) is None


def test_a_server_that_is_not_openai_compatible_is_exit_2(setup, capsys):
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from tests.server.live import serve_in_thread

    root, baseline, policy = setup
    app = FastAPI()
    app.get("/v1/models")(lambda: PlainTextResponse("a web page, not a model list"))
    with serve_in_thread(app) as url:
        assert _gate(baseline, baseline, policy, root, "--server", url) == EXIT_ERROR
    assert "did not answer with an OpenAI model list" in capsys.readouterr().err


def test_unreachable_server_is_exit_2(setup, capsys):
    root, baseline, policy = setup
    assert _gate(baseline, baseline, policy, root, "--server", "http://127.0.0.1:9") == EXIT_ERROR
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_server_with_a_shorter_context_than_the_policy_is_exit_2(setup, served_baseline, capsys):
    import httpx

    root, baseline, _ = setup
    served_len = httpx.get(served_baseline + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    policy = root / "long.toml"
    policy.write_text(TINY_POLICY.replace("max_model_len = 512", f"max_model_len = {served_len + 1}"))
    assert _gate(baseline, baseline, policy, root, "--server", served_baseline) == EXIT_ERROR
    assert f"max_model_len {served_len} is below the policy's {served_len + 1}" in capsys.readouterr().err


def test_an_adapter_is_gated_over_both_arms(setup, tmp_path, capsys):
    """--lora: both arms answer through the adapter (its own baseline cache entry), the report
    names it with its hashes; a folder that is no adapter, or --lora with --server, is exit 2."""
    pytest.importorskip("peft")
    from tests.helpers import write_lora_adapter

    root, baseline, policy = setup
    adapter = write_lora_adapter(baseline, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=2)
    candidate = root / "copy-for-lora"
    shutil.copytree(baseline, candidate, dirs_exist_ok=True)
    (candidate / "verdict.json").unlink(missing_ok=True)  # the baseline folder may hold one from an earlier gate
    capsys.readouterr()
    assert _gate(baseline, candidate, policy, root, "--lora", str(adapter)) == EXIT_PASS
    assert "baseline: cached" not in capsys.readouterr().out  # not the plain baseline's entry
    manifest = json.loads((root / "report" / "report.json").read_text())["manifest"]
    assert manifest["lora"]["dir"] == str(adapter.resolve())
    assert set(manifest["lora"]["sha256"]) == {"adapter_config.json", "adapter_model.safetensors"}
    # the adapter's verdict is its own, bound to the checkpoint it ran over; the checkpoint's is not touched
    assert not (candidate / "verdict.json").exists()
    verdict.check_verdict(adapter, base_hashes=verdict.weight_hashes(candidate))
    with pytest.raises(verdict.VerdictError, match="over another checkpoint"):
        verdict.check_verdict(adapter, base_hashes=verdict.weight_hashes(make_tiny_model_dir(tmp_path / "other-base",
                                                                                              seed=1)))
    from engine import SamplingParams
    from evals import arms
    from evals.policy import load_policy

    prompt = [[5 + (7 * j) % 300 for j in range(24)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    answers = [arms.build_engine(baseline, load_policy(policy), lora=lora).generate(prompt, greedy, use_tqdm=False)
               [0].outputs[0].token_ids for lora in (adapter, None)]
    assert answers[0] != answers[1]  # the arms answer through the adapter
    assert _gate(baseline, candidate, policy, root, "--lora", str(tmp_path)) == EXIT_ERROR
    assert "not a PEFT LoRA adapter folder" in capsys.readouterr().err
    assert _gate(baseline, candidate, policy, root, "--lora", str(adapter), "--server",
                 "http://127.0.0.1:9") == EXIT_ERROR
    assert "--lora gates local arms" in capsys.readouterr().err


def test_a_pair_the_gate_cannot_compare_is_exit_2_before_any_arm_runs(setup, tmp_path, capsys, monkeypatch):
    """One folder twice, another vocabulary, or a tokenizer that splits text otherwise: refused up front
    (other vocabularies crashed after both arms ran; another tokenizer passed silently); a quantized
    baseline against an unquantized candidate, probably a swap, is said."""
    from evals import arms

    root, baseline, policy = setup

    def no_arms(*args, **kwargs):
        raise AssertionError("an arm ran for a pair that cannot be compared")

    monkeypatch.setattr(arms, "run_arm", no_arms)
    assert _gate(baseline, baseline, policy, root) == EXIT_ERROR
    assert "baseline and candidate are the same folder" in capsys.readouterr().err
    vocab = shutil.copytree(baseline, tmp_path / "vocab")
    config = json.loads((vocab / "config.json").read_text())
    (vocab / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 1}))
    assert _gate(baseline, vocab, policy, root) == EXIT_ERROR
    assert f"other vocabularies (vocab_size {config['vocab_size']} and {config['vocab_size'] - 1})" in \
        capsys.readouterr().err
    lowercase = shutil.copytree(baseline, tmp_path / "lowercase")
    spec = json.loads((lowercase / "tokenizer.json").read_text())
    (lowercase / "tokenizer.json").write_text(json.dumps({**spec, "normalizer": {"type": "Lowercase"}}))
    assert _gate(baseline, lowercase, policy, root) == EXIT_ERROR
    assert "baseline and candidate tokenize 'The Quick brown FOX" in capsys.readouterr().err
    swapped = shutil.copytree(baseline, tmp_path / "swapped")
    (swapped / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    assert _gate(swapped, shutil.copytree(baseline, tmp_path / "plain"), policy, root) == EXIT_ERROR
    err = capsys.readouterr().err  # warned, then went on to run the arms (here: the stub's refusal)
    assert "were --baseline and --candidate swapped?" in err and "an arm ran" in err


FAST_POLICY = """
inconclusive = "pass"
[engine]
max_model_len = 512
[noise_floor]
enabled = false
[tier0]
enabled = false
[tier2]
enabled = false
[tier1]
max_pooled_drop = 0.5
[[tier1.tasks]]
name = "driftgate_piqa"
metric = "acc,none"
items = 6
"""


@pytest.fixture(scope="module")
def fast_policy(setup):
    root, _, _ = setup
    path = root / "fast.toml"
    path.write_text(FAST_POLICY)
    return path


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_baseline_whose_config_changed_is_not_answered_from_the_cache(setup, fast_policy, tmp_path, capsys):
    root, baseline, _ = setup
    candidate, edited = tmp_path / "candidate", tmp_path / "baseline"
    shutil.copytree(baseline, candidate)
    shutil.copytree(baseline, edited)
    assert _gate(edited, candidate, fast_policy, tmp_path) == EXIT_PASS
    capsys.readouterr()
    _edit_config(edited, rms_norm_eps=0.5)  # same weights, other outputs
    _gate(edited, candidate, fast_policy, tmp_path)
    assert "baseline: cached" not in capsys.readouterr().out


def test_the_verdict_comes_before_the_reports_and_binds_the_files_as_the_arm_loaded_them(
        setup, fast_policy, tmp_path, monkeypatch, capsys):
    """A re-gate whose reports fail to write leaves its own verdict, not the previous one; a config
    edited while the gate runs is not blessed (the verdict holds the hashes taken before the arms)."""
    from evals import arms, report

    root, baseline, _ = setup
    candidate = tmp_path / "candidate"
    shutil.copytree(baseline, candidate)
    strict = tmp_path / "strict.toml"  # no drop allowed: a copy's drop of 0 is undecided, and that fails closed
    strict.write_text(FAST_POLICY.replace('inconclusive = "pass"', 'inconclusive = "fail"')
                      .replace("max_pooled_drop = 0.5", "max_pooled_drop = 0.0"))
    verdict.write_verdict(candidate, passed=True, policy={}, metrics={}, baseline_hashes={})  # an earlier PASS
    run_arm = arms.run_arm

    def edit_during_the_run(model_dir, *args, **kwargs):
        result = run_arm(model_dir, *args, **kwargs)
        if kwargs.get("label") == "candidate":
            _edit_config(candidate, rms_norm_eps=0.25)
        return result

    def unwritable(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(arms, "run_arm", edit_during_the_run)
    monkeypatch.setattr(report, "write_reports", unwritable)
    assert _gate(baseline, candidate, strict, tmp_path) == EXIT_ERROR
    assert "disk full" in capsys.readouterr().err
    recorded = json.loads((candidate / "verdict.json").read_text())
    assert recorded["verdict"] == "fail" and recorded["policy"]["name"] == "strict"
    assert recorded["config_sha256"]["config.json"] == verdict.config_hashes(baseline)["config.json"]


def test_a_server_serving_other_files_than_the_candidate_is_refused(setup, served_baseline, tmp_path, capsys):
    """The verdict binds --candidate's files: a server answering with another folder's is refused
    before any arm runs (a byte copy of the served folder is accepted)."""
    root, baseline, policy = setup
    other = tmp_path / "other"
    shutil.copytree(baseline, other, ignore=shutil.ignore_patterns("verdict.json"))
    _edit_config(other, rms_norm_eps=0.5)
    assert _gate(baseline, other, policy, tmp_path, "--server", served_baseline) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "whose config, tokenizer or chat template differ from --candidate" in err
    assert not (other / "verdict.json").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-cache-dtype", "fp8_e5m2", "--kv-scales", "dynamic"], "only applies to an fp8 e4m3 KV cache"),
    (["--kv-cache-dtype", "fp8"], "cannot run as asked: kv_cache_dtype=fp8 needs calibrated k/v scales"),
])
def test_kv_cache_settings_the_candidate_cannot_take_are_exit_2_without_a_traceback(setup, fast_policy, capsys,
                                                                                     flags, message):
    root, baseline, _ = setup
    copy = root / "kv-copy"
    if not copy.exists():
        shutil.copytree(baseline, copy)
    assert _gate(baseline, copy, fast_policy, root, *flags) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "cannot evaluate" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize(("change", "message"), [
    (('metric = "acc,none"', 'metric = "acc,strict-match"'), "metric 'acc,strict-match' is not one it reports"),
    (("items = 6", "items = 100000"), "items = 100000, but its set holds"),
])
def test_a_metric_the_task_does_not_report_or_more_items_than_it_has_are_exit_2(setup, tmp_path, capsys,
                                                                                monkeypatch, change, message):
    from evals import arms

    root, baseline, _ = setup
    policy = tmp_path / "bad.toml"
    policy.write_text(FAST_POLICY.replace(*change))
    monkeypatch.setattr(arms, "run_arm", lambda *a, **k: pytest.fail("an arm ran before the policy was checked"))
    candidate = tmp_path / "candidate"
    shutil.copytree(baseline, candidate)
    assert _gate(baseline, candidate, policy, root) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "cannot evaluate" in err and message in err


def test_ctrl_c_is_exit_130_with_one_line(setup, fast_policy, monkeypatch, capsys):
    from evals import arms

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    root, baseline, _ = setup
    monkeypatch.setattr(arms, "run_arm", interrupted)
    copy = root / "ctrl-c"
    shutil.copytree(baseline, copy)
    assert _gate(baseline, copy, fast_policy, root) == 130
    err = capsys.readouterr().err
    assert "interrupted; no verdict written" in err and "Traceback" not in err


def test_a_candidate_with_nan_weights_fails_with_a_report(setup, tmp_path, capsys):
    """NaN logits are a broken checkpoint: a FAIL with its report (Tier 0 names the arm), never a
    crash, and no item of it counts as answered."""
    root, baseline, _ = setup
    broken = tmp_path / "nan"
    shutil.copytree(baseline, broken, ignore=shutil.ignore_patterns("verdict.json"))
    tensors = load_file(broken / "model.safetensors")
    name = next(n for n in tensors if n.endswith("layers.1.mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    policy = tmp_path / "tier0.toml"
    policy.write_text(FAST_POLICY.replace("[tier0]\nenabled = false", "[tier0]\nnum_documents = 1\n"
                                          "max_tokens_per_sequence = 64"))
    assert _gate(baseline, broken, policy, tmp_path) == EXIT_DRIFT
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["tier0.finite_logits"]["status"] == "fail" and "candidate" in checks["tier0.finite_logits"]["detail"]
    assert not any(item["correct"] for item in report["items"]["candidate"]["driftgate_piqa"])
    assert "Traceback" not in capsys.readouterr().err
