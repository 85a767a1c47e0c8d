"""Factories for tests: tiny random-weight models with a real (small, locally trained) tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch

from engine.models.llama import CLASSIFIERS

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler admits waiting requests while running ones decode.",
    "Quantization maps weights to fewer bits with a scale per group.",
    "What is the capital of France? Paris is the capital of France.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) , ; : ! ?",
] * 4


def write_tiny_tokenizer(dest: Path, vocab_size: int = 384) -> None:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it the way HF folders hold it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "add_bos_token": False,
    }, indent=2))


# on a GPU (bench/gpu_check.sh runs `-m cuda`): a fixed cache, as 90% of a big GPU's memory would be
# millions of blocks for a tiny model
ON_CUDA = pytest.param({"device": "cuda", "num_kv_blocks": 256}, id="cuda",
                       marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


def make_tiny_model_dir(
    dest: Path,
    *,
    architecture: str = "LlamaForCausalLM",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random-weight HF model folder (config, safetensors, tokenizer) and return it
    (`architecture` a causal LM or one of its sequence classifiers, e.g. Qwen2ForSequenceClassification).

    Built through HF transformers itself, so the folder is exactly what a real checkpoint
    looks like and transformers can serve as the oracle on it.
    """
    import transformers

    dest = Path(dest)
    write_tiny_tokenizer(dest)
    vocab_size = len(json.loads((dest / "tokenizer.json").read_text())["model"]["vocab"])
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "GraniteForCausalLM": transformers.GraniteConfig,
        "OlmoeForCausalLM": transformers.OlmoeConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "SmolLM3ForCausalLM": transformers.SmolLM3Config,
        "Olmo2ForCausalLM": transformers.Olmo2Config,
        "Olmo3ForCausalLM": transformers.Olmo3Config,
    }[CLASSIFIERS.get(architecture, architecture)]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **({} if head_dim is None else {"head_dim": head_dim}),
        **(extra_config or {}),
    )
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype)
    with torch.no_grad():  # larger-than-default init so random models have peaked distributions
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():  # Qwen3's per-head norms: weights that matter
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif architecture.startswith("Gemma") and name.endswith("norm.weight"):  # they scale by (1 + w)
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def write_lora_adapter(base_dir: Path, dest: Path, targets: list[str], rank: int = 4, *, rslora: bool = False,
                       seed: int = 0) -> Path:
    """A PEFT LoRA adapter for the model at `base_dir`, written by PEFT itself, with random A and B
    (PEFT's default B = 0 would change nothing)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                             use_rslora=rslora, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(dest)
    return Path(dest)


def make_requests(num: int, num_tokens: int | list[int], *, max_tokens: int = 4, vocab: int = 50,
                  seed: int = 0, prefix: list[int] | None = None):
    """Requests with random prompts (optionally sharing `prefix`), for scheduler/block tests."""
    import random

    from engine.sampling_params import SamplingParams
    from engine.sequence import Request

    rng = random.Random(seed)
    lengths = num_tokens if isinstance(num_tokens, list) else [num_tokens] * num
    return [Request(f"r{i}", (prefix or []) + [rng.randrange(vocab) for _ in range(n)],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for i, n in enumerate(lengths)]


def make_scheduler(num_blocks: int, block_size: int = 4, *, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256, prefix_caching: bool = True,
                   max_prefill_tokens_with_decodes: int = 0):
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler, SchedulerConfig

    bm = BlockManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, max_prefill_tokens_with_decodes)
    return Scheduler(config, bm)


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantized_tensors(source_dir: Path, scheme, scale_dtype: torch.dtype | None = None, kv: bool = True) -> dict:
    """A tiny model folder's tensors with every Linear quantized by `scheme` (None: left as is),
    plus made-up KV-cache scales when `kv`; for `quant.checkpoint.write_checkpoint`."""
    from safetensors.torch import load_file

    from quant.checkpoint import WEIGHTS_NAME, quantize_weight

    tensors = load_file(str(source_dir / WEIGHTS_NAME))
    num_layers = json.loads((source_dir / "config.json").read_text())["num_hidden_layers"]
    for i in range(num_layers):
        for linear in LINEARS:
            prefix = f"model.layers.{i}.{linear}"
            if scheme is not None:
                w = tensors.pop(f"{prefix}.weight")
                static = scheme.input_activations is not None and not scheme.input_activations.dynamic
                q = quantize_weight(w, scheme, input_scale=0.01 if static else None, scale_dtype=scale_dtype)
                tensors.update({f"{prefix}.{k}": v for k, v in q.items()})
        if kv:
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.02 * (i + 1)])
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.01 * (i + 1)])
    return tensors


@contextmanager
def _kernel_env(name: str, value: str) -> Iterator[None]:
    """Run the block with environment variable `name` set to `value`, the C kernels loaded anew."""
    from engine.layers import cpu_kernels

    before = os.environ.get(name)
    os.environ[name] = value
    cpu_kernels.kernel.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
        cpu_kernels.kernel.cache_clear()


def cpu_kernels_off() -> AbstractContextManager[None]:
    """Run the block with the engine's C kernels disabled (DRIFTGATE_CPU_KERNELS=0): the torch paths."""
    return _kernel_env("DRIFTGATE_CPU_KERNELS", "0")


# what each -march the tests build for needs of the CPU that runs it (/proc/cpuinfo's names)
MARCH_NEEDS = {"haswell": {"avx2", "fma", "bmi1", "bmi2", "movbe", "f16c"},
               "skylake-avx512": {"avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}}


def skip_unless_cpu_runs(march: str) -> None:
    """Skip the test where this CPU cannot run code built with -march=`march` (one of MARCH_NEEDS):
    it lacks the instructions that code uses, so that CPU's routes cannot be run here."""
    try:
        flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[1].split()}
    except OSError:
        flags = set()
    if missing := MARCH_NEEDS[march] - flags:
        pytest.skip(f"kernels built with -march={march} need {', '.join(sorted(missing))}, which this CPU lacks")


def cpu_kernels_built_for(march: str) -> AbstractContextManager[None]:
    """Run the block on C kernels built for another CPU (DRIFTGATE_CPU_MARCH), which this one must run."""
    return _kernel_env("DRIFTGATE_CPU_MARCH", march)


def assert_rows_do_not_depend_on_the_batch(matmul, x: torch.Tensor, row_counts, *weights) -> None:
    """`matmul(rows, *weights)` gives the last `rows` of x the floats the whole of x gave them (a
    sequence's greedy outputs must not depend on what shares its batch)."""
    whole = matmul(x, *weights)
    for rows in row_counts:
        assert torch.equal(matmul(x[-rows:], *weights), whole[-rows:]), rows
