"""Integer quantization primitives against compressed-tensors' own math and packing."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from quant.int_quant import (
    compute_qparams,
    dequantize_int,
    fake_quantize_int,
    int_range,
    pack_int32,
    quantize_int,
    unpack_int32,
)
from tests.quant.hyp import quick


@quick
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 9), cols=st.integers(1, 40), dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_pack_matches_compressed_tensors_and_round_trips(bits, rows, cols, dim, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = int_range(bits)
    q = torch.randint(lo, hi + 1, (rows, cols), generator=g).to(torch.int8)
    packed = pack_int32(q, bits, dim=dim)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, pack_to_int32(q, bits, packed_dim=dim))
    assert torch.equal(unpack_int32(packed, bits, (rows, cols), dim=dim), q)
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size((rows, cols)), packed_dim=dim), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_reads_words_as_a_file_lays_them_out(bits, tmp_path):
    """One row of words packed along dim 0 (a zero point of 8 or fewer rows) comes back from a
    file as [1, G] with strides (G, 1), not pack_int32's (1, 1)."""
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (32 // bits, 7), dtype=torch.int8)
    save_file({"zp": pack_int32(q, bits, dim=0)}, tmp_path / "zp.safetensors")
    packed = load_file(tmp_path / "zp.safetensors")["zp"]
    assert torch.equal(unpack_int32(packed, bits, tuple(q.shape), dim=0), q)
    with pytest.raises(ValueError, match="int32 words"):
        unpack_int32(packed.long(), bits, tuple(q.shape), dim=0)


def test_int4_layout_is_value_plus_8_lsb_first():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)
    word = pack_int32(q, 4).item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * c)) & 0xF for c in range(8)]
    assert nibbles == [0, 1, 8, 9, 10, 11, 12, 15]


@pytest.mark.parametrize("bits,divisor", [(4, 7.5), (8, 127.5)])
def test_symmetric_scale_is_absmax_over_half_range(bits, divisor):
    w = torch.tensor([[0.3, -1.5, 0.2, 0.75]])
    scale, zp = compute_qparams(w, bits, group_size=None, symmetric=True)
    assert zp is None
    torch.testing.assert_close(scale, torch.tensor([[1.5 / divisor]]))
    q = quantize_int(w, scale, None, bits, group_size=None)
    assert q[0, 1].item() == int_range(bits)[0]  # the negative extreme maps to -8 / -128


@quick
@given(bits=st.sampled_from([4, 8]), sym=st.booleans(), group=st.sampled_from([None, 4, 16]),
       rows=st.integers(1, 6), cols=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_round_trip_error_is_at_most_half_a_step(bits, sym, group, rows, cols, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    scale, zp = compute_qparams(w, bits, group_size=group, symmetric=sym)
    q = quantize_int(w, scale, zp, bits, group_size=group)
    lo, hi = int_range(bits)
    assert q.min() >= lo and q.max() <= hi
    w_hat = dequantize_int(q, scale, zp, group_size=group)
    step = scale[:, torch.arange(cols) // group if group else torch.zeros(cols, dtype=torch.long)]
    # Symmetric clips the positive extreme by half a step more (absmax/7.5 → +7).
    slack = 0.5 if not sym else 1.0
    assert ((w - w_hat).abs() <= step * slack + 1e-6).all()


def test_g_idx_selects_group_per_column():
    q = torch.tensor([[1, 2, 3, 4]], dtype=torch.int8)
    scale = torch.tensor([[1.0, 10.0]])
    g_idx = torch.tensor([1, 0, 1, 0])
    w = dequantize_int(q, scale, None, group_size=2, g_idx=g_idx)
    assert w.tolist() == [[10.0, 2.0, 30.0, 4.0]]


def test_fake_quantize_keeps_dtype_and_zero_rows():
    w = torch.zeros(3, 8, dtype=torch.bfloat16)
    out = fake_quantize_int(w, 4, group_size=4, symmetric=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, w)
