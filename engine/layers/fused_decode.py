"""A decode step's whole block stack in one C call (engine/csrc/decode_step.c), for CPUs.

At batch 1 a small model's decode step spent about half its time in Python between kernels
(SmolLM2-135M: 16.9 → 11.1 ms a token in fp32, 18.0 → 8.5 ms in W8A8). When a step holds only
decode tokens and every layer runs on a C kernel (fp32 activations, panel-packed dense, int8
weight-only, W8A8, W4A8 or FP8 weights, an fp32, bf16 or fp8 KV cache; LoRA adapters included, each
on its rows), the layers run in one call instead: the same kernels in the same order, so the same
floats. Every other step, and every model this does not describe, goes through the modules,
which stay the oracle.
`DRIFTGATE_FUSED_DECODE=0` turns it off (to measure what it saves).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers import cpu_kernels
from engine.layers.attention import ForwardContext
from engine.layers.cpu_attention import CACHE_TYPES, fp8_table
from engine.layers.linear import DenseLinear
from engine.layers.panel_matmul import ACT_NONE
from engine.lora import LoRALinear, LoRAStep

if TYPE_CHECKING:
    from engine.models.llama import LlamaArgs

(LINEAR_F32, LINEAR_BF16, LINEAR_INT8, LINEAR_W8A8, LINEAR_FP8, LINEAR_FP8_DOT, LINEAR_INT4, LINEAR_W4A8,
 LINEAR_FP8_DOT_GROUPS) = range(9)
_STATUS = {-1: "no memory for the step's scratch", -2: "the block size is not a power of two",
           -3: "a Linear kernel this build lacks"}


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("group_size", ctypes.c_int32), ("act", ctypes.c_int32), ("act_group", ctypes.c_int32),
                ("input_scale", ctypes.c_float),
                ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("sums", ctypes.c_void_p), ("zeros", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("loras", ctypes.c_void_p)]


class _LoRA(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("rank", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("pre_mlp_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_table", ctypes.c_void_p), ("v_table", ctypes.c_void_p), ("window", ctypes.c_int32)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("kv_type", ctypes.c_int32), ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
                ("rotary_dim", ctypes.c_int32), ("gelu", ctypes.c_int32), ("attn_softcap", ctypes.c_float),
                ("residual_multiplier", ctypes.c_float), ("post_norms", ctypes.c_int32),
                ("qk_norm_full", ctypes.c_int32), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_Layer)), ("lora_groups", ctypes.c_int32), ("lora_rank", ctypes.c_int32),
                ("lora_offsets", ctypes.c_void_p), ("lora_rows", ctypes.c_void_p)]


_ARGTYPES = (ctypes.POINTER(_Model), *[ctypes.c_void_p] * 5, *[ctypes.c_int] * 4)


def _kernel() -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("decode_step", "decode_step", _ARGTYPES, ctypes.c_int)


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _describe(linear: nn.Module, keep: list[torch.Tensor]) -> _Linear | None:
    """The C view of one Linear, or None where its kernel is not one decode_step.c calls.
    Tensors the view points into are appended to `keep` (they must outlive it)."""
    kernel = getattr(linear, "kernel", None)
    if getattr(linear, "fake_quantizes_inputs", False):  # NVFP4 activations: rounded in torch first
        return None
    dense = isinstance(linear, DenseLinear)  # its kernel names its weight's layout
    weight = getattr(linear, "weight" if dense else "kernel_weight", None)
    if weight is None or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    bias = _float32(linear.bias)
    n, k = sum(linear.output_sizes), linear.input_size
    scales = sums = zeros = None
    if kernel == "panel-f32":
        kind = LINEAR_F32
    elif kernel == "panel-bf16":
        kind = LINEAR_BF16
    elif kernel == "int8panel":
        kind, scales = LINEAR_INT8, linear.kernel_scales
    elif kernel == "int4panel":
        kind, scales, zeros = LINEAR_INT4, linear.kernel_scales, linear.kernel_zeros
    elif kernel == "w8a8panel":
        kind, scales, sums = LINEAR_W8A8, linear.kernel_scales, linear.kernel_sums
    elif kernel == "w4a8panel":
        kind, scales, sums = LINEAR_W4A8, linear.kernel_scales, linear.kernel_sums
    elif kernel == "fp8panel":
        kind, scales = LINEAR_FP8, linear.kernel_scales
    elif kernel == "fp8dot":
        kind, scales = LINEAR_FP8_DOT, linear.kernel_scales
    elif kernel == "fp8dot-groups":
        kind, scales = LINEAR_FP8_DOT_GROUPS, linear.kernel_scales
    else:
        return None
    grouped = (LINEAR_INT8, LINEAR_INT4, LINEAR_FP8, LINEAR_W4A8, LINEAR_FP8_DOT_GROUPS)
    group = k // scales.shape[1] if kind in grouped else k
    rounded = (LINEAR_FP8, LINEAR_FP8_DOT, LINEAR_FP8_DOT_GROUPS)
    act, input_scale, act_group = linear.input_rounding() if kind in rounded else (ACT_NONE, 0.0, 0)
    keep.extend(t for t in (weight, scales, sums, zeros, bias) if t is not None)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return _Linear(kind, n, k, group, act, act_group, input_scale, weight.data_ptr(), ptr(scales), ptr(sums),
                   ptr(zeros), ptr(bias))


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The four Linears of a decoder layer the C step multiplies by, in its order."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class FusedDecode:
    """The C description of a Llama model's layers, built once after `prepack_for_cpu`."""

    def __init__(self, model_args: LlamaArgs, layers: nn.ModuleList, final_norm: nn.Module,
                 descriptions: list[tuple[_Linear, ...]], keep: list[torch.Tensor]):
        self._keep = keep
        # LoRA wrappers (engine/lora.py) around each layer's q/k/v, o, gate/up and down Linears:
        # each Linear is bound to the factors of the step's adapters, in the step's group order
        self._lora_wrappers = [tuple(m if isinstance(m, LoRALinear) else None for m in _projections(layer))
                               for layer in layers]
        wrappers = [w for linears in self._lora_wrappers for w in linears if w is not None]
        self._lora_step: LoRAStep | None = wrappers[0].step if wrappers else None
        self._lora_bound: tuple[int, ...] = ()
        self._lora_keep: list[ctypes.Array] = []
        self._lora_rows: torch.Tensor | None = None
        self._layers = (_Layer * len(layers))()
        for layer, c_layer, linears in zip(layers, self._layers, descriptions, strict=True):
            if layer.input_layernorm is not None:  # OLMo 2 has none: its norms sit on the block's outputs
                c_layer.input_norm = layer.input_layernorm.weight.data_ptr()
            c_layer.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            if layer.self_attn.q_norm is not None:
                c_layer.q_norm = layer.self_attn.q_norm.weight.data_ptr()
                c_layer.k_norm = layer.self_attn.k_norm.weight.data_ptr()
            if layer.sandwich_norms:
                c_layer.pre_mlp_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
            if layer.sandwich_norms or layer.post_norms:
                c_layer.post_mlp_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            rotary = layer.self_attn.rotary  # None: a layer without positions (SmolLM3's NoPE layers)
            if rotary is not None:
                c_layer.cos, c_layer.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
            c_layer.qkv, c_layer.o, c_layer.gate_up, c_layer.down = linears
            c_layer.window = layer.self_attn.attn.sliding_window or 0
        self._attention = [layer.self_attn.attn for layer in layers]
        attn = self._attention[0]
        self._model = _Model(len(layers), model_args.hidden_size, model_args.num_heads, model_args.num_kv_heads,
                             model_args.head_dim, model_args.intermediate_size,
                             CACHE_TYPES[torch.float32],  # until a cache is bound (__call__)
                             final_norm.eps, attn.scale, model_args.rotary_dim, int(model_args.activation == "gelu_tanh"),
                             attn.softcap or 0.0, model_args.residual_multiplier, int(model_args.post_norms),
                             int(model_args.qk_norm_full), final_norm.weight.data_ptr(),
                             self._layers)
        self._cache_bound: object | None = None
        self._fp8_scales_bound: list[torch.Tensor] = []  # each layer's K and V scale tensors, as bound
        self._fp8_keep: list[torch.Tensor] = []
        # the hook dicts of every module a hook could watch (layers share their rotary modules: once each):
        # torch registers and removes hooks in these same dicts, and testing ~600 dicts for emptiness
        # costs ~35 µs a step where reading them through each module's attributes cost ~240 µs
        # (after a step's weights have streamed through the caches, every object is a cache miss)
        observable = dict.fromkeys([m for layer in layers for m in layer.modules()] + [final_norm])
        self._hook_dicts = [d for m in observable for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def build(cls, model_args: LlamaArgs, layers: nn.ModuleList, final_norm: nn.Module) -> FusedDecode | None:
        """The fused step for these layers, or None where some part has no C kernel here (the
        experts of a mixture-of-experts model, OLMoE's q/k/v clamps: the module path runs those)."""
        if os.environ.get("DRIFTGATE_FUSED_DECODE", "1") == "0" or _kernel() is None:
            return None
        if model_args.is_moe or model_args.clip_qkv is not None:
            return None
        tensors = [final_norm.weight]
        for layer in layers:
            norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                     layer.self_attn.k_norm, getattr(layer, "pre_feedforward_layernorm", None),
                     getattr(layer, "post_feedforward_layernorm", None)]
            tensors += [norm.weight for norm in norms if norm is not None]
            if layer.self_attn.rotary is not None:
                tensors += [layer.self_attn.rotary.cos, layer.self_attn.rotary.sin]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return None
        keep: list[torch.Tensor] = []
        descriptions = []
        for layer in layers:
            # a LoRA wrapper's base: the adapters' factors are bound per step (_bind_lora)
            linears = tuple(_describe(getattr(m, "base", m), keep) for m in _projections(layer))
            if any(d is None for d in linears):
                return None
            descriptions.append(linears)
        return cls(model_args, layers, final_norm, descriptions, keep)

    def accepts(self, ctx: ForwardContext | None) -> bool:
        """Whether this step is one the C path runs: decode tokens only, on an fp32, bf16 or fp8
        cache (fp8 once its scales are known: dynamic ones come from the first prefill), and no
        hook watching a module (`LLM.score_with_layer_states` reads layer outputs through hooks)."""
        if ctx is None:
            return False
        meta, cache = ctx.metadata, ctx.kv_cache
        return (meta.paged_decode is not None and meta.paged_prefill is None and not meta.prefills
                and not meta.decode_groups
                and cache.dtype in CACHE_TYPES and cache.k[0].device.type == "cpu"
                and not (cache.is_fp8 and any(a.scales_pending for a in self._attention))
                and not any(self._hook_dicts) and self._lora_runs())

    def _lora_runs(self) -> bool:
        """Whether every adapter of the step has its factors as CPU panels (or there is none)."""
        step = self._lora_step
        if step is None or not step.groups:  # most steps: no walk over the wrappers
            return True
        indices = {index for index, _ in step.groups}
        return all(factors.packed for linears in self._lora_wrappers for w in linears if w is not None
                   for index, factors in w.factors.items() if index in indices)

    def _bind_lora(self, rows: int) -> None:
        """Point each Linear at the factors of the step's adapters, in group order (rebuilt when
        that order changes), and the model at the groups' rows."""
        groups = [] if self._lora_step is None else self._lora_step.groups
        order = tuple(index for index, _ in groups)
        if order != self._lora_bound:
            keep, widest = [], 0
            for c_layer, wrappers in zip(self._layers, self._lora_wrappers, strict=True):
                for name, wrapper in zip(("qkv", "o", "gate_up", "down"), wrappers, strict=True):
                    factors = [None if wrapper is None else wrapper.factors.get(index) for index in order]
                    c_linear = getattr(c_layer, name)  # a view: assignments reach the layer
                    if not any(factors):
                        c_linear.loras = None
                        continue
                    # B's panels are [out / 16, R, 16]: R, the padded rank
                    table = (_LoRA * len(order))(*[_LoRA() if f is None else _LoRA(f.a.data_ptr(), f.b.data_ptr(),
                                                                                    f.b.shape[1]) for f in factors])
                    keep.append(table)
                    c_linear.loras = ctypes.addressof(table)
                    widest = max([widest] + [f.b.shape[1] for f in factors if f is not None])
            self._model.lora_groups, self._model.lora_rank = len(order), widest
            self._lora_keep, self._lora_bound = keep, order
        if not groups:
            return
        members = [torch.arange(rows) if r is None else r.cpu() for _, r in groups]
        offsets = torch.tensor([0] + [len(m) for m in members], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lora_rows = torch.cat([offsets, *members]).to(torch.int32)  # offsets, then each group's rows
        self._model.lora_offsets = lora_rows.data_ptr()
        self._model.lora_rows = lora_rows.data_ptr() + 4 * len(offsets)
        self._lora_rows = lora_rows  # read by the C call

    def __call__(self, embeddings: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """embeddings [T, hidden] → the final norm's output [T, hidden], the KV cache written."""
        cache, meta = ctx.kv_cache, ctx.metadata
        if self._cache_bound is not cache:
            for c_layer, k, v in zip(self._layers, cache.k, cache.v, strict=True):
                c_layer.k_cache, c_layer.v_cache = k.data_ptr(), v.data_ptr()
            self._model.kv_type = CACHE_TYPES[cache.dtype]
            self._cache_bound = cache
        if cache.is_fp8:
            self._bind_fp8_scales(cache.k[0].shape[1], cache.dtype)
        self._bind_lora(embeddings.shape[0])
        decode = meta.paged_decode
        hidden = embeddings.float().contiguous()  # a fresh lookup: the C call writes it in place
        positions, slots = positions.to(torch.int64).contiguous(), meta.slot_mapping.to(torch.int64).contiguous()
        status = _kernel()(ctypes.byref(self._model), hidden.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                           decode.block_tables.data_ptr(), decode.context_lens.data_ptr(), hidden.shape[0],
                           decode.block_tables.shape[1], decode.block_size, torch.get_num_threads())
        if status:
            raise RuntimeError(f"fused decode step failed: {_STATUS.get(status, status)}")
        return hidden

    def _bind_fp8_scales(self, num_kv_heads: int, dtype: torch.dtype) -> None:
        """Each layer's K/V decode tables (which hold the scales the C step stores with), rebuilt
        whenever a layer's scale tensor is replaced (the loader's, or the first prefill's under
        dynamic scales)."""
        scales = [s for a in self._attention for s in (a.k_scale, a.v_scale)]
        bound = self._fp8_scales_bound
        if len(bound) == len(scales) and all(s is t for s, t in zip(scales, bound, strict=True)):
            return
        keep = []
        for c_layer, attn in zip(self._layers, self._attention, strict=True):
            tables = [fp8_table(s, num_kv_heads, dtype) for s in (attn.k_scale, attn.v_scale)]
            c_layer.k_table, c_layer.v_table = (t.data_ptr() for t in tables)
            keep += tables
        self._fp8_keep = keep
        self._fp8_scales_bound = scales
