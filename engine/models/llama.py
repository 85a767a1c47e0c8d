"""The Llama family in one file: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms), SmolLM2
(tied embeddings), SmolLM3 (every fourth layer without rotary positions), Phi-3 (fused q/k/v and
gate/up in the checkpoint, LongRoPE, partial rotation), Gemma 2 and 3 (sandwich norms, GeGLU,
scaled embeddings, local and global attention layers; Gemma 2's capped attention scores and
logits), Granite (scaled embeddings, attention, block outputs and logits), OLMo 2 and 3 (norms on
block outputs only, q/k normed over all heads), and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE (a router's top-k expert MLPs per token in place of the MLP; OLMoE norms q
and k over all heads). Sequence classifiers put a score head where the LM head was.

    x → embed → N × [x + attn(norm(x)); x + mlp(norm(x))] → norm → lm_head
    Gemma 3: x · √d → N × [x + norm(attn(norm(x))); x + norm(mlp(norm(x)))] → norm → lm_head,
             its norms scaling by (1 + w), as the loader stores them

Attention is grouped-query (num_kv_heads ≤ num_heads) with rotary positions; the MLP is
SwiGLU, down(silu(gate(x)) · up(x)). q/k/v and gate/up are fused into one Linear each, which
names the checkpoint tensors it is filled from: the separate ones, or the fused ones where the
checkpoint stores them so (Phi-3).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import panel_matmul
from engine.layers.activation import gelu_tanh_and_mul, silu_and_mul
from engine.layers.attention import Attention, ForwardContext
from engine.layers.fused_decode import FusedDecode
from engine.layers.linear import DenseLinear, dense_matmul, make_linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

# headless checkpoints (HF's AutoModel, as embedding models are saved): served as their causal LM
# with the embedding matrix as the output head, their keys lacking the "model." prefix
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
               "Qwen3Model": "Qwen3ForCausalLM", "Gemma2Model": "Gemma2ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM"}
# sequence classifiers (rerankers, reward models): the causal LM's body with a `score` head on the
# last token's final hidden state in place of the LM head
CLASSIFIERS = {f"{family}ForSequenceClassification": f"{family}ForCausalLM"
               for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma2", "Mixtral", "Qwen2Moe", "Qwen3Moe")}
CLASSIFIERS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"

POST_NORM_ARCHITECTURES = {"Olmo2ForCausalLM", "Olmo3ForCausalLM"}
MOE_ARCHITECTURES = {"MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM",
                           "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "SmolLM3ForCausalLM", *POST_NORM_ARCHITECTURES,
                           *MOE_ARCHITECTURES}


def classifier_labels(config: dict) -> tuple[str, ...]:
    """A sequence classifier's class names, in its score head's row order (empty for other models).

    The head comes from the checkpoint's `score`, or, as vLLM reads a causal LM served as a
    classifier (hf_overrides), from the LM head's rows for `classifier_from_token`: one class per
    token, or for Qwen3-Reranker (`is_original_qwen3_reranker`) one class, "yes" less "no"."""
    if (config.get("architectures") or [None])[0] not in CLASSIFIERS:
        return ()
    if tokens := config.get("classifier_from_token"):
        return ("LABEL_0",) if config.get("is_original_qwen3_reranker") else tuple(tokens)
    id2label = config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
    return tuple(label for _, label in sorted(id2label.items(), key=lambda item: int(item[0])))


# LlamaArgs' sizes → the config.json keys they come from (or are derived from)
_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
          "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
          "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    """The hyper-parameters this file reads from an HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: each query and key head RMS-normalized before the rotation
    # per layer, the latest keys a query sees (Mistral v0.1 and Phi-3: every layer; Qwen with
    # use_sliding_window: from max_window_layers on), None for full attention
    layer_windows: tuple[int | None, ...]
    rotary_dim: int  # the leading dims of each head that rotate (all but Phi-4-mini's)
    checkpoint_fuses: bool  # Phi-3: the checkpoint itself holds qkv_proj and gate_up_proj, one tensor each
    max_model_len: int | None = None  # the context served, which picks LongRoPE's factors
    # Gemma 3 (the defaults are Llama's)
    sandwich_norms: bool = False  # norms after attention and MLP too, before their residual adds
    norm_offset: float = 0.0  # the checkpoint's norm weights w scale by (w + offset)
    embed_scale: float = 1.0  # embeddings are multiplied by this (√hidden)
    activation: str = "silu"  # of the gated MLP: silu or gelu_tanh
    attn_scale: float | None = None  # query scale, else head_dim ** -0.5
    local_rope_theta: float | None = None  # windowed layers' rotary base, unscaled (else as the others)
    attn_softcap: float | None = None  # Gemma 2: attention scores become cap · tanh(score / cap)
    logit_softcap: float | None = None  # Gemma 2: logits likewise
    o_proj_bias: bool = False  # Llama-style attention_bias covers the output projection too (not Qwen2's)
    # OLMoE: q and k normed over all their heads at once (not per head), then q, k, v clamped to ±clip_qkv
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # Granite: attention and MLP outputs scaled before their residual adds; logits scaled
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the layers in moe_layers replace the MLP by
    # experts_per_token of num_experts MLPs, picked per token by a router
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    renormalize_experts: bool = True  # the picked experts' weights rescaled to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one more expert every token goes through, gated
    num_labels: int = 0  # a sequence classifier's classes (its score head's rows); 0 for a causal LM
    # OLMo 2 and 3: each block's attention and MLP outputs are normed before their residual adds,
    # and their inputs are not (no input norms)
    post_norms: bool = False
    # SmolLM3: per layer, whether it rotates q and k (its NoPE layers, every fourth, do not)
    rope_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def sliding_window(self) -> int | None:
        """The window of the model's windowed layers (one value for all of them), if any."""
        return next((w for w in self.layer_windows if w), None)

    @property
    def window_everywhere(self) -> int | None:
        """The window when every layer has it: then no query reads the keys before it again."""
        return self.layer_windows[0] if len(set(self.layer_windows)) == 1 else None

    @property
    def served_context(self) -> int:
        """The longest context the engine can serve: asked for, capped by the positions."""
        return min(n for n in (self.max_model_len, self.max_position_embeddings) if n)

    @classmethod
    def from_hf_config(cls, config: dict, max_model_len: int | None = None) -> LlamaArgs:
        """The arguments of an HF config.json; a key it lacks, or a size that is not a positive
        integer, is a ValueError naming it (not a KeyError, or a TypeError deep in torch)."""
        try:
            args = cls._from_hf_config(with_hf_defaults(config), max_model_len)
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"config.json holds a value of the wrong type ({exc})") from None
        for name, key in _SIZES.items():
            value = getattr(args, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json's {key} must be a positive integer, not {value!r}")
        return args

    @classmethod
    def _from_hf_config(cls, config: dict, max_model_len: int | None) -> LlamaArgs:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in BASE_MODELS:
            arch, config = BASE_MODELS[arch], {**config, "tie_word_embeddings": True}
        num_labels = len(classifier_labels(config))
        arch = CLASSIFIERS.get(arch, arch)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; driftgate serves "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}, their headless base models "
                             f"and the sequence classifiers {', '.join(sorted(CLASSIFIERS))}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        gemma = _gemma(config, arch) if arch.startswith("Gemma") else {}
        if "full_attention" in rope:  # rotary settings per layer type (Gemma 3 under transformers 5, OLMo 3)
            if arch == "Olmo3ForCausalLM":  # its windowed layers rotate unscaled, as Gemma 3's local ones
                gemma["local_rope_theta"] = float(rope.get("sliding_attention", rope["full_attention"])["rope_theta"])
            rope = rope["full_attention"]
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        if scaling is not None and "original_max_position_embeddings" in config:  # Phi-3 keeps it beside rope_scaling
            scaling = {"original_max_position_embeddings": config["original_max_position_embeddings"], **scaling}
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=(arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False))
                            or (arch == "Qwen2MoeForCausalLM" and config.get("qkv_bias", True))),
            o_proj_bias=not arch.startswith("Qwen2") and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "OlmoeForCausalLM",
                             *POST_NORM_ARCHITECTURES),
            qk_norm_full=arch == "OlmoeForCausalLM" or arch in POST_NORM_ARCHITECTURES,
            post_norms=arch in POST_NORM_ARCHITECTURES,
            clip_qkv=config.get("clip_qkv"),
            layer_windows=_layer_windows(config, arch),
            rotary_dim=int(head_dim * partial),
            checkpoint_fuses=arch == "Phi3ForCausalLM",
            max_model_len=max_model_len,
            num_labels=num_labels,
            rope_layers=tuple(bool(r) for r in config.get("no_rope_layers") or [1] * config["num_hidden_layers"]),
            **gemma,
            **(_granite(config) if arch == "GraniteForCausalLM" else {}),
            **(_moe(config, arch) if arch in MOE_ARCHITECTURES else {}),
        )


