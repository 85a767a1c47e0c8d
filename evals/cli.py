"""`driftgate gate`: run both arms, decide, write the reports and the candidate's verdict.

Exit codes: 0 pass, 1 drift (the policy failed), 2 could not evaluate, 130 interrupted. Anything
that stops the evaluation (bad input, missing data, a crash) is 2, never 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from engine.config import KV_CACHE_DTYPES, KV_SCALES, EngineConfig, resolve_device, serving_setting

EXIT_PASS, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class GateInputError(RuntimeError):
    """The gate cannot evaluate these inputs; the message says why."""


def add_gate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, help="BF16 (reference) model directory")
    parser.add_argument("--candidate", required=True, help="quantized checkpoint directory to judge")
    parser.add_argument("--policy", default="default", help="shipped policy name (default, quick, long-context) or a TOML path")
    parser.add_argument("--report-dir", default=None, help="where reports go (default: CANDIDATE/gate-report)")
    parser.add_argument("--data-dir", default=None, help="evaluation data (default: $DRIFTGATE_DATA, ../shared/data)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="candidate's activation dtype, as it will be served (auto: float32 on a CPU, bfloat16 "
                             "on a GPU, as `serve`); the baseline runs at auto")
    parser.add_argument("--device", default="auto", help="where the arms run in process: cpu, cuda, cuda:N, or auto "
                                                         "(CUDA when there is a GPU)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="candidate's KV-cache dtype (auto: its calibrated fp8 cache if it has one, else the "
                             "model dtype, as serve)")
    parser.add_argument("--kv-scales", choices=KV_SCALES, default="checkpoint",
                        help="fp8 KV scales: calibrated from the checkpoint, or dynamic (first batch; recorded in the report)")
    parser.add_argument("--lora", default=None, metavar="DIR",
                        help="a PEFT LoRA adapter both arms answer through (gates the adapter over the quantized base)")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="your own traffic as Tier 2's prompts (and Tier 0's sequences) instead of GSM8K: JSONL "
                             "of chat or completion request bodies, or OpenAI batch lines")
    parser.add_argument("--cache-dir", default=None, help="baseline result cache (default ~/.cache/driftgate)")
    parser.add_argument("--no-cache", action="store_true", help="always re-run the baseline arm")
    parser.add_argument("--server", default=None, metavar="URL",
                        help="score the candidate as served at URL (OpenAI-compatible) instead of in process; "
                             "--candidate still names its checkpoint (tokenizer, and the hashes the verdict binds)")
    parser.add_argument("--server-api-key", default=os.environ.get("DRIFTGATE_API_KEY"),
                        help="bearer key for --server (default: $DRIFTGATE_API_KEY)")


def check_model_dir(path: Path, role: str) -> dict[str, str]:
    """Refuse a folder that is missing, has no config or weights, or holds unreadable safetensors."""
    from safetensors import safe_open

    from engine.models.llama import CLASSIFIERS
    from evals.verdict import weight_files, weight_hashes

    if not path.is_dir():
        raise GateInputError(f"{role} directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise GateInputError(f"{role} directory {path} has no config.json")
    try:
        architecture = (json.loads((path / "config.json").read_text()).get("architectures") or [""])[0]
    except json.JSONDecodeError as exc:
        raise GateInputError(f"{role} directory {path}: config.json is not valid JSON: {exc}") from None
    if architecture in CLASSIFIERS:
        raise GateInputError(f"{role} {path} is a sequence classifier ({architecture}), which does not generate; "
                             "the gate compares causal LMs' answers")
    files = weight_files(path)
    if not files:
        raise GateInputError(f"{role} directory {path} has no weight files")
    for f in files:
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():
                        handle.get_slice(name)  # parses each tensor's header entry
            except Exception as exc:  # safetensors raises several types for a damaged file
                raise GateInputError(f"{role} weight file {f} is not readable safetensors: {exc}") from exc
    return weight_hashes(path)


# Texts both tokenizers must split alike: case, digits, accents, CJK, an emoji, runs of whitespace.
_TOKENIZER_PROBES = ("The Quick brown FOX jumps; 3.14159 and 1,000,000.", "naïve café Straße 東京 🙂",
                     "  indented\n\tline\r\nx  ", "def f(x):\n    return x ** 2  # ok")


def check_comparable(baseline_dir: Path, candidate_dir: Path, *, same_allowed: bool = False) -> None:
    """Refuse a pair the gate cannot compare item for item: one folder twice (unless `same_allowed`:
    a server serving the baseline, checked against it), other vocabularies, or tokenizers that split
    text differently (the arms' prompts would differ; Tier 0 compares logits position by position).
    A baseline that is quantized when the candidate is not is probably a swap."""
    from engine.loader import read_config
    from engine.tokenizer import load_tokenizer

    if baseline_dir.resolve() == candidate_dir.resolve() and not same_allowed:
        raise GateInputError(f"baseline and candidate are the same folder ({baseline_dir}); gate a quantized "
                             "checkpoint against the model it was quantized from")
    configs = {"baseline": read_config(baseline_dir), "candidate": read_config(candidate_dir)}
    vocab = {role: config.get("vocab_size") for role, config in configs.items()}
    if vocab["baseline"] != vocab["candidate"]:
        raise GateInputError(f"baseline and candidate have other vocabularies (vocab_size {vocab['baseline']} and "
                             f"{vocab['candidate']}): the candidate is not a quantization of the baseline")
    try:
        base, cand = (load_tokenizer(folder) for folder in (baseline_dir, candidate_dir))
    except ValueError as exc:
        raise GateInputError(str(exc)) from None
    for text in _TOKENIZER_PROBES:
        if (ids := base.encode(text)) != (other := cand.encode(text)):
            raise GateInputError(f"baseline and candidate tokenize {text!r} differently ({ids} and {other}); "
                                 "give the candidate the baseline's tokenizer files")
    if "quantization_config" in configs["baseline"] and "quantization_config" not in configs["candidate"]:
        print(f"[gate] warning: the baseline {baseline_dir} is quantized and the candidate {candidate_dir} is not; "
              "were --baseline and --candidate swapped? The verdict goes to the candidate's folder.",
              file=sys.stderr, flush=True)


def _lora(args: argparse.Namespace) -> tuple[Path | None, dict[str, str]]:
    """--lora's folder and the hashes of its weights and config (what the baseline cache and the
    report bind), or (None, {})."""
    from engine.file_hash import file_sha256

    if args.lora is None:
        return None, {}
    if args.server:
        raise GateInputError("--lora gates local arms; a server's adapter is its own model: gate it as "
                             "--candidate with the server serving that model")
    folder = Path(args.lora)
    files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
    if missing := [f.name for f in files if not f.is_file()]:
        raise GateInputError(f"--lora {folder} is not a PEFT LoRA adapter folder (no {', '.join(missing)})")
    return folder, {f.name: file_sha256(f) for f in files}


def run_gate(args: argparse.Namespace) -> int:
    """Entry point for `driftgate gate`; returns the process exit code."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("driftgate gate: interrupted; no verdict written (an earlier one, if any, is as it was)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 — every failure to evaluate must become exit 2
        from evals.arms import ArmSetupError
        from evals.data import DataMissingError, UnknownTaskError
        from evals.drift import PromptMismatchError
        from evals.policy import PolicyError
        from evals.prompts import PromptFileError

        known = (GateInputError, PolicyError, DataMissingError, UnknownTaskError, PromptMismatchError,
                 PromptFileError, ArmSetupError)
        prefix = "driftgate gate: cannot evaluate" if isinstance(exc, known) else "driftgate gate: crashed"
        print(f"{prefix}: {exc}", file=sys.stderr)
        if not isinstance(exc, known):
            import traceback

            traceback.print_exc()
        return EXIT_ERROR


