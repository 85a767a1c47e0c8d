"""Engine configuration: one validated dataclass built once from user arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from engine.json_object import flag_json_object
from engine.scheduler import SCHEDULING_POLICIES
from engine.spec_decode import SpeculativeConfig

# auto: the checkpoint's calibrated fp8 cache where it declares one, else the model dtype (vLLM's
# rule); float32 / bfloat16 name an unquantized cache (float32 needs float32 activations);
# fp8 = fp8_e4m3 (scaled); fp8_e5m2 stores at unit scale, as vLLM does
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_SCALES = ("checkpoint", "dynamic")  # where an fp8 KV cache's scales come from
SCALED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # the ones kv_scales applies to
ATTENTION_BACKENDS = ("auto", "torch", "c", "triton")  # auto: triton on CUDA, the C kernels on CPU
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU for one engine



def kv_cache_setting(kv_cache_dtype: str, kv_scales: str) -> dict[str, str | None]:
    """What decides a KV cache's numbers, spelt one way (fp8_e4m3 is fp8; scales only where they apply)."""
    dtype = "fp8" if kv_cache_dtype == "fp8_e4m3" else kv_cache_dtype
    return {"kv_cache_dtype": dtype, "kv_scales": kv_scales if dtype in SCALED_KV_CACHE_DTYPES else None}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model: str) -> str:
    """`auto` becomes `fp8` for a checkpoint whose quantization_config declares a kv_cache_scheme,
    as vLLM resolves it: a checkpoint quantized with calibrated KV scales serves (and is gated)
    with them unless a dtype is named. Anything else, or a folder without a readable config.json
    (the loader says what is wrong with it), is returned as given."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    from engine.loader import read_config

    try:
        quantization = read_config(model).get("quantization_config")
    except ValueError:
        return kv_cache_dtype
    return "fp8" if isinstance(quantization, dict) and quantization.get("kv_cache_scheme") else kv_cache_dtype


def check_gpu_memory_utilization(value: float) -> None:
    """A share of a GPU's memory: in (0, 1] (ValueError otherwise)."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")


def resolve_device(device: str) -> str:
    """`auto` is CUDA when torch sees a GPU, else the CPU; anything but cpu, cuda or cuda:N is a ValueError."""
    if device == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    return device


def serving_setting(model: str, dtype: str, device: str, kv_cache_dtype: str, kv_scales: str) -> dict[str, str | None]:
    """What decides a served checkpoint's numbers besides its files: the activation dtype (`auto`
    resolved on the device: fp32 on a CPU, bf16 on a GPU) and the KV cache (`auto` resolved on the
    checkpoint). Recorded by the gate's verdict and report, compared by `serve --require-gate`."""
    from engine.loader import resolve_dtype

    activations = str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")
    return {"dtype": activations, **kv_cache_setting(resolve_kv_cache_dtype(kv_cache_dtype, model), kv_scales)}

