"""Quantized Linear modules: every fast forward against its dequantize-then-matmul oracle.

Tolerances (relative Frobenius error of forward vs reference_forward):
- dense kernels in fp32 run the same math as the oracle: 1e-5;
- bf16 kernels round the activations and the accumulation to bf16: 2e-2;
- W8A8 int8 on the int8 panel kernel quantizes exactly as the oracle: 1e-5 per row.
"""

import contextlib
import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engine.layers import panel_matmul
from quant.checkpoint import quantize_weight
from quant.fp8 import fake_quantize_fp8, fp8_scale, quantize_fp8
from quant.linear import Fp8Linear, Int8Linear, WeightOnlyIntLinear, make_quantized_linear
from quant.schemes import QuantArgs, QuantScheme, fp8_block, preset
from tests.helpers import (
    MARCH_NEEDS,
    assert_rows_do_not_depend_on_the_batch,
    cpu_kernels_built_for,
    cpu_kernels_off,
    skip_unless_cpu_runs,
)
from tests.quant.hyp import quick

FAST_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def build(scheme, input_size, output_sizes, dtype=torch.float32, bias=True, seed=0, input_scale=None):
    """A finalized module plus the fp weights it was quantized from (shards concatenated)."""
    g = torch.Generator().manual_seed(seed)
    module = make_quantized_linear(scheme, input_size, output_sizes, bias=bias, dtype=dtype)
    weights = []
    for i, rows in enumerate(output_sizes):
        # drawn on the CPU (the generator's device) even under a `with torch.device("cuda")`
        w = (torch.randn(rows, input_size, generator=g, device="cpu") * 0.05 * (i + 1)).to(dtype)
        tensors = quantize_weight(w, scheme, input_scale=input_scale)
        if bias:
            tensors["bias"] = torch.randn(rows, generator=g, device="cpu").to(dtype)
        module.load_shard(i, tensors)
        weights.append(w)
    module.finalize()
    return module, torch.cat(weights)


def shapes():
    # in multiple of 64 so every int4 group size divides it; shard rows small and varied; 16, 21
    # and 40 rows take the 8-bit kernels' wide tiles several times, then their leftover tiles
    return st.tuples(st.sampled_from([64, 128]), st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=3),
                     st.one_of(st.integers(1, 9), st.sampled_from([16, 21, 40])))


@quick
@given(shape=shapes(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       name=st.sampled_from(["fp8-dynamic", "fp8-static", "fp8-block", "w4a16", "w8a16"]), seed=st.integers(0, 1000))
def test_fast_forward_matches_reference(shape, dtype, name, seed):
    k, sizes, m = shape
    scheme = preset(name, group_size=32)
    module, _ = build(scheme, k, sizes, dtype, seed=seed, input_scale=0.02 if name == "fp8-static" else None)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = module(x)
    assert y.dtype == dtype and y.shape == (m, sum(sizes))
    assert rel_err(y, module.reference_forward(x)) < FAST_TOL[dtype]
    module.prepack()  # the serving engine's CPU weight layout must not change the result
    assert rel_err(module(x), module.reference_forward(x)) < FAST_TOL[dtype]


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block", "w8a8-int8", "w4a16"])
def test_no_rows_give_no_rows(name):
    """A step may hand a Linear no rows (an empty chunk): every scheme answers [0, out], as
    F.linear does (block FP8's input groups failed to reshape)."""
    module, _ = build(preset(name, group_size=32), 64, [16, 32])
    for forward in (module, module.reference_forward):
        assert forward(torch.empty(0, 64)).shape == (0, 48)


def test_w4a8_off_its_kernel_runs_prepacked():
    """A W4A8 weight the W4A8 kernel does not take (its group wider than K here; every W4A8 weight
    on a CPU without AVX2) runs the oracle over the weight dequantized once, which the
    serving engine lays out in panels: the oracle must still multiply by it, to the same result."""
    module, _ = build(preset("w4a8"), 64, [16, 32])
    assert module.kernel == "reference"
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    before = module(x)
    module.prepack()
    assert module.weight_dense.dim() == (3 if panel_matmul.int8_available() else 2)
    assert rel_err(module(x), before) < 1e-6


needs_w8a8_panel = pytest.mark.skipif(not panel_matmul.w8a8_available(), reason="no AVX2 or no C compiler")


@needs_w8a8_panel
@quick
@given(k=st.sampled_from([4, 12, 64, 576]), sizes=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3),
       m=st.one_of(st.integers(1, 20), st.sampled_from([256, 263, 530])), seed=st.integers(0, 1000),
       loud=st.sampled_from([1.0, 100.0]))
def test_int8_panel_kernel_is_the_per_token_reference(k, sizes, m, seed, loud):
    # Rows 1-20 cover the 8-row tiles and every tail, 256+ the 256-row blocks of a prefill (a
    # tail tile at a block's end); K = 4 and 12 end inside the two-step loop.
    module, _ = build(preset("w8a8-int8"), k, sizes, seed=seed)
    assert module.kernel == "w8a8panel"
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0] *= loud
    y, ref = module(x), module.reference_forward(x)
    for row in range(m):  # the same integers, scaled: only the final fp32 rounding differs
        assert rel_err(y[row], ref[row]) < FAST_TOL[torch.float32]


