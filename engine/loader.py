"""Load an HF safetensors folder into our model: meta-device construction, then one pass over tensors."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine import host_memory
from engine.layers.norm import RMSNorm
from engine.models.llama import BASE_MODELS, LlamaArgs, LlamaForCausalLM
from quant.checkpoint import is_kv_cache_tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float": torch.float32, "half": torch.float16}  # the last two: vLLM's other names
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# Building a Linear frees copies of what it read (merged shards, unpacked words, fp32 weights once
# in panels) amid glibc's heap, which keeps them resident; malloc_trim gives them back, at ~1-5 ms a
# call: once per this many bytes read, not per Linear
_TRIM_EVERY = 32 << 20


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """`auto` is float32 on CPUs (bf16 matmuls are several times slower on AVX2), bf16 on GPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def read_config(model_dir: str | Path) -> dict:
    """config.json of an HF folder, with errors that say what to do."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise ValueError(f"{model_dir} is a file; give the model's folder (the one holding config.json)")
    if not model_dir.is_dir():
        raise ValueError(f"model folder not found: {model_dir} "
                         "(import the default model with `driftgate import-model smollm2-135m`)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not the object of a model's settings")
    return config


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weights")
    return files


def _linear_shards(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint Linear name → (our module path, shard index), from the names each Linear carries."""
    return {prefix: (path, shard) for path, module in model.named_modules()
            for shard, prefix in enumerate(getattr(module, "prefixes", ()))}