@dataclass(slots=True)
class EngineConfig:
    """What LLM / AsyncEngine take; names follow vLLM's engine arguments."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # fp8 KV scales: calibrated ones from the checkpoint, or "dynamic" (set from the first batch's
    # K/V at run time: an explicit choice, since uncalibrated scales can saturate later tokens)
    kv_scales: str = "checkpoint"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # while any sequence decodes, prompt chunks take at most this many tokens per step (0: no cap)
    max_prefill_tokens_with_decodes: int = 0
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU; on CUDA what gpu_memory_utilization leaves
    # CUDA: the share of the device's memory this engine may hold, weights and working memory
    # included (vLLM's); engines sharing one GPU (the gate's arms) each take their part
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_kv_blocks: int | None = None  # overrides the memory budget (tests force tiny caches)
    enable_prefix_caching: bool = True
    seed: int | None = 0  # None: a fresh random seed for requests that give none
    device: str = "cpu"  # "cuda", "cuda:N", or "auto" (CUDA when torch sees a GPU)
    attention_backend: str = "auto"  # torch is the reference; triton also runs on CPU with TRITON_INTERPRET=1
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    record_kv_events: bool = False
    scheduling_policy: str = "fcfs"  # or "priority": requests carry a priority, lower values first
    # speculative decoding by prompt lookup: a SpeculativeConfig, or its dict / JSON (vLLM's keys)
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (PEFT folders) served over the base model: requests name one or none
    enable_lora: bool = False
    max_lora_rank: int = 64
    lora_modules: dict[str, str] | None = None  # name → folder, loaded at start (implies enable_lora)
    default_lora: str | None = None  # one of lora_modules serving every request that names none (and score())
    # adapters kept in memory at once (vLLM's max_cpu_loras): past it the least recently used one
    # no request holds is evicted and read again from its folder when next asked for (None: all)
    max_cpu_loras: int | None = None
    # keys laid over config.json (vLLM's hf_overrides): a dict, or its JSON
    hf_overrides: dict | str | None = None
    # most logprobs / prompt_logprobs alternatives one request may ask for (vLLM's; -1: the whole vocabulary)
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.model)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_scales not in KV_SCALES:
            raise ValueError(f"kv_scales must be one of {', '.join(KV_SCALES)}, got {self.kv_scales!r}")
        if self.kv_scales == "dynamic" and self.kv_cache_dtype not in SCALED_KV_CACHE_DTYPES:
            raise ValueError("kv_scales='dynamic' only applies to an fp8 e4m3 KV cache (kv_cache_dtype='fp8'); "
                             "fp8_e5m2 takes no scales")
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two up to 256, got {self.block_size}")
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.lora_modules:
            self.enable_lora = True
        if self.default_lora is not None and self.default_lora not in (self.lora_modules or {}):
            raise ValueError(f"default_lora {self.default_lora!r} is not one of lora_modules")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {self.max_cpu_loras}")
        if isinstance(self.hf_overrides, str):
            self.hf_overrides = flag_json_object("hf_overrides", self.hf_overrides)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names (a typo must not pass silently).

        vLLM's arguments that ask for what happens here anyway are taken so a vLLM script runs:
        a parallel size of 1, `quantization` naming the checkpoint's own method, and the switches
        in NO_EFFECT_ARGUMENTS; other values of the first two are refused with what to do instead."""
        model = os.path.expanduser(str(model))
        for name in PARALLEL_SIZES:
            check_parallel_size(name, kwargs.pop(name, 1))
        check_quantization("quantization", kwargs.pop("quantization", None), model, kwargs.get("hf_overrides"))
        for name in NO_EFFECT_ARGUMENTS:
            kwargs.pop(name, None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


# vLLM's LLM() arguments for what this engine does anyway: every architecture is driftgate's own
# code (no checkpoint code runs), stats are logged only by the server, and a preempted sequence
# is recomputed from its cached blocks, never swapped to host memory (vLLM V1 ignores it too)
NO_EFFECT_ARGUMENTS = ("trust_remote_code", "disable_log_stats", "swap_space")
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")


def check_parallel_size(name: str, size: int) -> None:
    """vLLM's tensor/pipeline parallel size: 1 only, a model runs whole on one device here."""
    if size != 1:
        raise ValueError(f"{name} {size}: a model runs whole on one device here (no tensor or pipeline "
                         "parallelism); for more throughput run engines side by side with serve --replicas N")


def check_quantization(name: str, quantization: str | None, model: str, hf_overrides: dict | str | None) -> None:
    """vLLM's `quantization`: only the checkpoint's own method (this engine does not quantize at load)."""
    if quantization is None:
        return
    from engine.loader import model_config

    overrides = flag_json_object("hf_overrides", hf_overrides) if isinstance(hf_overrides, str) else hf_overrides
    method = (model_config(model, overrides).get("quantization_config") or {}).get("quant_method")
    if quantization != method:
        have = f"a {method} checkpoint" if method else "unquantized"
        raise ValueError(f"{name} {quantization}: driftgate does not quantize at load; {model} is {have}. Make a "
                         f"checkpoint with `driftgate quantize {model} --scheme SCHEME --calib DATA.jsonl -o OUT` "
                         "(fp8-dynamic, w8a8-int8, w4a16, ...), gate it, and serve OUT")


def check_priority(priority: int, policy: str) -> None:
    """A request's priority, as vLLM takes it: any integer under "priority", only 0 under "fcfs"."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority {priority} needs the priority scheduling policy (serve --scheduling-policy "
                         f"priority, or LLM(..., scheduling_policy='priority')); this engine serves in arrival order")
