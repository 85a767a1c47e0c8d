"""Run one arm of the gate (baseline or candidate) through the engine, and cache baselines.

An arm is: the policy's lm-eval tasks on fixed item ids (per-item results kept), plus
greedy generations for Tier 2. The baseline arm is cached under a key of everything that
could change its results (the engine's own code included), so gating N candidates runs it once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lm_eval
import tokenizers
import torch
import transformers
import yaml
from lm_eval.api.model import TemplateLM

import engine
import evals
import quant
from engine import LLM, SamplingParams
from engine.atomic_write import write_text_atomic
from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
from engine.layers.cpu_kernels import cpu_signature
from engine.loader import resolve_dtype
from evals import data
from evals.drift import ItemResult, ScoreChunks, items_from_samples
from evals.lm_eval_model import DriftgateLM, prefill_first
from evals.policy import GatePolicy, PolicyError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "driftgate" / "gate-baselines"
CACHE_FORMAT = 2  # 2: task prompt/prefill-saved counts replace whole-engine prefix-cache counters
# The code that computes an arm: the engine's Python modules and C kernels, and the gate's scoring
ARM_SOURCES = [Path(package.__file__).resolve().parent for package in (engine, quant, evals)]


def source_fingerprint(roots: list[Path]) -> str:
    """sha256 over the .py/.c/.h files under roots. A baseline computed by other kernels is not
    reused: their last-bit differences move where greedy generations diverge, and through fp8 or
    int8 activation rounding they move a candidate's logits by far more than a bit."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@dataclass(slots=True)
class ArmResults:
    """Everything one arm produced that the comparison needs (JSON round-trippable)."""

    items: dict[str, dict[int, ItemResult]]
    scores: dict[str, dict[str, float]]  # task -> lm-eval aggregate metrics
    generations: list[list[int]] = field(default_factory=list)  # Tier 2, one per prompt
    wall_seconds: float = 0.0
    task_prompt_tokens: int = 0  # prompt tokens the lm-eval tasks sent to the engine
    task_cached_tokens: int = 0  # of those, served by the prefix cache: prefill saved (MC choices share a context)

    def to_json(self) -> dict:
        return {
            "items": {t: [asdict(i) for i in items.values()] for t, items in self.items.items()},
            "scores": self.scores,
            "generations": self.generations,
            "wall_seconds": self.wall_seconds,
            "task_prompt_tokens": self.task_prompt_tokens,
            "task_cached_tokens": self.task_cached_tokens,
        }

    @classmethod
    def from_json(cls, raw: dict) -> ArmResults:
        items = {}
        for task, rows in raw["items"].items():
            items[task] = {}
            for row in rows:
                for key in ("choice_scores", "choice_logprobs"):
                    if row[key] is not None:
                        row[key] = tuple(row[key])
                items[task][int(row["doc_id"])] = ItemResult(**row)
        return cls(items=items, scores=raw["scores"], generations=raw["generations"],
                   wall_seconds=raw["wall_seconds"], task_prompt_tokens=raw["task_prompt_tokens"],
                   task_cached_tokens=raw["task_cached_tokens"])


def build_engine(model_dir: Path, policy: GatePolicy, *, device: str = "cpu", dtype: str = "auto",
                 kv_cache_dtype: str = "auto", kv_scales: str = "checkpoint",
                 max_num_batched_tokens: int | None = None, lora: Path | None = None) -> LLM:
    """One arm's engine; with `lora`, every request (and Tier 0's scoring) goes through that adapter.
    A setting the engine refuses for this checkpoint (an fp8 KV cache it has no scales for) is an
    ArmSetupError saying so."""
    adapter = {} if lora is None else {"lora_modules": {"gated": str(lora)}, "default_lora": "gated"}
    try:
        return _engine(model_dir, policy, device, dtype, kv_cache_dtype, kv_scales, max_num_batched_tokens, adapter)
    except ValueError as exc:
        raise ArmSetupError(f"{model_dir} cannot run as asked: {exc}") from None