def model_config(model_dir: str | Path, hf_overrides: dict | None = None) -> dict:
    """config.json with vLLM's hf_overrides on top (e.g. a causal LM served as a classifier)."""
    return {**read_config(model_dir), **(hf_overrides or {})}


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               max_model_len: int | None = None, hf_overrides: dict | None = None,
               prepack: bool = False) -> tuple[LlamaForCausalLM, dict]:
    """Build the model for `model_dir` and fill it from its safetensors; returns (model, hf_config).
    `max_model_len`, the context to be served, picks LongRoPE's factors (None: the model's own);
    `prepack` lays each Linear out for serving as soon as it is loaded (`prepack_linear`)."""
    model_dir = Path(model_dir)
    config = model_config(model_dir, hf_overrides)
    args = LlamaArgs.from_hf_config(config, max_model_len)
    headless = (config.get("architectures") or [None])[0] in BASE_MODELS  # keys without "model."
    torch_dtype = resolve_dtype(dtype, device)
    quant_config = None
    if config.get("quantization_config"):
        from quant.config import QuantizationConfig

        quant_config = QuantizationConfig.from_dict(config["quantization_config"])

    with torch.device("meta"):
        model = LlamaForCausalLM(args, quant_config, torch_dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    modules = dict(model.named_modules())
    linear_shards = _linear_shards(model)
    expected = [name for name, _ in model.named_parameters()]
    linears = {path for path, _ in linear_shards.values()}
    # a Linear's own parameters are its to load (no reference here, so prepacking frees them)
    params = {name: p for name, p in model.named_parameters() if name.rpartition(".")[0] not in linears}
    files = _weight_files(model_dir)
    # each Linear shard's tensor count, from the headers: a shard is loaded as soon as its last
    # tensor is read and a Linear finalized after its last shard, so staging copies and raw tensors
    # of one Linear at a time are alive, not the whole checkpoint's (the load's peak memory)
    shard_sizes = _shard_sizes(files, headless, linear_shards)
    loaded: set[str] = set()
    kv_tensors: dict[str, torch.Tensor] = {}  # applied only if the engine stores KV in fp8
    from_token = args.num_labels and config.get("classifier_from_token")  # a causal LM's rows make the score head
    lm_head: torch.Tensor | None = None
    staged: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
    shards_loaded: Counter[str] = Counter()
    finalized: set[str] = set()
    churn = 0  # bytes read for Linears, and of plain weights prepacking freed, since the last trim
    for path in files:
        with _open_weights(path) as f:
            for key in f.keys():
                if key.endswith(_SKIPPED_SUFFIXES):
                    continue
                name = f"model.{key}" if headless else key
                if is_kv_cache_tensor(name):
                    kv_tensors[name] = f.get_tensor(key)
                    continue
                prefix, _, suffix = name.rpartition(".")
                if prefix in linear_shards:
                    target = linear_shards[prefix]
                    tensor = staged[target][suffix] = f.get_tensor(key)
                    churn += tensor.numel() * tensor.element_size()
                    if len(staged[target]) < shard_sizes[target]:
                        continue
                    module_path, shard = target
                    try:
                        modules[module_path].load_shard(shard, staged.pop(target))
                    except ValueError as e:
                        raise ValueError(f"{path.name}: {module_path} shard {shard}: {e}") from e
                    shards_loaded[module_path] += 1
                    if shards_loaded[module_path] == len(modules[module_path].output_sizes):
                        _finalize(model_dir, module_path, modules[module_path], loaded)
                        finalized.add(module_path)
                        if prepack:
                            churn += model.prepack_linear(modules[module_path])
                        if churn >= _TRIM_EVERY:  # what building (and packing) freed amid the C heap, given back
                            host_memory.return_freed_memory()
                            churn = 0
                elif name in params:
                    tensor = _checked_shape(params[name], f.get_tensor(key), name)
                    # a serving engine holds the table as laid out from the checkpoint's tensor
                    if not (prepack and name == "model.embed_tokens.weight" and model.lay_out_table(tensor)):
                        params[name].data.copy_(tensor)
                    loaded.add(name)
                elif name == "lm_head.weight" and from_token:
                    lm_head = f.get_tensor(key)
                elif name == "lm_head.weight" and args.tie_word_embeddings:
                    continue  # tied: the embedding serves as the output projection
                else:
                    raise ValueError(f"{path.name}: tensor {name!r} does not belong to {args.architecture}")
    if from_token:
        if "score" in finalized:
            raise ValueError(f"{model_dir}: classifier_from_token makes the score head, but the checkpoint holds one")
        head = lm_head if lm_head is not None else model.model.embed_tokens.weight  # as held (maybe bf16)
        model.score.load_shard(0, {"weight": _score_from_tokens(model_dir, config, head, model.dtype)})
    for name, module in modules.items():
        if hasattr(module, "finalize") and name not in finalized:  # a Linear with shards missing, or the score
            _finalize(model_dir, name, module, loaded)
    if args.norm_offset:  # Gemma's norms scale by (w + 1): store them so, as every other norm's weight
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.data += args.norm_offset
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing tensor(s) {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.kv_scale_tensors = kv_tensors
    model.eval()
    return model, config


def _shard_sizes(files: list[Path], headless: bool, linear_shards: dict[str, tuple[str, int]]) -> dict[tuple[str, int], int]:
    """How many tensors the checkpoint holds for each Linear shard, from the files' headers (where
    a tensor found in two files is an error: which copy to serve is anyone's guess)."""
    suffixes: dict[tuple[str, int], set[str]] = defaultdict(set)
    seen: dict[str, Path] = {}
    for path in files:
        with _open_weights(path) as f:
            for key in f.keys():
                if key in seen:
                    raise ValueError(f"tensor {key!r} is in both {seen[key].name} and {path.name}")
                seen[key] = path
                name = f"model.{key}" if headless else key
                prefix, _, suffix = name.rpartition(".")
                if prefix in linear_shards and not is_kv_cache_tensor(name):
                    suffixes[linear_shards[prefix]].add(suffix)
    return {target: len(names) for target, names in suffixes.items()}


def _open_weights(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"cannot read {path}: {e}") from e


def _finalize(model_dir: Path, name: str, module: nn.Module, loaded: set[str]) -> None:
    try:
        module.finalize()
    except ValueError as e:
        raise ValueError(f"{model_dir}: missing or bad tensors for {name}: {e}") from e
    loaded.update(f"{name}.{p}" for p, _ in module.named_parameters())


def _score_from_tokens(model_dir: Path, config: dict, lm_head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A classifier head from a causal LM's output rows (vLLM's classifier_from_token): each
    named token's row, or for Qwen3-Reranker the "yes" row less the "no" row, so the sigmoid of
    its one logit is softmax([no, yes])[yes], the probability the reranker's card scores with."""
    from engine.tokenizer import load_tokenizer

    tokens = config["classifier_from_token"]
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    unknown = [t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token names {unknown}, which the tokenizer does not hold as tokens")
    rows = lm_head[ids].to(dtype)
    if config.get("is_original_qwen3_reranker"):
        if len(tokens) != 2:
            raise ValueError(f"is_original_qwen3_reranker takes two classifier_from_token entries (no, yes), got {tokens}")
        rows = rows[1:] - rows[:1]
    return rows


def _checked_shape(param: nn.Parameter, tensor: torch.Tensor, name: str) -> torch.Tensor:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    return tensor


def apply_kv_scales(model: LlamaForCausalLM) -> None:
    """Validate the checkpoint's FP8 KV scales and put them on each layer's Attention.

    A missing, zero, negative or non-finite scale is an error naming the tensor: a silent 1.0
    would saturate or waste the fp8 range without anyone noticing.
    """
    from quant.checkpoint import load_kv_scales

    args = model.args
    if not model.kv_scale_tensors:
        raise ValueError("the checkpoint has no k/v scales")
    for layer, scales in zip(model.model.layers, load_kv_scales(model.kv_scale_tensors, args.num_layers,
                                                                args.num_kv_heads), strict=True):
        layer.self_attn.attn.k_scale = scales.k  # [num_kv_heads, 1]: broadcasts over [T, KV, D]
        layer.self_attn.attn.v_scale = scales.v


def defer_kv_scales(model: LlamaForCausalLM) -> None:
    """Dynamic FP8 KV scales: each layer takes its scales from the first K/V it stores (checkpoint scales unused)."""
    for layer in model.model.layers:
        layer.self_attn.attn.scales_pending = True