needs_fp8_dot = pytest.mark.skipif(not panel_matmul.bf16_dot_available(), reason="no AVX-512 BF16 or no C compiler")
needs_amx = pytest.mark.skipif(not panel_matmul.use_amx(), reason="no AMX on this CPU (or DRIFTGATE_AMX=0)")


@needs_amx
@pytest.mark.parametrize(("scheme", "k"), [("w8a8", 64), ("w8a8", 100), ("w8a8", 576), ("w4a8-g64", 64),
                                           ("w4a8-g64", 576), ("w4a8-channel", 64), ("w4a8-channel", 576)])
@pytest.mark.parametrize(("m", "panels"), [(3, 1), (4, 2), (13, 3), (16, 1), (17, 2), (21, 8), (33, 3), (49, 2),
                                           (70, 4), (263, 5)])
def test_int8_amx_route_gives_the_vnni_floats(scheme, k, m, panels, seed=0):
    """AMX tiles and vpdpbusd sum the same int8 products exactly, and both end in the same float
    steps, so the outputs are equal. Rows: under 16 stay on VNNI; W8A8 takes the tiles from 16 rows,
    in passes of two 16-row blocks and then the rest in one pass (17: 9 + 8; 49: 32 + 17) (21 rows
    on 8 panels: each thread's next pair of panels after such a pass); an odd panel count leaves
    the last panel unpaired; K = 100 ends on vpdpbusd steps after the tiles. W4A8 (tiles only for
    groups of whole tiles, from 32 rows, its leftover rows on VNNI): groups of 64 columns or whole
    channels."""
    if scheme == "w8a8":
        quant = preset("w8a8-int8")
    else:
        weights = QuantArgs(num_bits=4, strategy="group", group_size=64) if scheme == "w4a8-g64" else QuantArgs(
            num_bits=4, strategy="channel")
        quant = QuantScheme(weights, QuantArgs(strategy="token", dynamic=True), "int-quantized")
    module, _ = build(quant, k, [panel_matmul.PANEL * panels], seed=seed)
    assert module.kernel == ("w8a8panel" if scheme == "w8a8" else "w4a8panel")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    on_tiles = module(x)
    try:
        assert not panel_matmul.use_amx(False)
        on_vnni = module(x)
    finally:
        assert panel_matmul.use_amx(True)
    assert torch.equal(on_tiles, on_vnni)


def _dot_product(kernel: str, w: torch.Tensor, bias: torch.Tensor | None = None):
    """x → x Wᵀ + b on the FP8 product kernel (W rounded to e4m3 per channel, rows to fp8 per token)
    or the bf16 one (W rounded to bf16, rows to bf16), with the weight's values and scales as a
    float64 [N, K] for the exact reference."""
    if kernel == "fp8dot":
        scale = fp8_scale(w, "channel")
        weight = quantize_fp8(w, scale)
        packed, scales = panel_matmul.pack_fp8_pairs(weight, scale)
        return (lambda v: panel_matmul.matmul_fp8_dot(v, packed, scales, panel_matmul.ACT_FP8_TOKEN, bias=bias),
                weight.double() * scale.double())
    weight = w.bfloat16().float()
    packed = panel_matmul.pack_bf16_pairs(weight)
    return lambda v: panel_matmul.matmul(v, packed, bias), weight.double()


def _on_both_routes(matmul, x):
    """matmul(x) on the AMX tiles, then on the vector route."""
    on_tiles = matmul(x)
    try:
        assert not panel_matmul.use_amx(False)
        return on_tiles, matmul(x)
    finally:
        assert panel_matmul.use_amx(True)


@needs_amx
@pytest.mark.parametrize("kernel", ["fp8dot", "bf16dot"])
@pytest.mark.parametrize("k", [7, 64, 100, 576])
@pytest.mark.parametrize(("m", "panels"), [(3, 1), (4, 2), (13, 3), (16, 1), (17, 2), (21, 8), (33, 3), (49, 2),
                                           (70, 4), (263, 5)])
def test_bf16_amx_route_sums_the_same_products(kernel, k, m, panels, seed=0):
    """AMX-BF16 tiles and vdpbf16ps make the same exact products (bf16 values; FP8 rows and weights
    are bf16 values too) but sum them in another order, so each route must be within recursive
    summation's bound of the exact sum, (K + 4) float32 roundings of the products' absolute sum
    (K the terms, 4 the scales and the bias). A lost tile or tail step would miss by a whole product.
    Rows: every count takes the tiles, in passes of two 16-row blocks and then the rest in one pass
    of one block (up to 16) or two (17: 9 + 8); FP8 from 33 rows on panels widened once, below that
    a tile at a time. 21 rows on 8 panels: a thread's next pair of panels after a pass of another
    depth; an odd panel count leaves the last unpaired. K = 7 and 100 end on vector steps after 0
    and 3 tiles (32 k each)."""
    g = torch.Generator().manual_seed(seed)
    n = panel_matmul.PANEL * panels
    w = torch.randn(n, k, generator=g) * 0.05
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    x[0] *= 100.0
    matmul, cols = _dot_product(kernel, w, bias)
    routes = _on_both_routes(matmul, x)
    rows = (fake_quantize_fp8(x, fp8_scale(x, "token")) if kernel == "fp8dot" else x.bfloat16()).double()
    exact = rows @ cols.t() + bias.double()
    bound = (k + 4) * 2.0**-24 * (rows.abs() @ cols.abs().t() + bias.double().abs())
    for y in routes:
        assert ((y.double() - exact).abs() <= bound).all()
    if k >= 32:
        assert not torch.equal(*routes)  # the tiles did run: their sums come in another order