class ArmSetupError(RuntimeError):
    """An arm's engine refused its checkpoint or settings (the message says why)."""


def _engine(model_dir: Path, policy: GatePolicy, device: str, dtype: str, kv_cache_dtype: str, kv_scales: str,
            max_num_batched_tokens: int | None, adapter: dict) -> LLM:
    return LLM(
        str(model_dir),
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_scales=kv_scales,
        max_model_len=policy.engine.max_model_len,
        max_num_seqs=policy.engine.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or policy.engine.max_num_batched_tokens,
        block_size=policy.engine.block_size,
        seed=policy.seed,
        gpu_memory_utilization=gpu_share(policy),
        **adapter,
    )


def gpu_share(policy: GatePolicy) -> float:
    """Each arm's part of a GPU's memory (ignored on a CPU): the policy's, or else, as the
    candidate's, the baseline's and the noise floor's engines are alive at once on one device,
    a third (a half without a noise floor) of what one engine would take."""
    engines = 3 if policy.noise_floor.enabled else 2
    return policy.engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION / engines


def machine(device: str) -> str:
    """The hardware an arm's numerics depend on: a GPU's model, or the CPU's model and flags, which
    pick torch's kernels and our C kernels' instructions (-march=native). Arms computed on an AVX2
    and an AVX-512 CPU part at different near-ties, enough to move a borderline verdict."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    signature = cpu_signature()
    model = next((line.split(":", 1)[1].strip() for line in signature.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    return (f"{model}, {torch.backends.cpu.get_cpu_capability()} "
            f"({hashlib.sha256(signature.encode()).hexdigest()[:12]})")


def task_manager(data_dir: Path):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(data_dir)})


def spread_ids(total: int, count: int | str) -> list[int]:
    """`count` item ids spread evenly over [0, total) (all when count is "all" or too big).

    Evenly spaced rather than the first N because several sets are ordered by source.
    """
    if count == "all" or int(count) >= total:
        return list(range(total))
    return [i * total // int(count) for i in range(int(count))]


def selected_ids(policy: GatePolicy, data_dir: Path) -> dict[str, list[int]]:
    """Each task's item ids; a count above what its set holds is a PolicyError (the report would
    otherwise claim items it never scored)."""
    tasks = task_manager(data_dir).load([t.name for t in policy.tier1.tasks])["tasks"]
    ids = {}
    for spec in policy.tier1.tasks:
        total = len(tasks[spec.name].test_docs())
        if spec.items != "all" and spec.items > total:
            raise PolicyError(f"tier1 task {spec.name}: items = {spec.items}, but its set holds {total}; "
                              "ask for at most that many, or \"all\"")
        ids[spec.name] = spread_ids(total, spec.items)
    return ids


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAML; its `!function` tags name loaders, read here as None."""


_TaskYamlLoader.add_multi_constructor("!", lambda *_: None)


def task_metrics(name: str) -> set[str] | None:
    """The `metric,filter` keys task `name` reports ("acc,none", "exact_match,strict-match"), read
    from its YAML here; None for a task this package does not define."""
    for path in TASKS_DIR.glob("*.yaml"):
        spec = yaml.load(path.read_text(), Loader=_TaskYamlLoader)  # noqa: S506 (a SafeLoader)
        if spec.get("task") == name:
            filters = [f["name"] for f in spec.get("filter_list") or ()] or ["none"]
            return {f"{m['metric']},{f}" for m in spec.get("metric_list") or () for f in filters}
    return None