# read from config.json alone: the model's sizes (a class default would build a model of another
# shape, not say the key is missing), and the rotary settings transformers 5 restates in its own form
_OWN_READING = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "rope_parameters", "rope_scaling", "rope_theta"})


def with_hf_defaults(config: dict) -> dict:
    """config.json with what it leaves out as the model's transformers config class fills it in:
    Gemma 2's window and its alternating local and global layers, Gemma's tied embeddings and
    logit caps, Phi-3's and OLMo's norm epsilon, SmolLM3's layers without rotary. The reference
    the engine answers like reads a missing key so; a config transformers cannot build is used as
    it is (the engine's own fallbacks then hold)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice on how to write a config is for their loader's users
    try:
        defaults = AutoConfig.for_model(**copy.deepcopy(config)).to_dict()  # it writes into nested dicts
    except Exception:  # noqa: BLE001 — whatever the class refuses (its own validators' errors vary), the engine checks itself
        return config
    finally:
        hf_logging.set_verbosity(verbosity)
    return {**{k: v for k, v in defaults.items() if k not in _OWN_READING}, **config}


def _gemma(config: dict, arch: str) -> dict:
    """Gemma 2's and 3's departures from the Llama block, as LlamaArgs fields (Gemma 3's local
    layers have their own rotary base; Gemma 2 caps its attention scores and logits)."""
    fields = {"sandwich_norms": True, "norm_offset": 1.0, "embed_scale": config["hidden_size"] ** 0.5,
              "activation": "gelu_tanh", "attn_scale": config["query_pre_attn_scalar"] ** -0.5,
              "attn_softcap": config.get("attn_logit_softcapping") or None,
              "logit_softcap": config.get("final_logit_softcapping") or None}
    if arch == "Gemma3ForCausalLM":
        rope = config.get("rope_parameters") or {}
        local = rope.get("sliding_attention", {}).get("rope_theta") or config.get("rope_local_base_freq", 10000.0)
        fields["local_rope_theta"] = float(local)
    return fields


def _granite(config: dict) -> dict:
    """Granite's multipliers, as LlamaArgs fields (its attention_multiplier replaces head_dim ** -0.5)."""
    return {"embed_scale": config.get("embedding_multiplier", 1.0), "attn_scale": config.get("attention_multiplier"),
            "residual_multiplier": config.get("residual_multiplier", 1.0),
            "logit_scale": 1.0 / config.get("logits_scaling", 1.0)}