@needs_fp8_dot
@pytest.mark.parametrize("kernel", ["fp8dot", "bf16dot"])
@pytest.mark.parametrize("amx", [pytest.param(True, marks=needs_amx), False])
def test_a_rows_bf16_products_do_not_depend_on_the_other_rows(kernel, amx):
    """Each row's floats are the same alone and in batches of any size, on either route (the
    engine's greedy outputs must not depend on the batch): row counts across the streamed and
    widened FP8 panels, the tiles' blocks and the rows after them."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 100, generator=g) * 0.05, torch.randn(70, 100, generator=g)
    matmul, _ = _dot_product(kernel, w)
    before = panel_matmul.use_amx()
    try:
        panel_matmul.use_amx(amx)
        assert_rows_do_not_depend_on_the_batch(matmul, x, (1, 2, 3, 5, 16, 17, 20, 32, 33, 47))
    finally:
        panel_matmul.use_amx(before)


@needs_w8a8_panel
@quick
@given(k=st.sampled_from([32, 64, 576]), group=st.sampled_from([8, 32, None]),
       sizes=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3),
       m=st.one_of(st.integers(1, 20), st.sampled_from([256, 263])), seed=st.integers(0, 1000),
       loud=st.sampled_from([1.0, 100.0]))
def test_w4a8_panel_kernel_is_the_per_token_reference(k, group, sizes, m, seed, loud):
    """W4A8: int4 weights per group (or channel: group None) times per-token int8 rows; each
    group's integer dot is exact, so only the fp32 scaling and summing of groups differ."""
    weights = QuantArgs(num_bits=4, strategy="group", group_size=group) if group else QuantArgs(
        num_bits=4, strategy="channel")
    scheme = QuantScheme(weights, QuantArgs(strategy="token", dynamic=True), "int-quantized")
    module, w = build(scheme, k, sizes, seed=seed)
    assert module.kernel == "w4a8panel"
    assert module.stored("qweight").min() >= -8 and module.stored("qweight").max() <= 7
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0] *= loud
    y, ref = module(x), module.reference_forward(x)
    for row in range(m):
        assert rel_err(y[row], ref[row]) < FAST_TOL[torch.float32]
    assert rel_err(ref, F.linear(x, w) + module.bias) < 0.2  # and the reference is the model's, quantized
    with cpu_kernels_off():
        fallback, _ = build(scheme, k, sizes, seed=seed)
    assert fallback.kernel == "reference" and torch.equal(fallback(x), ref)


@needs_w8a8_panel
@pytest.mark.parametrize("march", sorted(MARCH_NEEDS))
def test_cpu_kernels_give_the_same_floats_built_for_older_cpus(march):
    """Kernels built for an AVX2 CPU, or Skylake's AVX-512 without VNNI, give this one's floats
    bit for bit, so a gate's verdict holds on either: each lane of the float panels (fp32, bf16
    values, int8 and int4 weights with or without zero points) sums the same products in the same
    order on 16 lanes or two parts of 8; W8A8 and W4A8 sum vpdpbusd's integers with pmaddubsw
    and share one epilogue. Rows: every tile and tail of every tile size and a 256-row block's
    tail; K = 100 ends on single steps."""
    skip_unless_cpu_runs(march)
    w4a8 = QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=32),
                       QuantArgs(strategy="token", dynamic=True), "int-quantized")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 100, generator=g) * 0.05).bfloat16().float()
    cases = [(name, 100, functools.partial(lambda x, packed: panel_matmul.matmul(x, packed), packed=packed))
             for name, packed in (("fp32", panel_matmul.pack(w, narrow=False)), ("bf16", panel_matmul.pack(w)))]
    for scheme, k in ((preset("w8a16"), 100), (preset("w4a16", group_size=32), 128),
                      (preset("w4a16-asym", group_size=32), 128), (preset("w8a8-int8"), 100),
                      (preset("w8a8-int8"), 576), (w4a8, 576)):
        module, _ = build(scheme, k, [16, 48], seed=1)
        assert module.kernel in ("int8panel", "int4panel", "w8a8panel", "w4a8panel")
        cases.append((module.kernel, k, module))
    for name, k, matmul in cases:
        x = torch.randn(263, k, generator=g)
        x[0] *= 100
        for rows in (1, 2, 3, 5, 7, 13, 263):
            here = matmul(x[:rows])
            with cpu_kernels_built_for(march):
                built_for_march = matmul(x[:rows])
            assert torch.equal(built_for_march, here), (name, k, rows)