def _run(args: argparse.Namespace) -> int:
    from evals import arms, data, drift, gate, remote, report, verdict
    from evals.policy import PolicyError, load_policy

    started = time.perf_counter()
    policy = load_policy(args.policy)
    data_dir = data.resolve_data_dir(args.data_dir)
    needed = [t.name for t in policy.tier1.tasks]
    needed += ["driftgate_gsm8k_cot"] if policy.tier2.enabled else []
    needed += ["driftgate_wikitext"] if policy.tier0.enabled else []
    data_hashes = data.check_task_files(data_dir, sorted(set(needed)))
    for spec in policy.tier1.tasks:
        if (reported := arms.task_metrics(spec.name)) is not None and spec.metric not in reported:
            raise PolicyError(f"tier1 task {spec.name}: metric {spec.metric!r} is not one it reports "
                              f"({', '.join(sorted(reported))})")
    baseline_dir, candidate_dir = Path(args.baseline), Path(args.candidate)
    baseline_hashes = check_model_dir(baseline_dir, "baseline")
    candidate_hashes = check_model_dir(candidate_dir, "candidate")
    report_dir = _report_dir(args, candidate_dir)
    lora_dir, lora_hashes = _lora(args)
    # what the verdict binds, hashed before the arms load it: an edit during the run is not blessed
    judged_dir = candidate_dir if lora_dir is None else lora_dir
    judged_weights = candidate_hashes if lora_dir is None else verdict.weight_hashes(lora_dir)
    judged_configs = verdict.config_hashes(judged_dir)
    device, serving = _numerics(args)
    own_prompts = _own_prompts(args, policy, candidate_dir)  # checked before anything loads
    check_comparable(baseline_dir, candidate_dir, same_allowed=bool(args.server))
    ids = arms.selected_ids(policy, data_dir)
    cache = arms.BaselineCache(Path(args.cache_dir) if args.cache_dir else arms.DEFAULT_CACHE_DIR)

    served, cand_llm = None, None
    if args.server:
        candidate, prompts, served = _server_candidate(args, arms, remote, policy, data_dir, ids, candidate_dir,
                                                       own_prompts, (candidate_hashes, judged_configs))
    else:
        candidate, cand_llm = arms.run_arm(candidate_dir, policy, data_dir, ids, label="candidate", device=device,
                                           dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                           kv_scales=args.kv_scales, lora=lora_dir)
        prompts = _tier2_prompts(arms, policy, cand_llm.tokenizer, data_dir, own_prompts)
        if prompts:
            print(f"[gate] candidate: {len(prompts)} greedy generations", flush=True)
            candidate.generations = arms.greedy_generations(cand_llm, prompts, policy.tier2.max_new_tokens)

    # the baseline's cache entry is for these weights, with this config, tokenizer and chat template,
    # through this adapter
    baseline_key_hashes = {**baseline_hashes,
                           **{f"config/{name}": h for name, h in verdict.config_hashes(baseline_dir).items()},
                           **{f"lora/{name}": h for name, h in lora_hashes.items()}}
    baseline, base_llm, cached = _baseline_arm(args, arms, cache, policy, data_dir, ids, prompts,
                                               baseline_dir, baseline_key_hashes, data_hashes, variant="baseline",
                                               lora=lora_dir, device=device)
    noise = None
    if policy.noise_floor.enabled:
        noise, _, _ = _baseline_arm(args, arms, cache, policy, data_dir, ids, [], baseline_dir, baseline_key_hashes,
                                    data_hashes, variant="noise_floor", lora=lora_dir, device=device)

    comparisons, pooled = gate.compare_arms(policy, baseline.items, candidate.items)
    noise_cmp, noise_pooled = gate.compare_arms(policy, baseline.items, noise.items) if noise else ({}, None)

    parity, skip_reason, parity_failure = None, None, None
    if policy.tier0.enabled and served:
        skip_reason = remote.TIER0_SKIP_REASON
    elif policy.tier0.enabled:
        if base_llm is None:
            base_llm = arms.build_engine(baseline_dir, policy, device=device, lora=lora_dir)
        sequences = arms.tier0_sequences(base_llm, data_dir, policy, baseline.generations, prompts)
        print(f"[gate] tier 0: {len(sequences)} sequences, both arms", flush=True)
        try:
            parity = drift.logit_parity(sequences, arms.tier0_scorer(base_llm), arms.tier0_scorer(cand_llm),
                                        **_interval_settings(policy))
        except drift.NonFiniteLogitsError as exc:
            parity_failure = str(exc)
    agreement, divergences, answers = None, [], None
    if prompts and baseline.generations:
        base_generations = served.comparable(baseline.generations) if served else baseline.generations
        agreement = drift.generation_agreement(base_generations, candidate.generations, **_interval_settings(policy))
        tokenizer = served.tokenizer if served else cand_llm.tokenizer
        divergences = drift.earliest_divergences(prompts, base_generations, candidate.generations, tokenizer.decode)
        if own_prompts and any(p.expected for p in own_prompts):
            answers = _answers(policy, own_prompts, base_generations, candidate.generations, tokenizer,
                               cand_llm.engine.eos_token_ids if cand_llm else None, candidate_dir)

    checks = gate.decide(policy, comparisons, pooled, noise_pooled=noise_pooled, parity=parity,
                         parity_skip_reason=skip_reason, parity_failure=parity_failure, agreement=agreement,
                         answers=answers)
    length_accuracy = {task: drift.accuracy_by_generation_length(baseline.items[task], candidate.items[task])
                       for task, items in baseline.items.items()
                       if items and next(iter(items.values())).choice_scores is None}  # generative tasks
    result = gate.outcome(checks, comparisons=comparisons, pooled=pooled, noise_floor=noise_cmp,
                          noise_pooled=noise_pooled, parity=parity, agreement=agreement,
                          length_accuracy=length_accuracy, divergences=divergences, answers=answers)

    manifest = _manifest(args, policy, baseline_hashes, candidate_hashes, data_hashes, baseline, candidate,
                         cached, time.perf_counter() - started, noise, device, serving)
    if lora_dir is not None:
        manifest["lora"] = {"dir": str(lora_dir.resolve()), "sha256": lora_hashes}
    if served:
        manifest["candidate_server"] = served.manifest()
    items = {arm_name: arm.to_json()["items"] for arm_name, arm in (("baseline", baseline), ("candidate", candidate))}
    full = report.build_report(result, manifest, items)
    metrics = {"checks": full["checks"], "tier1_pooled": full["tier1"]["pooled"], "tier0": full["tier0"],
               "tier2": full["tier2"]}
    # the verdict first: reports that fail to write must not leave an earlier verdict standing beside
    # them. An adapter's verdict goes to its own folder, bound to the checkpoint it ran over.
    verdict.write_verdict(judged_dir, passed=result.passed, policy=asdict(policy), metrics=metrics,
                          baseline_hashes=baseline_hashes, candidate_hashes=judged_weights,
                          candidate_config_hashes=judged_configs,
                          base_hashes=candidate_hashes if lora_dir is not None else None, serving=serving)
    paths = report.write_reports(full, report_dir)
    print(report.render_markdown(full).split("\n## Worst")[0])
    marginal = [c.name for c in result.checks if c.marginal]
    print(f"[gate] verdict {'PASS' if result.passed else 'FAIL'}"
          + (f" (marginal: {', '.join(marginal)})" if marginal else "")
          + f"; reports in {paths['md'].parent}; {time.perf_counter() - started:.0f}s", flush=True)
    return EXIT_PASS if result.passed else EXIT_DRIFT


