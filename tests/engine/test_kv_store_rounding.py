"""The C decode step writes K and V into fp8 and bf16 caches with exactly torch's rounding
(attention._store): every tie between two representable values, subnormals, saturation.

Random model activations almost never land on a tie or in e5m2's subnormals, so the
bit-equality tests of the whole step (test_fused_decode.py) cannot see those cases; here the
step's own store routine, compiled into a two-line harness, gets them directly.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.layers import cpu_kernels
from engine.layers.attention import _store
from engine.layers.cpu_attention import CACHE_TYPES, fp8_table

HARNESS = """
#include "{csrc}/decode_step.c"
void store_row(void *cache, const float *x, int n, int kv_type, const float *table) {{
    store_kv(cache, 0, x, n, kv_type, table, n);
}}
"""


@pytest.fixture(scope="module")
def store_row(tmp_path_factory):
    compiler = cpu_kernels.compiler()
    if compiler is None:  # the engine then keeps its torch path, whose store this compares against
        pytest.skip("no C compiler here: the C decode step (whose store this tests) is not built either")
    folder = tmp_path_factory.mktemp("harness")
    source = folder / "store_harness.c"
    source.write_text(HARNESS.format(csrc=cpu_kernels.SOURCES))
    with pytest.MonkeyPatch.context() as patch:  # the build cache keys on the engine's sources, not this file
        patch.setenv("DRIFTGATE_HOME", str(folder))
        library = ctypes.CDLL(str(cpu_kernels._build(compiler, source)))
    fn = library.store_row
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = None
    return fn


def _representable_pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjacent non-negative finite values (a, b) of `dtype`: all of an fp8 format's, a sample of bf16's."""
    if dtype == torch.bfloat16:
        bits = torch.randint(0, 0x7F7F, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
        return bits.view(dtype).float(), (bits + 1).view(dtype).float()  # next bit pattern: next value up
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = values[values.isfinite() & (values >= 0)].unique()  # sorted, one zero
    return grid[:-1], grid[1:]


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Representable values, every midpoint between adjacent ones (a tie, which rounds to the even
    one) and the floats just either side of it, both signs; zero, and beyond the range both ways."""
    low, high = _representable_pairs(dtype)
    mids = (low + high) / 2  # exact in float32
    nudged = [torch.nextafter(mids, torch.full_like(mids, side)) for side in (0.0, float("inf"))]
    largest = torch.finfo(dtype).max
    positive = torch.cat([low, high, mids, *nudged, torch.tensor([0.0, 1e9, largest * 1.01])])
    return torch.cat([positive, -positive])


@pytest.mark.parametrize("dtype,scale", [(torch.float8_e4m3fn, 1.0), (torch.float8_e4m3fn, 2.0**-6),
                                         (torch.float8_e5m2, 1.0), (torch.float8_e5m2, 2.0**-6),
                                         (torch.bfloat16, 1.0)])
def test_store_rounds_as_torch(store_row, dtype, scale):
    """fp8 caches store x / scale (a power of two here, so the ties survive the division); bf16
    caches are unscaled."""
    x = (_hard_values(dtype) * scale).contiguous()
    scale_t = torch.tensor(scale)
    expected = torch.zeros(1, 1, x.numel(), dtype=dtype)
    _store(expected, torch.zeros(1, dtype=torch.long), x.reshape(1, 1, -1), scale_t)
    got = torch.zeros_like(expected)
    table = fp8_table(scale_t, 1, dtype) if dtype != torch.bfloat16 else torch.zeros(1)
    store_row(got.data_ptr(), x.data_ptr(), x.numel(), CACHE_TYPES[dtype], table.data_ptr())
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