@needs_w8a8_panel
@pytest.mark.parametrize("march", [None, *sorted(MARCH_NEEDS)])
@pytest.mark.parametrize("group", [8, 24, 128, 768])
def test_w4a8_sums_stay_exact_at_the_extremes(march, group):
    """W4A8's integer dots at their largest: every weight 7 (or −8) times rows that quantize to
    ±127 everywhere. Without VNNI the kernel sums nibble × activation pairs in int16 for several
    blocks before widening them; those sums must not wrap, and the −8 · Σ x_q taken off for the
    nibbles' offset must come out exact, in groups of one block, of part of an int16 run, of
    several runs and of the whole row. The result is compared with the exact integers, scaled in float64."""
    if march:
        skip_unless_cpu_runs(march)
    n, k = 32, 768
    scale = torch.full((n, k // group), 0.5)
    x = torch.cat([torch.ones(2, k), -torch.ones(2, k), torch.linspace(-1, 1, k)[None]])
    for value in (7, -8):
        q = torch.full((n, k), value, dtype=torch.int8)
        q[1::2, ::3] = -8 if value == 7 else 7  # every other channel mixes both extremes
        x_scale = x.abs().amax(1, keepdim=True) / 127
        x_q = torch.round(x / x_scale).clamp(-127, 127).double()
        dots = (x_q.reshape(len(x), 1, -1, group) * q.double().reshape(1, n, -1, group)).sum(-1)
        exact = (dots * scale.double()).sum(-1) * x_scale.double()
        with cpu_kernels_built_for(march) if march else contextlib.nullcontext():
            y = panel_matmul.matmul_w4a8(x, *panel_matmul.pack_w4a8(q, scale))
        assert torch.allclose(y.double(), exact, rtol=1e-6, atol=0), (value, (y.double() - exact).abs().max())


needs_int8_panel = pytest.mark.skipif(not panel_matmul.int8_available(), reason="no C compiler here")


@needs_int8_panel
def test_kernel_choice_follows_dtype():
    assert build(preset("w4a16", group_size=32), 64, [16], torch.bfloat16)[0].kernel == "int4pack_cpu"
    assert build(preset("w4a16", group_size=32), 64, [16], torch.float32)[0].kernel == "int4panel"
    assert build(preset("w8a16"), 64, [16], torch.float32)[0].kernel == "int8panel"
    assert build(preset("w8a16"), 64, [8], torch.float32)[0].kernel == "dense"  # out not whole panels
    assert build(preset("w8a16"), 64, [16], torch.bfloat16)[0].kernel == "int8pack"
    assert build(preset("w4a16", group_size=48), 96, [16], torch.bfloat16)[0].kernel == "dense"  # 48 not a kernel group
    assert build(preset("w4a16", group_size=32), 64, [8], torch.bfloat16)[0].kernel == "dense"  # out not a multiple of 16
    fp8_w8a8 = "fp8dot" if panel_matmul.bf16_dot_available() else "fp8panel"
    assert build(preset("fp8-dynamic"), 64, [16], torch.float32)[0].kernel == fp8_w8a8
    assert build(QuantScheme(preset("fp8-dynamic").weights, None), 64, [16], torch.float32)[0].kernel == "fp8panel"
    assert build(preset("fp8-dynamic"), 64, [16], torch.bfloat16)[0].kernel == "dense"
    assert build(preset("fp8-dynamic"), 64, [8], torch.float32)[0].kernel == "dense"


@needs_int8_panel
@pytest.mark.parametrize("group", [4, 32, 64])
def test_int4_nibble_panels_compute_exactly_what_int8_panels_do(group):
    """Two weights a byte, the same arithmetic: equal to the int8 kernel bit for bit, at every
    row count (wide tiles, narrow tiles, leftovers), and to dequantize-then-matmul."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(group)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) + 0.05
    nibbles, int8 = panel_matmul.pack_int4(q, scale), panel_matmul.pack_int8(q, scale)
    assert nibbles[0].numel() * 2 == int8[0].numel()
    dense = (q.float().reshape(n, -1, group) * scale[:, :, None]).reshape(n, k)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 17):
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        y = panel_matmul.matmul_int4(x, *nibbles, bias)
        assert torch.equal(y, panel_matmul.matmul_int8(x, *int8, bias))
        assert rel_err(y, x @ dense.t() + bias) < 1e-5
    with pytest.raises(ValueError, match="int4"):
        panel_matmul.pack_int4(q * 2, scale)  # values beyond [-8, 7]
    assert not panel_matmul.int4_fits(n, k, k // 2)  # groups of 2 columns: the kernel reads 4 at a time


@needs_int8_panel
@pytest.mark.parametrize("group", [4, 32, 128])
def test_asymmetric_int4_nibbles_compute_exactly_what_folded_int8_panels_do(group):
    """Zero points subtracted from the widened nibbles give the floats int8 panels holding q − zero
    point give (which no longer fit 4 bits), bit for bit, and dequantize-then-matmul's result."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(group)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    zero = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) + 0.05
    folded = (q.float().reshape(n, -1, group) - zero[:, :, None]).reshape(n, k)
    nibbles, int8 = panel_matmul.pack_int4(q, scale, zero), panel_matmul.pack_int8(folded.to(torch.int8), scale)
    dense = (folded.reshape(n, -1, group) * scale[:, :, None]).reshape(n, k)
    for m in (1, 3, 8, 9, 17):
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        y = panel_matmul.matmul_int4(x, *nibbles, bias)
        assert torch.equal(y, panel_matmul.matmul_int8(x, *int8, bias))
        assert rel_err(y, x @ dense.t() + bias) < 1e-5
    with pytest.raises(ValueError, match="int4"):
        panel_matmul.pack_int4(q, scale, zero[:1])  # zero points for one row only


@needs_int8_panel
@pytest.mark.parametrize("weights", ["int8", "int4", "int4-zero", "fp8"])
def test_a_rows_weight_only_products_do_not_depend_on_the_other_rows(weights):
    """W8A16, W4A16 (with and without zero points) and weight-only FP8: each row's floats are the
    same alone and in batches of any size (the engine's greedy outputs must not depend on the
    batch): every row count across the 8-row tiles and the 1-7 rows after them."""
    n, k, group = 48, 128, 32
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(n, k // group, generator=g) + 0.05
    if weights == "fp8":
        weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
        matmul, packed = panel_matmul.matmul_fp8, panel_matmul.pack_fp8(weight, scale)
    elif weights == "int8":
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        matmul, packed = panel_matmul.matmul_int8, panel_matmul.pack_int8(weight, scale)
    else:
        zero = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g) if weights == "int4-zero" else None
        weight = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
        matmul, packed = panel_matmul.matmul_int4, panel_matmul.pack_int4(weight, scale, zero)
    assert_rows_do_not_depend_on_the_batch(matmul, torch.randn(41, k, generator=g), range(1, 41), *packed)


@needs_w8a8_panel
@pytest.mark.parametrize("weights", ["w8a8", "w4a8"])
def test_a_rows_int8_activation_products_do_not_depend_on_the_other_rows(weights):
    """W8A8 and W4A8 on VNNI (and on AMX tiles from 16 / 32 rows where the CPU has them): each
    row's floats are the same alone and in batches of 1-40 rows."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(0)
    if weights == "w8a8":
        panels, sums = panel_matmul.pack_w8a8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        matmul, packed = panel_matmul.matmul_w8a8, (panels, sums, torch.rand(n, generator=g) + 0.05)
    else:
        q, scale = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g), torch.rand(n, 2, generator=g) + 0.05
        matmul, packed = panel_matmul.matmul_w4a8, panel_matmul.pack_w4a8(q, scale)
    assert_rows_do_not_depend_on_the_batch(matmul, torch.randn(40, k, generator=g), range(1, 40), *packed)


@pytest.mark.parametrize("kernel", [pytest.param("fp8dot", marks=needs_fp8_dot),
                                    pytest.param("fp8panel", marks=needs_int8_panel)])
@quick
@given(k=st.sampled_from([1, 7, 33, 64, 576]), sizes=st.lists(st.sampled_from([16, 32]), min_size=1, max_size=3),
       m=st.one_of(st.integers(1, 20), st.sampled_from([40, 257])), act=st.sampled_from(["token", "tensor", "static"]),
       seed=st.integers(0, 1000))
def test_fp8_w8a8_kernels_match_reference(kernel, k, sizes, m, act, seed):
    """Both CPU kernels of FP8 W8A8 (fp8 values multiplied as bf16; or widened to fp32 after torch
    rounds the rows). Rows 1-20 cross the fp32 kernel's tiles and tails and the bf16 kernel's one
    streaming tile; 40 and 257 take the bf16 kernel's widened panel over several tiles; K = 1, 7
    and 33 end inside a chain, a 16-lane row chunk or a bf16 pair."""
    scheme = preset("fp8-static" if act == "static" else "fp8-dynamic")
    if act == "tensor":
        scheme = QuantScheme(scheme.weights, replace(scheme.input_activations, strategy="tensor"), scheme.format)
    with pytest.MonkeyPatch.context() as patch:
        if kernel == "fp8panel":
            patch.setattr(panel_matmul, "fp8_dot_fits", lambda n: False)
        module, _ = build(scheme, k, sizes, seed=seed, input_scale=0.02 if act == "static" else None)
    assert module.kernel == kernel
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0] *= 100.0  # one loud token
    assert rel_err(module(x), module.reference_forward(x)) < FAST_TOL[torch.float32]


FP8_KERNELS = [pytest.param("fp8dot", marks=needs_fp8_dot), pytest.param("fp8panel", marks=needs_int8_panel)]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare any dtype (torch.equal has no fp8 kernel)."""
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name,kernel,stored", [
    ("w4a16", "int4panel", ["qweight", "weight_scale"]), ("w8a16", "int8panel", ["qweight", "weight_scale"]),
    ("w4a16-asym", "int4panel", ["qweight", "weight_scale", "weight_zero_point"]),
    ("nvfp4a16", "int8panel", ["qweight", "weight_scale"]),
    pytest.param("w8a8-int8", "w8a8panel", ["qweight"], marks=needs_w8a8_panel),
    pytest.param("w4a8", "w4a8panel", ["qweight", "weight_scale"], marks=needs_w8a8_panel),
    pytest.param("fp8-dynamic", "fp8dot", ["weight"], marks=needs_fp8_dot),
    pytest.param("fp8-weight-only", "fp8panel", ["weight"], marks=needs_int8_panel),
    pytest.param("fp8-block", "fp8dot-groups", ["weight", "weight_scale"], marks=needs_fp8_dot),
    pytest.param("fp8-block-fp32", "fp8panel", ["weight", "weight_scale"], marks=needs_int8_panel)])