def _report_dir(args: argparse.Namespace, candidate_dir: Path) -> Path:
    """--report-dir (default CANDIDATE/gate-report), created and tried with a scratch file now: the
    reports are written last, and a path that cannot hold them must not cost the arms' run first."""
    report_dir = Path(args.report_dir) if args.report_dir else candidate_dir / "gate-report"
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=report_dir):
            pass
    except OSError as exc:
        reason = exc.strerror or exc
        raise GateInputError(f"report directory {report_dir} is not a writable directory ({reason})") from None
    return report_dir


def _interval_settings(policy) -> dict:
    """Tier 0's and Tier 2's intervals, at the level whose ends are the policy's one-sided bounds (as Tier 1's)."""
    return {"interval_level": policy.interval_level, "num_resamples": policy.bootstrap_resamples, "seed": policy.seed}


def _numerics(args: argparse.Namespace) -> tuple[str, dict | None]:
    """Where the in-process arms run, and the candidate's `serving_setting` (None for a live server,
    whose numerics are its own); settings that cannot apply are refused before anything loads."""
    import torch

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise GateInputError(f"--{exc}") from None
    if device != "cpu" and not torch.cuda.is_available():
        raise GateInputError(f"--device {args.device}: torch sees no CUDA device here")
    if not args.server:
        try:  # the flags' combinations, refused before anything loads
            EngineConfig(model=args.candidate, dtype=args.dtype, device=device, kv_cache_dtype=args.kv_cache_dtype,
                         kv_scales=args.kv_scales)
        except ValueError as exc:
            raise GateInputError(str(exc)) from None
        return device, serving_setting(args.candidate, args.dtype, device, args.kv_cache_dtype, args.kv_scales)
    candidate_flags = {"--dtype": args.dtype != "auto", "--kv-cache-dtype": args.kv_cache_dtype != "auto",
                       "--kv-scales": args.kv_scales != "checkpoint"}
    if given := [flag for flag, set_ in candidate_flags.items() if set_]:
        raise GateInputError(f"{', '.join(given)} set an in-process candidate; a --server candidate runs as its "
                             "server was started (pass them to `driftgate serve`)")
    return device, None