def run_tasks(lm: TemplateLM, policy: GatePolicy, data_dir: Path, ids: dict[str, list[int]],
              label: str) -> tuple[dict[str, dict[int, ItemResult]], dict[str, dict[str, float]]]:
    """Run the policy's tasks on the given item ids; per-item results and aggregate scores.

    `lm` is an lm-eval model with a `generations` record (in-process `DriftgateLM` or the
    HTTP `ServerLM`), from which generations that hit the token limit are read.
    """
    print(f"[gate] {label}: lm-eval on {', '.join(f'{t} ({len(v)})' for t, v in ids.items())}", flush=True)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(ids),
        task_manager=task_manager(data_dir),
        samples=ids,
        bootstrap_iters=0,
        log_samples=True,
        random_seed=policy.seed,
        numpy_random_seed=policy.seed,
        torch_random_seed=policy.seed,
        fewshot_random_seed=policy.seed,
        verbosity="ERROR",
    )
    runaway = frozenset(ctx for ctx, rec in lm.generations.items() if rec.hit_max_tokens)
    items = {spec.name: items_from_samples(out["samples"][spec.name], spec.metric, runaway,
                                           out["configs"][spec.name].get("target_delimiter", " "))
             for spec in policy.tier1.tasks}
    scores = {task: {k: float(v) for k, v in res.items() if isinstance(v, int | float) and "stderr" not in k}
              for task, res in out["results"].items()}
    return items, scores


def tier2_prompts(tokenizer, data_dir: Path, num_prompts: int) -> list[list[int]]:
    """GSM8K 8-shot chain-of-thought prompts: long, shared-prefix, decode-heavy."""
    task = task_manager(data_dir).load(["driftgate_gsm8k_cot"])["tasks"]["driftgate_gsm8k_cot"]
    docs = task.test_docs()
    ids = spread_ids(len(docs), num_prompts)
    return [tokenizer.encode(task.fewshot_context(docs[i], num_fewshot=8)) for i in ids]


def prompt_room(prompts: list[list[int]], max_model_len: int, max_new_tokens: int) -> list[list[int]]:
    """Prompts cut from the left (keeping the question) to leave room for the generation."""
    room = max_model_len - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in max_model_len")
    return [p[-room:] for p in prompts]