def test_a_cpu_kernel_holds_the_only_copy_of_the_weight(name, kernel, stored):
    """On a CPU panel kernel the quantized weight and its group scales (and zero points) live once,
    in the kernel's layout (beside it an int4 weight took three times its packed bytes): the
    loaded copies are gone, and the oracle reads the very values the kernel multiplies back from
    its panels. Per-channel scales, a few bytes a row, stay as loaded."""
    scheme = (QuantScheme(QuantArgs(type="float", num_bits=8, strategy="channel"), None, "naive-quantized")
              if name == "fp8-weight-only" else preset(name.removesuffix("-fp32"), group_size=32))
    with pytest.MonkeyPatch.context() as patch:
        if name == "fp8-block-fp32":  # its other kernel, the weights widened to fp32
            patch.setattr(panel_matmul, "fp8_dot_groups_fits", lambda *_: False)
        module, _ = build(scheme, 192, [32, 16])
    assert module.kernel == kernel and not set(stored) & set(dict(module.named_buffers()))
    with cpu_kernels_off():
        loaded, _ = build(scheme, 192, [32, 16])
    for tensor in stored:
        kept = getattr(loaded, tensor)  # the copy as loaded, where no panel kernel took it
        assert torch.equal(_bytes_of(module.stored(tensor)), _bytes_of(kept)), tensor
    assert torch.equal(module.dequantized_weight(), loaded.dequantized_weight())