def _own_prompts(args: argparse.Namespace, policy, candidate_dir: Path) -> list | None:
    """--prompts as `evals.prompts.OwnPrompt`s (the candidate's tokenizer and chat template), or None."""
    if args.prompts is None:
        return None
    if not policy.tier2.enabled:
        raise GateInputError(f"--prompts feeds Tier 2, which policy {policy.name!r} turns off")
    from engine.tokenizer import load_tokenizer
    from evals.prompts import read_prompt_file

    return read_prompt_file(Path(args.prompts), load_tokenizer(candidate_dir))


def _answers(policy, own: list, baseline: list[list[int]], candidate: list[list[int]], tokenizer,
             end_ids: list[int] | None, candidate_dir: Path):
    """Both arms' answers to the prompts that say what they expect, compared (gate.compare_answers).
    A served candidate's end-of-sequence ids come from its folder, as its engine reads them."""
    from engine.generation_config import sequence_end_ids
    from evals.gate import compare_answers
    from evals.prompts import answer_items

    if end_ids is None:
        end_ids = sequence_end_ids(json.loads((candidate_dir / "config.json").read_text()), candidate_dir, tokenizer)
    return compare_answers(policy, *(answer_items(own, generations, tokenizer.decode, end_ids)
                                     for generations in (baseline, candidate)))