def greedy_generations(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations; prompts are cut from the left (keeping the question) to leave room."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    prompts = prompt_room(prompts, llm.engine.max_model_len, max_new_tokens)
    prefill_first(llm, prompts)  # the 8-shot exemplars are shared: compute them once
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return [list(o.outputs[0].token_ids) for o in outputs]


def tier0_scorer(llm: LLM) -> ScoreChunks:
    """The engine's full-vocabulary scorer for Tier 0, chunk by chunk, with its layer states."""
    return functools.partial(llm.score_chunks, layer_states=True)


def tier0_sequences(llm: LLM, data_dir: Path, policy: GatePolicy, generations: list[list[int]],
                    prompts: list[list[int]]) -> list[list[int]]:
    """WikiText articles plus the baseline's own greedy generations (with their prompts), truncated.

    An article shorter than the policy's length runs on into the next ones (as perplexity runs
    over WikiText as one stream), so a long-context policy scores every position it asks for:
    drift that grows with the context (an fp8 KV cache's) shows in the late position buckets.
    """
    limit = policy.tier0.max_tokens_per_sequence
    pages = [doc["page"] for doc in data.load_wikitext(data_dir)]
    sequences = []
    for first in spread_ids(len(pages), policy.tier0.num_documents):
        ids: list[int] = []
        for page in pages[first:] + pages[:first]:
            ids += llm.tokenizer.encode("\n\n" + page, add_special_tokens=False) if ids else llm.tokenizer.encode(page)
            if len(ids) >= limit:
                break
        sequences.append(ids[:limit])
    sequences += [(p + g)[-limit:] for p, g in zip(prompts, generations, strict=True)]  # the tail holds the generation
    return [s for s in sequences if len(s) >= 2]


def run_arm(model_dir: Path, policy: GatePolicy, data_dir: Path, ids: dict[str, list[int]], *,
            label: str, device: str = "cpu", dtype: str = "auto", kv_cache_dtype: str = "auto",
            kv_scales: str = "checkpoint",
            max_num_batched_tokens: int | None = None,
            tier2_prompt_ids: list[list[int]] | None = None, lora: Path | None = None) -> tuple[ArmResults, LLM]:
    """Build the engine for one arm (through LoRA adapter `lora`, if given), run tasks and Tier 2
    generations, and return both."""
    start = time.perf_counter()
    llm = build_engine(model_dir, policy, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                       kv_scales=kv_scales, max_num_batched_tokens=max_num_batched_tokens, lora=lora)
    before = llm.stats()
    items, scores = run_tasks(DriftgateLM(llm=llm), policy, data_dir, ids, label)
    after = llm.stats()
    generations: list[list[int]] = []
    if tier2_prompt_ids:
        print(f"[gate] {label}: {len(tier2_prompt_ids)} greedy generations", flush=True)
        generations = greedy_generations(llm, tier2_prompt_ids, policy.tier2.max_new_tokens)
    arm = ArmResults(items=items, scores=scores, generations=generations,
                     wall_seconds=time.perf_counter() - start,
                     task_prompt_tokens=after.prefix_cache_queries - before.prefix_cache_queries,
                     task_cached_tokens=after.prefix_cache_hits - before.prefix_cache_hits)
    return arm, llm


def run_server_arm(base_url: str, model: str, tokenizer_dir: Path, policy: GatePolicy, data_dir: Path,
                   ids: dict[str, list[int]], *, api_key: str | None = None) -> ArmResults:
    """The candidate arm's tasks scored by a live OpenAI-compatible server serving `model`."""
    from evals import remote

    start = time.perf_counter()
    lm = remote.server_lm(base_url, model, str(tokenizer_dir), max_length=policy.engine.max_model_len - 1,
                          api_key=api_key)
    items, scores = run_tasks(lm, policy, data_dir, ids, f"candidate @ {base_url}")
    return ArmResults(items=items, scores=scores, wall_seconds=time.perf_counter() - start)


class BaselineCache:
    """Baseline arm results on disk, keyed by what determines them."""

    def __init__(self, root: Path = DEFAULT_CACHE_DIR):
        self.root = Path(root)

    @staticmethod
    def key(baseline_hashes: dict[str, str], policy: GatePolicy, data_hashes: dict[str, str],
            ids: dict[str, list[int]], variant: str, tier2_prompts: list[list[int]], device: str = "cpu") -> str:
        task_files = {p.name: data.file_sha256(p) for p in sorted(TASKS_DIR.glob("*")) if p.is_file()}
        material = {
            "format": CACHE_FORMAT,
            "variant": variant,
            "weights": baseline_hashes,
            "task_files": task_files,  # YAMLs carry the task versions; any edit changes the key
            "data": data_hashes,
            "ids": ids,
            "tier2_prompts": hashlib.sha256(json.dumps(tier2_prompts).encode()).hexdigest(),  # GSM8K's or --prompts
            "tasks": [asdict(t) for t in policy.tier1.tasks],
            "engine": asdict(policy.engine),
            "noise_floor": asdict(policy.noise_floor),
            "tier2": asdict(policy.tier2),
            "seed": policy.seed,
            "libraries": {package.__name__: package.__version__
                          for package in (lm_eval, torch, transformers, tokenizers)},
            "code": source_fingerprint(ARM_SOURCES),
            # the kernels and the activation dtype (auto on that device) move the last bits
            "device": "cuda" if device.startswith("cuda") else device,
            "machine": machine(device),
            "dtype": str(resolve_dtype("auto", device)),
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def load(self, key: str, ids: dict[str, list[int]]) -> ArmResults | None:
        """The stored arm, if it holds exactly these items; a damaged entry is recomputed, never trusted."""
        path = self.root / f"{key}.json"
        if not path.is_file():
            return None
        try:
            arm = ArmResults.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError):  # ValueError: bad JSON, UTF-8 or numbers
            return None
        if any(set(arm.items.get(task, ())) != set(task_ids) for task, task_ids in ids.items()):
            return None
        return arm

    def store(self, key: str, arm: ArmResults) -> None:
        """Written whole or not at all, under a name of its own so gates storing at once do not collide."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.root / f"{key}.json", json.dumps(arm.to_json()))