@pytest.mark.parametrize("kernel", [pytest.param("fp8dot-groups", marks=needs_fp8_dot),
                                    pytest.param("fp8panel", marks=needs_int8_panel)])
@quick
@given(shape=st.sampled_from([((128, 128), 192, [48, 16, 16]),  # partial row tiles; K: 1.5 tiles, groups of 64
                              ((128, 128), 256, [144]),  # whole column tiles, a partial row tile
                              ((16, 24), 64, [32, 16, 16])]),  # groups of 8, inputs in groups 24, 24 and 16
       m=st.one_of(st.integers(1, 20), st.sampled_from([40, 257])), seed=st.integers(0, 1000))
def test_block_fp8_runs_its_tiles_on_a_kernel(kernel, shape, m, seed):
    """Block FP8 streams its fp8 bytes on a CPU kernel (not a dense weight dequantized at load),
    each tile's scale on its rows and columns and the inputs rounded per token and tile width in
    C: the exact bf16 products summed per group, or the grouped fp8 kernel. Every row equals the
    dequantize-then-matmul oracle (rows 1-20: the product kernel's streaming tiles and tails; 40
    and 257: panels widened once for several tiles)."""
    block, k, sizes = shape
    with pytest.MonkeyPatch.context() as patch:
        if kernel == "fp8panel":
            patch.setattr(panel_matmul, "fp8_dot_groups_fits", lambda *_: False)
        module, _ = build(fp8_block(block), k, sizes, seed=seed)
    assert module.kernel == kernel
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, : k // 3] *= 100.0  # one loud group: the other groups of its row keep their own scales
    y, ref = module(x), module.reference_forward(x)
    for row in range(m):
        assert rel_err(y[row], ref[row]) < FAST_TOL[torch.float32]
    with cpu_kernels_off():
        dense, _ = build(fp8_block(block), k, sizes, seed=seed)
    assert dense.kernel == "dense" and torch.equal(dense.dequantized_weight(), module.dequantized_weight())


@needs_int8_panel
@pytest.mark.parametrize("k,width", [(64, 24), (192, 128), (176, 128), (256, 128)])
def test_fp8_kernel_rounds_rows_per_group_as_block_fp8(k, width):
    """ACT_FP8_TOKEN with a group width: each group of a row (the last one shorter) rounded through
    fp8 with its own scale, exactly as block FP8's torch rounding does."""
    panels, scales = panel_matmul.pack_fp8(torch.eye(k).to(torch.float8_e4m3fn), torch.ones(k, 1))
    module = make_quantized_linear(fp8_block((128, width)), k, [16], bias=False, dtype=torch.float32)
    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-8, 2, k)).clamp(-400, 400)
    y = panel_matmul.matmul_fp8(x, panels, scales, panel_matmul.ACT_FP8_TOKEN, 0.0, width)
    assert torch.equal(y, module._quantize_input(x))
    assert not torch.equal(y, panel_matmul.matmul_fp8(x, panels, scales, panel_matmul.ACT_FP8_TOKEN))  # per row