def _tier2_prompts(arms, policy, tokenizer, data_dir: Path, own: list | None) -> list[list[int]]:
    """Tier 2's prompts: the user's own, else the policy's GSM8K few-shot ones (none with Tier 2 off)."""
    if own is not None:
        return [prompt.token_ids for prompt in own]
    return arms.tier2_prompts(tokenizer, data_dir, policy.tier2.num_prompts) if policy.tier2.enabled else []


def _server_candidate(args, arms, remote, policy, data_dir, ids, candidate_dir, own_prompts,
                      candidate_files: tuple[dict[str, str], dict[str, str]]) -> tuple:
    """The candidate arm from a live server: Tier 1 via lm-eval's HTTP client, Tier 2 via completions.

    Returns (the arm, its Tier 2 prompts, a `remote.ServedCandidate`).
    """
    from engine.tokenizer import load_tokenizer

    try:
        card = remote.server_model(args.server, args.server_api_key)
        if (served_len := card.get("max_model_len")) is not None and served_len < policy.engine.max_model_len:
            raise GateInputError(f"the server's max_model_len {served_len} is below the policy's "
                                 f"{policy.engine.max_model_len}: serve with --max-model-len "
                                 f"{policy.engine.max_model_len} so both arms see the same prompts")
        serves_candidate = _serves_candidate(card.get("root"), candidate_dir, candidate_files)
        candidate = arms.run_server_arm(args.server, card["id"], candidate_dir, policy, data_dir, ids,
                                        api_key=args.server_api_key)
        tokenizer = load_tokenizer(candidate_dir)
        prompts: list[list[int]] = []
        exact = True
        if policy.tier2.enabled:
            prompts = arms.prompt_room(_tier2_prompts(arms, policy, tokenizer, data_dir, own_prompts),
                                       policy.engine.max_model_len, policy.tier2.max_new_tokens)
            print(f"[gate] candidate @ {args.server}: {len(prompts)} greedy generations", flush=True)
            candidate.generations, exact = remote.greedy_generations(
                args.server, card["id"], prompts, policy.tier2.max_new_tokens, tokenizer, api_key=args.server_api_key)
    except remote.ServerError as exc:
        raise GateInputError(str(exc)) from exc
    return candidate, prompts, remote.ServedCandidate(args.server, card, tokenizer, exact, serves_candidate)