def _moe(config: dict, arch: str) -> dict:
    """The mixture-of-experts fields. Mixtral routes in every layer and always renormalizes; Qwen's
    MoE (and OLMoE, which lists neither) routes in every decoder_sparse_step-th layer not listed in
    mlp_only_layers."""
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 names both so
    fields = {"num_experts": num_experts, "experts_per_token": config["num_experts_per_tok"]}
    if arch == "MixtralForCausalLM":
        return {**fields, "moe_layers": (True,) * num_layers, "expert_intermediate_size": config["intermediate_size"]}
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    return {**fields, "moe_layers": tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                                          for i in range(num_layers)),
            "expert_intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
            "renormalize_experts": bool(config.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": (config.get("shared_expert_intermediate_size") or 0
                                                if arch == "Qwen2MoeForCausalLM" else 0)}


def _layer_windows(config: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, from config.json's layer_types where it lists them; a Qwen
    config without them windows the layers from max_window_layers on (a Qwen3-MoE every layer),
    and only under use_sliding_window (its sliding_window is otherwise unused)."""
    num_layers, window = config["num_hidden_layers"], config.get("sliding_window")
    types = config.get("layer_types")
    if types is None and "sliding_window_pattern" in config:  # older Gemma 3 configs: every n-th layer is global
        pattern = config["sliding_window_pattern"]
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if types is None and arch.startswith("Qwen"):
        first = num_layers
        if config.get("use_sliding_window"):  # transformers windows every layer of a Qwen3-MoE
            first = 0 if arch == "Qwen3MoeForCausalLM" else config.get("max_window_layers", num_layers)
        types = ["full_attention"] * first + ["sliding_attention"] * (num_layers - first)
    if not window:
        return (None,) * num_layers
    return tuple(window if types is None or types[i] == "sliding_attention" else None for i in range(num_layers))


def _shards(args: LlamaArgs, prefix: str, fused: str, parts: dict[str, int]) -> tuple[list[int], list[str]]:
    """(output sizes, checkpoint names) of a fused Linear: one shard per checkpoint tensor, so one
    for a checkpoint that stores the fused matrix itself (Phi-3), as quantization then writes it too."""
    if args.checkpoint_fuses:
        return [sum(parts.values())], [f"{prefix}.{fused}"]
    return list(parts.values()), [f"{prefix}.{name}" for name in parts]


def _rms_norm(args: LlamaArgs, width: int, dtype: torch.dtype) -> RMSNorm:
    """The model's RMSNorm: Gemma's (1 + w) weights and OLMo's stay fp32 and scale before rounding, as
    their references do."""
    return RMSNorm(width, args.rms_norm_eps, dtype, scale_in_fp32=bool(args.norm_offset) or args.post_norms)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, prefix: str, quant_config, dtype: torch.dtype,
                 rotary: RotaryEmbedding | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        sizes, names = _shards(args, prefix, "qkv_proj", {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size})
        self.qkv_proj = make_linear(args.hidden_size, sizes, bias=args.attention_bias, prefixes=names,
                                    quant_config=quant_config, dtype=dtype)
        self.o_proj = make_linear(q_size, [args.hidden_size], bias=args.o_proj_bias, prefixes=[f"{prefix}.o_proj"],
                                  quant_config=quant_config, dtype=dtype)
        self.rotary = rotary  # shared by every layer; None in a layer without positions (SmolLM3's NoPE)
        self.attn = Attention(layer_idx, args.num_heads, args.num_kv_heads, args.head_dim,
                              args.layer_windows[layer_idx], args.attn_scale, args.attn_softcap)
        self.qk_size = q_size + kv_size
        self.qk_norm_full, self.clip_qkv = args.qk_norm_full, args.clip_qkv
        q_width, k_width = (q_size, kv_size) if args.qk_norm_full else (args.head_dim, args.head_dim)
        self.q_norm = _rms_norm(args, q_width, dtype) if args.qk_norm else None
        self.k_norm = _rms_norm(args, k_width, dtype) if args.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm_full:  # OLMoE: q and k normed whole, before splitting into heads
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.qk_size - self.num_heads * self.head_dim,
                                 qkv.shape[1] - self.qk_size], dim=1)
            qkv = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        # q and k sit side by side in each row: rotate both heads at once
        qk = qkv[:, :self.qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous())], dim=1)
        if self.rotary is not None:
            qk = self.rotary(positions, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KV, D]
        v = qkv[:, self.qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) · up(x)); `names` are the checkpoint's for gate, up and down (Mixtral's
    experts call them w1, w3, w2)."""

    def __init__(self, args: LlamaArgs, prefix: str, quant_config, dtype: torch.dtype,
                 intermediate_size: int | None = None, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        inter = intermediate_size or args.intermediate_size
        gate, up, down = names
        sizes, shard_names = _shards(args, prefix, "gate_up_proj", {gate: inter, up: inter})
        self.gate_up_proj = make_linear(args.hidden_size, sizes, bias=args.mlp_bias, prefixes=shard_names,
                                        quant_config=quant_config, dtype=dtype)
        self.down_proj = make_linear(inter, [args.hidden_size], bias=args.mlp_bias,
                                     prefixes=[f"{prefix}.{down}"], quant_config=quant_config, dtype=dtype)
        self.act = gelu_tanh_and_mul if args.activation == "gelu_tanh" else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Mixture of experts: a router scores every expert for each token, the top experts_per_token
    run on it, and their outputs are summed weighted by the router's softmax (renormalized over
    the picked ones where the model does). Qwen2-MoE adds a shared expert gated by a sigmoid.

    The router (and the shared expert's gate) stay unquantized, as vLLM and llm-compressor keep them.
    """

    def __init__(self, args: LlamaArgs, prefix: str, quant_config, dtype: torch.dtype):
        super().__init__()
        mixtral = args.architecture == "MixtralForCausalLM"
        prefix = f"{prefix.rpartition('.')[0]}.block_sparse_moe" if mixtral else prefix
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        self.top_k, self.renormalize = args.experts_per_token, args.renormalize_experts
        self.gate = make_linear(args.hidden_size, [args.num_experts], bias=False, prefixes=[f"{prefix}.gate"],
                                quant_config=quant_config, dtype=dtype, quantizable=False)
        self.experts = nn.ModuleList(LlamaMLP(args, f"{prefix}.experts.{e}", quant_config, dtype,
                                              args.expert_intermediate_size, names)
                                     for e in range(args.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if args.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(args, f"{prefix}.shared_expert", quant_config, dtype,
                                          args.shared_expert_intermediate_size)
            self.shared_expert_gate = make_linear(args.hidden_size, [1], bias=False,
                                                  prefixes=[f"{prefix}.shared_expert_gate"],
                                                  quant_config=quant_config, dtype=dtype, quantizable=False)
        self.calibrate_all_experts = False  # calibration: every expert sees every token (its outputs unused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # the (token, expert) pairs grouped by expert: each expert runs once on its rows
        order = chosen.flatten().argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        grouped = None if self.calibrate_all_experts else x[tokens]
        outputs, start = [], 0
        for expert, n in zip(self.experts, counts, strict=True):
            if self.calibrate_all_experts:
                outputs.append(expert(x)[tokens[start:start + n]])
            elif n:
                outputs.append(expert(grouped[start:start + n]))
            start += n
        routed = torch.cat(outputs) * weights.to(x.dtype).flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, tokens, routed)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, quant_config, dtype: torch.dtype,
                 rotary: RotaryEmbedding | None):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = None if args.post_norms else _rms_norm(args, args.hidden_size, dtype)
        self.self_attn = LlamaAttention(args, layer_idx, f"{prefix}.self_attn", quant_config, dtype, rotary)
        self.post_attention_layernorm = _rms_norm(args, args.hidden_size, dtype)
        moe = bool(args.moe_layers) and args.moe_layers[layer_idx]
        self.mlp = (SparseMoE if moe else LlamaMLP)(args, f"{prefix}.mlp", quant_config, dtype)
        if args.sandwich_norms:  # Gemma: the MLP's input norm, and one on its output
            self.pre_feedforward_layernorm = _rms_norm(args, args.hidden_size, dtype)
        if args.sandwich_norms or args.post_norms:
            self.post_feedforward_layernorm = _rms_norm(args, args.hidden_size, dtype)
        self.sandwich_norms, self.post_norms = args.sandwich_norms, args.post_norms
        self.residual_multiplier = args.residual_multiplier

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: ForwardContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden, residual); the block's output is their sum (norms fuse the add)."""
        if self.post_norms:  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x))
            x = hidden if residual is None else hidden + residual
            x = x + self.post_attention_layernorm(self.self_attn(x, positions, ctx))
            return self.post_feedforward_layernorm(self.mlp(x)), x
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, ctx)
        if self.residual_multiplier != 1.0:  # Granite: each block's output scaled before its residual add
            hidden = hidden * self.residual_multiplier
        if self.sandwich_norms:  # the attention's output is normed before its residual add
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return (hidden * self.residual_multiplier if self.residual_multiplier != 1.0 else hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, quant_config, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.dtype = dtype  # the table may be held narrower (prepack_for_cpu): lookups widen to this
        # a tied lm_head's CPU panels, once packed: lookups read their rows, and the table is dropped
        self.embedding_panels: torch.Tensor | None = None
        self.embed_scale = args.embed_scale
        self.rotary = RotaryEmbedding(args.rotary_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling,
                                      args.served_context)
        # Gemma 3's windowed layers rotate with their own, unscaled base
        local = self.rotary if args.local_rope_theta is None else RotaryEmbedding(
            args.rotary_dim, args.max_position_embeddings, args.local_rope_theta, None)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, quant_config, dtype,
                         None if not args.rope_layers[i] else local if args.layer_windows[i] else self.rotary)
            for i in range(args.num_layers))
        self.norm = _rms_norm(args, args.hidden_size, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, hidden], scaled (Gemma) in the model's dtype, as the reference scales it."""
        if self.embedding_panels is not None:
            hidden = panel_matmul.panel_rows(self.embedding_panels, input_ids, self.embed_tokens.embedding_dim)
        else:
            hidden = self.embed_tokens(input_ids)
        hidden = hidden.to(self.dtype)
        return hidden if self.embed_scale == 1.0 else hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext | None = None) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Flat-batch model: tokens of every sequence in one [T] tensor; logits only where asked."""

    def __init__(self, args: LlamaArgs, quant_config=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
        self.quantized_linears = quant_config is not None and bool(quant_config.groups)
        self.model = LlamaModel(args, quant_config, dtype)
        # a classifier's head maps the pooled hidden state to its classes, and it has no LM head
        self.score = None
        if args.num_labels:
            self.score = make_linear(args.hidden_size, [args.num_labels], bias=False, prefixes=["score"],
                                     quant_config=quant_config, dtype=dtype, quantizable=False)
        if args.tie_word_embeddings or args.num_labels:
            self.lm_head = None
        else:
            self.lm_head = make_linear(args.hidden_size, [args.vocab_size], bias=False, prefixes=["lm_head"],
                                       quant_config=quant_config, dtype=dtype)
        self.packed_embedding: torch.Tensor | None = None  # the tied lm_head, CPU-packed
        self.table_laid_out = False  # the embedding table held for serving (`lay_out_table`)
        self.fused_decode: FusedDecode | None = None  # decode-only steps in one C call, once packed

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its embedding table may be held narrower, and its
        first parameter is that table)."""
        return self.model.dtype

    def serve_context(self, served_context: int) -> None:
        """Serve at most `served_context` tokens (fewer than built for: the KV cache holds no more)."""
        self.model.rotary.serve(served_context)

    def prepack_for_cpu(self) -> None:
        """Serving-time weight layout for CPU matmuls. The embedding table is kept once: a tied
        one's lookups read the lm_head's panels; an untied BF16 table served in fp32 is held in bf16.

        A checkpoint with quantized Linears keeps its lm_head unquantized but, as its dtype (bf16)
        says and as vLLM serves it, multiplies bf16-rounded inputs by it, at twice the fp32 rate
        where the CPU has AVX-512 BF16; a model without quantized Linears keeps float32 inputs (the
        oracle's arithmetic)."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepack"):
                self.prepack_linear(module)
        if not self.table_laid_out:
            self.lay_out_table(self.model.embed_tokens.weight)
        self.fused_decode = FusedDecode.build(self.args, self.model.layers, self.model.norm)

    def lay_out_table(self, table: torch.Tensor) -> bool:
        """Hold the embedding table for CPU serving, made from `table` (the loaded one, or the
        checkpoint's tensor as the loader reads it, so that a BF16 table never becomes a float32
        one whole): a tied table becomes the lm_head's panels, whose rows lookups read; an untied
        BF16 table served in fp32, read by lookups alone, is held in bf16 (half the bytes, every
        row widened exactly). Returns whether it was (else the table stays as loaded)."""
        embed = self.model.embed_tokens
        served_fp32 = embed.weight.dtype == torch.float32
        # the checkpoint's tensor stands for the table only where it is served in fp32 on the CPU (a
        # CUDA model's, or a bf16 one's, is the table as loaded)
        if embed.weight.device.type != "cpu" or (table is not embed.weight and not served_fp32):
            return False
        if self.lm_head is None and self.score is None:
            self.packed_embedding = panel_matmul.pack(table, bf16_activations=self.quantized_linears, widen=served_fp32)
        if self.packed_embedding is not None:  # one copy of a tied table: the head's panels serve lookups too
            self.model.embedding_panels = self.packed_embedding
            embed.weight = nn.Parameter(embed.weight.new_empty(0, embed.weight.shape[1]), requires_grad=False)
        elif (self.lm_head is not None or self.score is not None) and served_fp32 \
                and table.dtype in (torch.float32, torch.bfloat16) and panel_matmul.holds_bf16_values(table):
            embed.weight = nn.Parameter(table.detach().to(torch.bfloat16, copy=True), requires_grad=False)
        else:
            return False
        self.table_laid_out = True
        return True

    def prepack_linear(self, module: nn.Module) -> int:
        """One Linear's CPU layout (`prepack_for_cpu`'s first part; the loader runs it as each
        Linear is loaded, so a served model is never held whole in float32); returns the bytes of
        the plain weight freed. A second call keeps the panels."""
        if module is self.lm_head and isinstance(module, DenseLinear):
            return module.prepack(bf16_activations=self.quantized_linears)
        return module.prepack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext | None = None) -> torch.Tensor:
        if self.fused_decode is not None and self.fused_decode.accepts(ctx):
            return self.fused_decode(self.model.embed(input_ids), positions, ctx)
        return self.model(input_ids, positions, ctx)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's pooled final hidden states [N, hidden] → fp32 class logits [N, num_labels]."""
        return self.score(hidden).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → fp32 logits [N, vocab] (Gemma 2's capped at ±logit_softcap)."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.weight if self.packed_embedding is None else self.packed_embedding
            logits = dense_matmul(hidden, weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.args.logit_scale != 1.0:  # Granite divides its logits by logits_scaling
            logits = logits * self.args.logit_scale
        cap = self.args.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