@needs_fp8_dot
@pytest.mark.parametrize("group,act_group", [(64, 128), (128, 128), (8, 24)])
def test_fp8_grouped_products_do_not_depend_on_the_batch(group, act_group):
    """A row's floats from the grouped fp8 product kernel are the same whatever rows share its call
    (streamed up to 16 rows, a widened panel above): a request's tokens do not depend on its batch."""
    n, k = 48, 384
    g = torch.Generator().manual_seed(group)
    weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    packed = panel_matmul.pack_fp8_pair_groups(weight, torch.rand(n, k // group, generator=g) + 0.05)
    assert_rows_do_not_depend_on_the_batch(panel_matmul.matmul_fp8_dot_groups, torch.randn(40, k, generator=g),
                                           range(1, 40), *packed, act_group)
    for bad in (0, act_group + 1, group // 2 or 1):  # no groups, odd ones, or finer than the scales'
        with pytest.raises(ValueError, match="do not fit scale groups"):
            panel_matmul.matmul_fp8_dot_groups(torch.randn(2, k), *packed, bad)


def _fp8_matmul(kernel: str, weight: torch.Tensor):
    """x, act, static scale → x Wᵀ on one of the two CPU FP8 kernels, W an fp8 [N, K] with unit scales."""
    ones = torch.ones(weight.shape[0], 1)
    if kernel == "fp8dot":
        panels, scales = panel_matmul.pack_fp8_pairs(weight, ones)
        return lambda x, act, static=0.0: panel_matmul.matmul_fp8_dot(x, panels, scales, act, static)
    panels, scales = panel_matmul.pack_fp8(weight, ones)
    return lambda x, act, static=0.0: panel_matmul.matmul_fp8(x, panels, scales, act, static)


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("rows", [3, 40])
def test_fp8_kernels_round_rows_as_quant_fp8(kernel, rows):
    """Rows through an identity weight come back exactly as quant.fp8.fake_quantize_fp8 rounds
    them: values across e4m3's normal and subnormal range, ties included, per token, per tensor
    and by a fixed scale. (fp8dot: 3 rows stream the weight bytes, 40 widen a panel for three tiles.)"""
    k = 64
    matmul = _fp8_matmul(kernel, torch.eye(k).to(torch.float8_e4m3fn))
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-12, 2, k)).clamp(-400, 400)
    # the loudest (so every scale is 1), an exact value, a tie between subnormals, a tie between normals
    x[:, :4] = torch.tensor([448.0, -1.0, 3.0 * 2.0**-10, 17.0 / 16])
    for act, strategy in ((panel_matmul.ACT_FP8_TOKEN, "token"), (panel_matmul.ACT_FP8_TENSOR, "tensor")):
        assert torch.equal(matmul(x, act), fake_quantize_fp8(x, fp8_scale(x, strategy)))
    assert torch.equal(matmul(x, panel_matmul.ACT_FP8_STATIC, 0.5), fake_quantize_fp8(x, torch.tensor([0.5])))


@pytest.mark.parametrize("kernel", FP8_KERNELS)
@pytest.mark.parametrize("rows", [3, 40])
def test_fp8_kernels_widen_every_fp8_value_exactly(kernel, rows):
    """Every finite fp8 weight byte comes back exactly through identity rows (a fixed scale of 1
    keeps the rows exact)."""
    values = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)  # 0x7F/0xFF: NaN
    weight = values.view(torch.float8_e4m3fn).reshape(1, -1).expand(16, -1).contiguous()
    matmul = _fp8_matmul(kernel, weight)
    for ones in torch.eye(weight.shape[1]).split(rows):  # row i of the product is column i of the weight
        assert torch.equal(matmul(ones, panel_matmul.ACT_FP8_STATIC, 1.0), ones @ weight.float().t())
        assert kernel == "fp8dot" or torch.equal(matmul(ones, panel_matmul.ACT_NONE), ones @ weight.float().t())


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-static", "w8a8-int8", "w4a16", "w4a8", "w8a16"])
def test_reference_is_close_to_unquantized(name):
    module, w = build(preset(name, group_size=32), 128, [32, 16], input_scale=0.05 if name == "fp8-static" else None)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    exact = F.linear(x, w, module.bias)
    budget = {"w4a16": 0.06, "w4a8": 0.07}.get(name, 0.03)  # int4 weights; w4a8 rounds its inputs too
    assert rel_err(module.reference_forward(x), exact) < budget


def test_per_tensor_shard_scales_merge_exactly():
    module, _ = build(preset("fp8-static"), 64, [16, 8, 8], input_scale=0.01)
    assert isinstance(module, Fp8Linear)
    assert module.weight_scale.shape == (32, 1)
    # shard 2's weights are 3x larger, so its rows carry its own (larger) scale
    assert module.weight_scale[24, 0] > module.weight_scale[0, 0]
    assert torch.equal(module.weight_scale[:16], module.weight_scale[:1].expand(16, 1))


def test_static_input_scale_takes_max_over_shards():
    scheme = preset("fp8-static")
    module = make_quantized_linear(scheme, 32, [8, 8], bias=False, dtype=torch.float32)
    for i, s in enumerate([0.5, 2.0]):
        module.load_shard(i, quantize_weight(torch.randn(8, 32), scheme, input_scale=s))
    module.finalize()
    assert module.input_scale.item() == 2.0


