"""The CPU matmul kernel (engine/csrc/panel_matmul.c) and the weight layout it reads.

A weight [N, K] is re-laid out as 16-column panels [N / 16, K, 16], so decode's few activation
rows stream every weight byte exactly once, sequentially. Measured against oneDNN's blocked
layout on SmolLM2's fp32 shapes (`driftgate bench matmul`): 1.3–1.4× faster at 1–8 rows,
1.1× at 16–64, on par from 256 rows up.
"""

from __future__ import annotations

import ctypes

import torch

from engine import host_memory
from engine.layers import cpu_kernels

PANEL = 16
_ARGTYPES = (*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 4)


def _kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr | None:
    symbol = "panel_matmul_bf16" if dtype == torch.bfloat16 else "panel_matmul_f32"
    return cpu_kernels.kernel("panel_matmul", symbol, _ARGTYPES, None)


def _panels(t: torch.Tensor, lasting: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N, C] → [N / 16, C, 16] in `dtype` (default t's): row n of t lands in panel n // 16, lane
    n % 16; in the weights' arena when `lasting`, else a tensor of its own, freed with it. Cast
    as it is copied: no full-size copy of t is made on the way."""
    n, c = t.shape
    arranged = t.detach().reshape(n // PANEL, PANEL, c).transpose(1, 2)
    shape, dtype = tuple(arranged.shape), dtype or t.dtype
    return (host_memory.WEIGHTS.empty(shape, dtype) if lasting else torch.empty(shape, dtype=dtype)).copy_(arranged)


def _run(kernel: ctypes._CFuncPtr, x: torch.Tensor, k: int, n: int, weights: tuple[torch.Tensor, ...],
         bias: torch.Tensor | None, *sizes: int) -> torch.Tensor:
    """Call a panel kernel on x [..., K] as float32 rows → y [..., N] float32.

    Called ~120 times per decode step, so tensors already in the kernel's form (2-D, float32,
    contiguous: the engine's case) skip the conversions, a few microseconds each."""
    x2d = x if x.dim() == 2 else x.reshape(-1, k)
    x2d = _float32_contiguous(x2d)
    y = torch.empty(x2d.shape[0], n, dtype=torch.float32)
    if x2d.shape[0]:
        bias_ptr = None if bias is None else _float32_contiguous(bias).data_ptr()
        failed = kernel(y.data_ptr(), x2d.data_ptr(), *[w.data_ptr() for w in weights], bias_ptr, x2d.shape[0], n, k,
                        *sizes, torch.get_num_threads())
        if failed:  # only kernels that allocate report, and only that
            raise MemoryError(f"{kernel.__name__}: no memory for {x2d.shape[0]} quantized rows")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def _float32_contiguous(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def _fits(weight: torch.Tensor, widen: bool = False) -> bool:
    """A CPU fp32 weight [N, K] of whole 16-column panels (with `widen`, a bf16 one stands for the
    fp32 weight of its values)."""
    dtypes = (torch.float32, torch.bfloat16) if widen else (torch.float32,)
    return weight.device.type == "cpu" and weight.dtype in dtypes and weight.shape[0] % PANEL == 0


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every value of the weight is a bf16 value (a BF16 checkpoint served in fp32), checked
    a few MB at a time: loading a model's largest table makes no full-size temporary."""
    if weight.dtype == torch.bfloat16:
        return True
    rows = max(1, (4 << 20) // max(1, 4 * weight.shape[-1]))
    return all(torch.equal(w, w.bfloat16().float()) for w in weight.detach().split(rows))


def pack(weight: torch.Tensor, *, narrow: bool = True, bf16_activations: bool = False,
         lasting: bool = True, widen: bool = False) -> torch.Tensor | None:
    """weight [N, K] → panels [N / 16, K, 16], or None where the kernel does not apply
    (not a CPU fp32 weight, N not a multiple of 16, or no kernel on this machine). With `widen`
    a bf16 weight is taken for the fp32 weight of its values (a BF16 checkpoint's tensor, packed
    without widening it whole first).

    The model's weights live as long as the engine, in the weights' arena (huge pages, whose
    chunks stay mapped while anything carved from them lives); a weight that may be dropped
    before (a LoRA adapter, unloaded or evicted) is packed with `lasting=False`, on memory of its
    own, or every reload would take its size from the arena for good.

    The panels are bfloat16 when every weight is a bf16 value (a BF16 checkpoint served in
    fp32) and `narrow` is set: the kernel widens them exactly, so the products are the same
    and the weight streams in half the bytes. With `bf16_activations`, such a weight becomes
    `pack_bf16_pairs(weight)` where this CPU can multiply bf16 by bf16."""
    if bf16_activations and (pairs := pack_bf16_pairs(weight, widen)) is not None:
        return pairs
    if not _fits(weight, widen) or _kernel() is None:
        return None
    return _panels(weight, lasting, torch.bfloat16 if narrow and holds_bf16_values(weight) else torch.float32)


def matmul(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [..., K] float32 and W given as `pack(W)` or `pack_bf16_pairs(W)`."""
    if panels.dim() == 4:  # pairs of K: K itself comes from x, and must fill them
        k = x.shape[-1]
        if (k + 1) // 2 != panels.shape[1]:
            raise ValueError(f"x has {k} columns; these bf16 pair panels take {2 * panels.shape[1] - 1} or "
                             f"{2 * panels.shape[1]}")
        kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_bf16_dot", _ARGTYPES, ctypes.c_int)
        return _run(kernel, x, k, panels.shape[0] * PANEL, (panels,), bias)
    num_panels, k, _ = panels.shape
    return _run(_kernel(panels.dtype), x, k, num_panels * PANEL, (panels,), bias)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the [N, k] weight `pack` laid out as `panels` → [len(ids), k] in the panels'
    dtype: an embedding's lookups read its tied lm_head's panels, so the table need not be kept too."""
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < panels.shape[0] * PANEL:
        raise IndexError(f"token ids must be in [0, {panels.shape[0] * PANEL}), got {ids.min()}..{ids.max()}")
    panel, lane = ids // PANEL, ids % PANEL
    if panels.dim() == 4:  # pairs of columns: [N / 16, ceil(k / 2), 16, 2]
        return panels[panel, :, lane, :].reshape(ids.numel(), -1)[:, :k]
    return panels[panel, :, lane]


def bf16_dot_available() -> bool:
    """Whether the bf16 × bf16 kernel runs here (it needs AVX-512 BF16)."""
    probe = cpu_kernels.kernel("panel_matmul", "bf16_dot_available", (), ctypes.c_int)
    return probe is not None and probe() == 1


def pack_bf16_pairs(weight: torch.Tensor, widen: bool = False) -> torch.Tensor | None:
    """weight [N, K] of bf16 values → panels [N / 16, ceil(K / 2), 16, 2] bf16 for the kernel that
    rounds activations to bf16 too (twice the fp32 rate), or None where it does not apply (not a
    CPU fp32 weight of bf16 values, or with `widen` a bf16 one; N not a multiple of 16; or no
    AVX-512 BF16 here)."""
    if not _fits(weight, widen) or not bf16_dot_available() or not holds_bf16_values(weight):
        return None
    n, k = weight.shape
    pairs = host_memory.WEIGHTS.empty((n // PANEL, (k + 1) // 2, PANEL, 2), torch.bfloat16)
    even = k - k % 2  # cast as copied, as `_panels`; an odd K's last column pairs with a zero
    pairs[:, : even // 2].copy_(weight.detach()[:, :even].reshape(n // PANEL, PANEL, even // 2, 2).transpose(1, 2))
    if k % 2:
        pairs[:, -1, :, 0].copy_(weight.detach()[:, -1].reshape(n // PANEL, PANEL))
        pairs[:, -1, :, 1] = 0
    return pairs


_ARGTYPES_INT8 = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 5)
_ARGTYPES_INT4_ZERO = (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 5)  # int8's, with zero points after the scales
# How FP8 W8A8 kernels round their rows through fp8 (engine/csrc/fp8.h's ACT_*): not at all, per
# token (or per token and group of columns), one scale for all rows, or a fixed scale.
ACT_NONE, ACT_FP8_TOKEN, ACT_FP8_TENSOR, ACT_FP8_STATIC = range(4)
_ARGTYPES_FP8_ROUNDED = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 5, ctypes.c_float, ctypes.c_int, ctypes.c_int)


def _kernel_8bit(symbol: str = "panel_matmul_i8") -> ctypes._CFuncPtr | None:
    return cpu_kernels.kernel("panel_matmul", symbol, _ARGTYPES_INT8, None)


def int8_available() -> bool:
    return _kernel_8bit() is not None


def int8_fits(n: int, k: int, num_groups: int) -> bool:
    """Whether an [N, K] weight with `num_groups` equal column groups of scales can run on the kernel."""
    return int8_available() and n % PANEL == 0 and k % num_groups == 0


def pack_int8(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 (any values in int8: int4 and int8 schemes alike), W = qweight · scale
    with scale [N, G] over G equal groups of input columns → (int8 panels [N / 16, K, 16],
    scale panels [N / 16, G, 16]). The caller checks `int8_fits` first."""
    if qweight.device.type != "cpu" or qweight.dtype != torch.int8 or not int8_fits(*qweight.shape, scale.shape[1]):
        raise ValueError(f"the int8 panel kernel does not take a {qweight.dtype} {tuple(qweight.shape)} weight "
                         f"with {scale.shape[1]} scale groups on {qweight.device}")
    return _panels(qweight), _panels(scale.float())


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """Panels [N / 16, C, 16] (`pack_int8`'s weights and scales, any kernel's group scales), or
    [N / 16, C, 16, W] (W consecutive columns a lane: `pack_w8a8`, fp8 and bf16 pairs) → the
    [N, C · W] values they hold."""
    return panels.transpose(1, 2).reshape(panels.shape[0] * PANEL, -1)


def matmul_int8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [..., K] (computed in float32) and W given as `pack_int8(...)`."""
    num_panels, k, _ = panels.shape
    return _run(_kernel_8bit(), x, k, num_panels * PANEL, (panels, scales), bias, k // scales.shape[1])


def int4_fits(n: int, k: int, num_groups: int) -> bool:
    """Whether an int4 [N, K] weight with `num_groups` scale groups can run on the nibble kernel,
    which reads columns four at a time within a group."""
    return int8_fits(n, k, num_groups) and (k // num_groups) % 4 == 0


def pack_int4(qweight: torch.Tensor, scale: torch.Tensor,
              zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Weight-only signed int4 (values in [-8, 7], held in int8) with scale [N, G], and for
    asymmetric schemes zero_point [N, G] (W = (q − zero point) · scale) → (byte panels
    [N / 16, K / 2, 16], each byte two weights: column 2s in its low nibble, 2s + 1 in its high;
    scale panels [N / 16, G, 16]; zero-point panels as floats, or None). Half the bytes of
    `pack_int8`. The caller checks `int4_fits` first."""
    n, k = qweight.shape
    if (qweight.device.type != "cpu" or qweight.dtype != torch.int8 or not int4_fits(n, k, scale.shape[1])
            or qweight.min() < -8 or qweight.max() > 7
            or (zero_point is not None and zero_point.shape != scale.shape)):
        raise ValueError(f"the int4 panel kernel does not take a {qweight.dtype} {(n, k)} weight "
                         f"with {scale.shape[1]} scale groups on {qweight.device}")
    pairs = (qweight[:, 1::2] * 16) | (qweight[:, 0::2] & 0xF)  # fits int8: [-128, 112] | [0, 15]
    zeros = None if zero_point is None else _panels(zero_point.float())
    return _panels(pairs), _panels(scale.float()), zeros


def unpack_int4(panels: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s byte panels [N / 16, K / 2, 16] → the int4 values [N, K] (int8 in −8..7)."""
    pairs = unpack_panels(panels)
    low = ((pairs & 0xF) ^ 8) - 8  # the low nibble, sign-extended
    return torch.stack([low, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)


def matmul_int4(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [..., K] (computed in float32) and W given as `pack_int4(...)`."""
    num_panels, half_k, _ = panels.shape
    k = 2 * half_k
    if zeros is None:
        return _run(_kernel_8bit("panel_matmul_i4"), x, k, num_panels * PANEL, (panels, scales), bias,
                    k // scales.shape[1])
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_i4_zero", _ARGTYPES_INT4_ZERO, None)
    return _run(kernel, x, k, num_panels * PANEL, (panels, scales, zeros), bias, k // scales.shape[1])


def pack_fp8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight [N, K] with scale [N, G] → (byte panels, scale panels). The kernel widens
    each byte to w / 256 exactly, so the scales are stored times 256. Check `int8_fits` first."""
    return pack_int8(weight.view(torch.int8), scale * 256)


def unpack_fp8(panels: torch.Tensor) -> torch.Tensor:
    """`pack_fp8`'s byte panels → the fp8 e4m3 weight [N, K]."""
    return unpack_panels(panels).view(torch.float8_e4m3fn)


def matmul_fp8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, act: int = ACT_NONE,
               static_scale: float = 0.0, act_group: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for x [..., K] (computed in float32) and W given as `pack_fp8(...)`; with `act`,
    each row of x is first rounded through fp8 as matmul_fp8_dot's are, with ACT_FP8_TOKEN a scale
    per `act_group` columns (0: per row; block FP8 scales its inputs per tile width)."""
    num_panels, k, _ = panels.shape
    group = k // scales.shape[1]
    if act == ACT_NONE:
        return _run(_kernel_8bit("panel_matmul_fp8"), x, k, num_panels * PANEL, (panels, scales), bias, group)
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_fp8_rounded", _ARGTYPES_FP8_ROUNDED, ctypes.c_int)
    return _run(kernel, x, k, num_panels * PANEL, (panels, scales), bias, group, act, static_scale, act_group)


_ARGTYPES_FP8_DOT = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 4, ctypes.c_float, ctypes.c_int)


def fp8_dot_fits(n: int) -> bool:
    """Whether an fp8 W8A8 weight with n output channels can run on the bf16 product kernel."""
    return bf16_dot_available() and n % PANEL == 0


def pack_fp8_pairs(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight [N, K] with per-channel scale [N, 1] → (byte panels [N / 16, ceil(K / 2), 16, 2],
    scale [N]). The caller checks `fp8_dot_fits` first."""
    return _fp8_pair_panels(weight, fp8_dot_fits(weight.shape[0])), scale.float().reshape(-1).contiguous()


def _fp8_pair_panels(weight: torch.Tensor, fits: bool) -> torch.Tensor:
    """FP8 e4m3 weight [N, K] → byte panels [N / 16, ceil(K / 2), 16, 2], the fp8 product kernels' layout."""
    n, k = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.float8_e4m3fn or not fits:
        raise ValueError(f"the fp8 product kernel does not take a {weight.dtype} {(n, k)} weight on {weight.device}")
    bytes_ = weight.view(torch.uint8)
    if k % 2:
        bytes_ = torch.nn.functional.pad(bytes_, (0, 1))  # 0x00 is +0 in e4m3
    return host_memory.WEIGHTS.copy(bytes_.reshape(n // PANEL, PANEL, -1, 2).transpose(1, 2))


def unpack_fp8_pairs(panels: torch.Tensor, k: int) -> torch.Tensor:
    """`pack_fp8_pairs`' (or `pack_fp8_pair_groups`') byte panels → the fp8 e4m3 weight [N, k]."""
    return unpack_panels(panels)[:, :k].contiguous().view(torch.float8_e4m3fn)


def matmul_fp8_dot(x: torch.Tensor, panels: torch.Tensor, weight_scales: torch.Tensor, act: int,
                   static_scale: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8(x) Wᵀ + b`` for x [..., K] and W given as `pack_fp8_pairs(...)`, each row of x rounded
    through fp8 as `act` says (per token, one scale for all rows, or `static_scale`)."""
    num_panels, steps, _, _ = panels.shape
    k = x.shape[-1]
    if (k + 1) // 2 != steps:
        raise ValueError(f"x has {k} columns; these fp8 pair panels take {2 * steps - 1} or {2 * steps}")
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_fp8_dot", _ARGTYPES_FP8_DOT, ctypes.c_int)
    return _run(kernel, x, k, num_panels * PANEL, (panels, weight_scales), bias, act, static_scale)


_ARGTYPES_FP8_DOT_GROUPS = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 6)


def fp8_dot_groups_fits(n: int, k: int, group: int, act_group: int) -> bool:
    """Whether a block FP8 weight [N, K], its scales spread to groups of `group` columns and its
    inputs scaled per `act_group`, can run on the grouped fp8 product kernel (whole bf16 pairs)."""
    return fp8_dot_fits(n) and _groups_fit(k, group, act_group)


def _groups_fit(k: int, group: int, act_group: int) -> bool:
    """Scale groups and input groups of whole bf16 pairs, the input groups whole scale groups."""
    return k % 2 == 0 and group > 0 and group % 2 == 0 and k % group == 0 and act_group > 0 and act_group % group == 0


def pack_fp8_pair_groups(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 weight [N, K] with scales [N, G] over G equal column groups → (byte panels as
    `pack_fp8_pairs`', scale panels [N / 16, G, 16]). The caller checks `fp8_dot_groups_fits` first."""
    n, k = weight.shape
    return _fp8_pair_panels(weight, fp8_dot_fits(n) and k % scale.shape[1] == 0), _group_panels(scale.float())


def matmul_fp8_dot_groups(x: torch.Tensor, panels: torch.Tensor, group_scales: torch.Tensor, act_group: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8(x) Wᵀ + b`` for x [..., K] and W given as `pack_fp8_pair_groups(...)`, each row of x
    rounded through fp8 per `act_group` columns with their own scale (block FP8's inputs)."""
    num_panels, steps, _, _ = panels.shape
    k = x.shape[-1]
    if 2 * steps != k:
        raise ValueError(f"x has {k} columns; these fp8 pair panels take {2 * steps}")
    if not _groups_fit(k, k // group_scales.shape[1], act_group):  # shapes only: called every step
        raise ValueError(f"input groups of {act_group} columns do not fit scale groups of "
                         f"{k // group_scales.shape[1]} over {k} (whole pairs, a multiple of the scale group)")
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_fp8_dot_groups", _ARGTYPES_FP8_DOT_GROUPS, ctypes.c_int)
    return _run(kernel, x, k, num_panels * PANEL, (panels, group_scales), bias, k // group_scales.shape[1],
                act_group)


_ARGTYPES_W8A8 = (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 4)


def w8a8_available() -> bool:
    """Whether the exact per-token W8A8 and W4A8 kernels run here (they need AVX2; AVX-512 VNNI
    runs them fastest, with the same floats)."""
    probe = cpu_kernels.kernel("panel_matmul", "w8a8_available", (), ctypes.c_int)
    return probe is not None and probe() == 1


def use_amx(enabled: bool | None = None) -> bool:
    """Whether products run on AMX tiles: W8A8 from 16 rows and W4A8 from 32 (where its groups are
    multiples of 64 columns) on int8 tiles, the bf16 and FP8 products at every row count (so that
    a row's floats do not depend on its batch) on bf16 tiles; by default where the CPU has them and
    DRIFTGATE_AMX is not 0. `enabled` turns the routes on or off, for comparisons: the int8 outputs
    are equal either way, the bf16 ones sum the same products in another order; None only asks."""
    switch = cpu_kernels.kernel("panel_matmul", "use_amx", (ctypes.c_int,), ctypes.c_int)
    return switch is not None and switch(-1 if enabled is None else int(enabled)) == 1


def w8a8_fits(n: int, k: int) -> bool:
    """Whether an int8 [N, K] W8A8 weight can run on the kernel."""
    return w8a8_available() and n % PANEL == 0 and k % 4 == 0


def pack_w8a8(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] → (panels [N / 16, K / 4, 16, 4], 128 · row sums [N] int32).
    The caller checks `w8a8_fits` first."""
    n, k = qweight.shape
    if qweight.device.type != "cpu" or qweight.dtype != torch.int8 or not w8a8_fits(n, k):
        raise ValueError(f"the W8A8 kernel does not take a {qweight.dtype} {(n, k)} weight on {qweight.device}")
    panels = host_memory.WEIGHTS.copy(qweight.reshape(n // PANEL, PANEL, k // 4, 4).transpose(1, 2))
    return panels, (qweight.to(torch.int32).sum(1) * 128).to(torch.int32)


def matmul_w8a8(x: torch.Tensor, panels: torch.Tensor, bias_sums: torch.Tensor, weight_scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``q(x) Wᵀ · scales + b`` for x [..., K], each row quantized to int8 by its absmax / 127,
    W given as `pack_w8a8(...)` with per-channel `weight_scales` [N] float32."""
    num_panels, steps, _, _ = panels.shape
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_w8a8", _ARGTYPES_W8A8, ctypes.c_int)
    return _run(kernel, x, steps * 4, num_panels * PANEL, (panels, bias_sums, weight_scales), bias)


_ARGTYPES_W4A8 = (*[ctypes.c_void_p] * 6, *[ctypes.c_int] * 5)


def w4a8_fits(n: int, k: int, group_size: int) -> bool:
    """Whether a symmetric int4 [N, K] weight with groups of `group_size` columns runs on the W4A8 kernel."""
    return w8a8_available() and n % PANEL == 0 and k % group_size == 0 and group_size % 8 == 0


def pack_w4a8(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 values [N, K] (int8 in −8..7) and their scales [N, K / G] → (nibble panels
    [N / 16, K / 8, 64] uint8, 128 · group sums [N / 16, K / G, 16] int32, scales [N / 16, K / G, 16]
    float32), the layout `panel_matmul_w4a8` reads. The caller checks `w4a8_fits` first."""
    n, k = qweight.shape
    groups = scale.shape[1]
    if qweight.dtype != torch.int8 or not w4a8_fits(n, k, k // groups) or qweight.min() < -8 or qweight.max() > 7:
        raise ValueError(f"the W4A8 kernel does not take a {qweight.dtype} {(n, k)} weight in {groups} groups")
    u = (qweight.to(torch.int16) + 8).to(torch.uint8).reshape(n // PANEL, PANEL, k // 8, 2, 4)
    nibbles = (u[..., 0, :] | (u[..., 1, :] << 4)).transpose(1, 2)  # [N / 16, K / 8, 16, 4]
    panels = host_memory.WEIGHTS.copy(nibbles.reshape(n // PANEL, k // 8, 64))
    sums = (qweight.to(torch.int32).reshape(n, groups, k // groups).sum(-1) * 128).to(torch.int32)
    return panels, _group_panels(sums), _group_panels(scale.float())


def unpack_w4a8(panels: torch.Tensor) -> torch.Tensor:
    """`pack_w4a8`'s nibble panels [N / 16, K / 8, 64] → the int4 values [N, K] (int8 in −8..7)."""
    num_panels, eighths, _ = panels.shape
    nibbles = panels.reshape(num_panels, eighths, PANEL, 4).transpose(1, 2)  # [N / 16, 16, K / 8, 4]
    u = torch.stack([nibbles & 0xF, nibbles >> 4], dim=3)  # [N / 16, 16, K / 8, 2, 4]: 8 columns each
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(num_panels * PANEL, 8 * eighths)


def _group_panels(t: torch.Tensor) -> torch.Tensor:
    """[N, G] per-group values → [N / 16, G, 16], a panel's 16 channels side by side per group."""
    n, groups = t.shape
    return t.reshape(n // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def matmul_w4a8(x: torch.Tensor, panels: torch.Tensor, group_sums: torch.Tensor, group_scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``q(x) Wᵀ + b`` for x [..., K], each row quantized to int8 by its absmax / 127, W the int4
    weight `pack_w4a8` laid out, times its group scales."""
    num_panels, blocks, _ = panels.shape
    k = blocks * 8
    kernel = cpu_kernels.kernel("panel_matmul", "panel_matmul_w4a8", _ARGTYPES_W4A8, ctypes.c_int)
    return _run(kernel, x, k, num_panels * PANEL, (panels, group_sums, group_scales), bias, k // group_sums.shape[1])