def _serves_candidate(root: str | None, candidate_dir: Path,
                      candidate_files: tuple[dict[str, str], dict[str, str]]) -> bool | None:
    """Whether the server answers with the --candidate files the verdict will bind (their weight and
    config hashes, taken at the start). A driftgate or vLLM server names the folder it serves:
    another folder is refused unless its files are the candidate's (a copy); a folder this machine
    cannot read, or no name, cannot be told (None)."""
    from evals.verdict import config_hashes, weight_hashes

    if root is None:
        return None
    served = Path(root)
    if served.resolve() == candidate_dir.resolve():  # the same folder, however either names it
        return True
    if not served.is_dir():
        print(f"[gate] warning: the server serves {root}, which this machine cannot read to compare with "
              f"{candidate_dir.resolve()}; the verdict binds the --candidate files", flush=True)
        return None
    for kind, files, candidate in (("weights", weight_hashes, candidate_files[0]),
                                   ("config, tokenizer or chat template", config_hashes, candidate_files[1])):
        if files(served) != candidate:
            raise GateInputError(f"the server serves {root}, whose {kind} differ from --candidate {candidate_dir}: "
                                 "the verdict would bind files the server did not answer with; give --candidate "
                                 f"{root}, or serve {candidate_dir}")
    print(f"[gate] the server serves {root}, a copy of {candidate_dir} (same weights and config)", flush=True)
    return True


def _baseline_arm(args, arms, cache, policy, data_dir, ids, prompts, baseline_dir, baseline_hashes, data_hashes,
                  *, variant, lora: Path | None, device: str):
    """The baseline (or its noise-floor rerun, through adapter `lora` if given) from cache, or run and stored."""
    key = cache.key(baseline_hashes, policy, data_hashes, ids, variant, prompts, device)
    if not args.no_cache and (hit := cache.load(key, ids)) is not None:
        print(f"[gate] {variant}: cached ({key[:12]})", flush=True)
        return hit, None, True
    batched = policy.noise_floor.max_num_batched_tokens if variant == "noise_floor" else None
    arm, llm = arms.run_arm(baseline_dir, policy, data_dir, ids, label=variant, device=device,
                            max_num_batched_tokens=batched, tier2_prompt_ids=prompts or None, lora=lora)
    cache.store(key, arm)
    return arm, llm, False


def _prompts_source(args: argparse.Namespace, policy) -> dict | None:
    """Where Tier 2's prompts came from: the user's file (with its hash) or GSM8K's few-shot set."""
    from engine.file_hash import file_sha256

    if not policy.tier2.enabled:
        return None
    if args.prompts is None:
        return {"source": "driftgate_gsm8k_cot (8-shot)"}
    return {"source": str(Path(args.prompts).resolve()), "sha256": file_sha256(Path(args.prompts))}


def _manifest(args, policy, baseline_hashes, candidate_hashes, data_hashes, baseline, candidate, cached,
              seconds, noise, device: str, serving: dict | None) -> dict:
    import lm_eval
    import torch

    from evals import arms

    return {
        "baseline_dir": str(Path(args.baseline).resolve()),
        "candidate_dir": str(Path(args.candidate).resolve()),
        "baseline_weights_sha256": baseline_hashes,
        "candidate_weights_sha256": candidate_hashes,
        "candidate_config": json.loads((Path(args.candidate) / "config.json").read_text()).get("quantization_config"),
        "device": device,  # the in-process arms' (a --server candidate's is its server's)
        "machine": arms.machine(device),
        **(serving or {"dtype": None, "kv_cache_dtype": None, "kv_scales": None}),
        "data_sha256": data_hashes,
        "tier2_prompts": _prompts_source(args, policy),
        "policy": asdict(policy),
        "seed": policy.seed,
        "lm_eval_version": lm_eval.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "baseline_cached": cached,
        "baseline_scores": baseline.scores,
        "candidate_scores": candidate.scores,
        "wall_seconds": {"total": seconds, "baseline": baseline.wall_seconds, "candidate": candidate.wall_seconds},
        # Prefill the prefix cache saved while scoring tasks (an MC item's choices share its context).
        "prefix_cache": {name: {"task_prompt_tokens": arm.task_prompt_tokens,
                                "prefill_tokens_saved": arm.task_cached_tokens}
                         for name, arm in (("baseline", baseline), ("noise_floor", noise), ("candidate", candidate))
                         if arm is not None},
        "all_prompt_hashes_matched": True,  # compare_items raises PromptMismatchError otherwise
    }