def test_asymmetric_and_g_idx_int4():
    k, g = 64, 32
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(3))
    asym = QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=g, symmetric=False), None, "pack-quantized")
    for dtype in (torch.float32, torch.bfloat16):
        module = make_quantized_linear(asym, k, [32], bias=False, dtype=dtype)
        module.load_shard(0, quantize_weight(w.to(dtype), asym))
        module.finalize()
        fp32_kernel = "int4panel" if panel_matmul.int8_available() else "dense"
        assert module.kernel == ("int4pack_cpu" if dtype == torch.bfloat16 else fp32_kernel)
        x = torch.randn(3, k).to(dtype)
        assert rel_err(module(x), module.reference_forward(x)) < FAST_TOL[dtype]
        assert rel_err(module.dequantized_weight(), w) < 0.1
    # actorder group: columns belong to groups through g_idx
    ordered = QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=g, actorder="group"), None,
                          "pack-quantized")
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // g
    q = torch.randint(-8, 8, (32, k), dtype=torch.int8)
    scale = torch.rand(32, k // g) + 0.1
    module = make_quantized_linear(ordered, k, [32], bias=False, dtype=torch.float32)
    module.load_shard(0, quantize_weight(w, ordered, q=q, scale=scale, g_idx=g_idx))
    module.finalize()
    assert isinstance(module, WeightOnlyIntLinear) and module.kernel == "dense"
    torch.testing.assert_close(module.dequantized_weight(), q.float() * scale[:, g_idx])


def test_naive_int8_weight_layout_loads():
    scheme = QuantScheme(QuantArgs(strategy="channel"), QuantArgs(strategy="token", dynamic=True), "naive-quantized")
    module, w = build(scheme, 64, [16])
    assert isinstance(module, Int8Linear)
    assert rel_err(module.dequantized_weight(), w) < 0.01


def test_load_errors_name_the_tensor():
    scheme = preset("w4a16", group_size=32)
    good = quantize_weight(torch.randn(16, 64), scheme)

    def fresh():
        return make_quantized_linear(scheme, 64, [16], bias=False, dtype=torch.float32)

    with pytest.raises(ValueError, match=r"'weight_packed': shape \(16, 4\)"):
        fresh().load_shard(0, {**good, "weight_packed": good["weight_packed"][:, :4]})
    with pytest.raises(ValueError, match=r"'weight_shape'"):
        fresh().load_shard(0, {**good, "weight_shape": torch.tensor([16, 72])})
    with pytest.raises(ValueError, match=r"'weight_scale'"):
        fresh().load_shard(0, {**good, "weight_scale": good["weight_scale"][:, :1]})
    with pytest.raises(ValueError, match=r"missing tensors \['weight_scale'\]"):
        fresh().load_shard(0, {k: v for k, v in good.items() if k != "weight_scale"})
    with pytest.raises(ValueError, match=r"unexpected tensors \['weight_zero_point'\]"):
        fresh().load_shard(0, {**good, "weight_zero_point": torch.zeros(2, 2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="bias"):
        fresh().load_shard(0, {**good, "bias": torch.zeros(16)})
    module = fresh()
    with pytest.raises(ValueError, match=r"shards \[0\] were never loaded"):
        module.finalize()
    fp8 = preset("fp8-static")
    with pytest.raises(ValueError, match="'input_scale'"):
        make_quantized_linear(fp8, 64, [16], bias=False, dtype=torch.float32).load_shard(
            0, {**quantize_weight(torch.randn(16, 64), fp8, input_scale=1.0), "input_scale": torch.tensor([0.0])})
    with pytest.raises(ValueError, match="'weight': dtype"):
        make_quantized_linear(fp8, 64, [16], bias=False, dtype=torch.float32).load_shard(
            0, {**quantize_weight(torch.randn(16, 64), fp8, input_scale=1.0), "weight": torch.randn(16, 64)})


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="W8A8 int8 needs per-channel or per-tensor weight scales, not groups"):
        QuantScheme(QuantArgs(strategy="group", group_size=32), QuantArgs(strategy="token", dynamic=True),
                    "int-quantized")
    with pytest.raises(ValueError, match="symmetric int8 or int4 weights"):
        QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
                    QuantArgs(strategy="token", dynamic=True), "int-quantized")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-static", "w4a16", "w8a8-int8"])
def test_cuda_kernels_match_reference(name):
    with torch.device("cuda"):
        module, _ = build(preset(name, group_size=64), 256, [128, 64], torch.bfloat16,
                          input_scale=0.02 if name == "fp8-static" else None)
    expected = {"fp8-dynamic": "scaled_mm", "fp8-static": "scaled_mm", "w4a16": "int4pack_cuda", "w8a8-int8": "int_mm"}
    assert module.kernel == expected[name]
    for m in (1, 8, 33):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        assert rel_err(module(x), module.reference_forward(x)) < 3e-2


def test_meta_construction_then_to_empty_loads_on_target_device():
    # The engine builds the model on the meta device, then materializes it with to_empty().
    scheme = preset("w8a16")
    with torch.device("meta"):
        module = make_quantized_linear(scheme, 64, [16], bias=True, dtype=torch.float32)
    module.to_empty(device="cpu")
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))  # unseeded, int8 error crossed 1% now and then
    module.load_shard(0, {**quantize_weight(w, scheme), "bias": torch.ones(16)})
    module.finalize()
    assert module.kernel_weight.device.type == "cpu"
    x = torch.ones(2, 64)
    assert rel_err(module(x), module.reference_forward(x)) < FAST_TOL[torch.float32]
    assert rel_err(module(x), F.linear(x, w, torch.ones(16))) < 0.01


def test_missing_bias_is_an_error():
    scheme = preset("w8a16")
    module = make_quantized_linear(scheme, 64, [16, 16], bias=True, dtype=torch.float32)
    module.load_shard(0, {**quantize_weight(torch.randn(16, 64), scheme), "bias": torch.ones(16)})
    module.load_shard(1, quantize_weight(torch.randn(16, 64), scheme))
    with pytest.raises(ValueError, match=r"shards \[1\]: 'bias' missing"):
        module.finalize()
