"""The CPU paged-decode kernel (engine/csrc/paged_decode.c): build once, load, call.

Decode attention in torch gathers every sequence's cached K and V into a dense copy first;
the C kernel reads them in place from the block tables. It is compiled with the system C
compiler at first use (`-march=native`, so the cached library is keyed by the CPU as well as
the source) into `$DRIFTGATE_HOME/kernels/`. Without a compiler, or with
`DRIFTGATE_CPU_KERNELS=0`, `available()` is False and attention keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.model_import import driftgate_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_decode.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# Every e4m3 bit pattern's value; times the layer scale it is the kernel's dequantization table.
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(compiler: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join([compiler, *CFLAGS]).encode(), _cpu_signature().encode()):
        digest.update(part)
    target = driftgate_home() / "kernels" / f"paged_decode-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("DRIFTGATE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found: decode attention uses the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the paged-decode kernel failed, using the torch path: %s", detail)
        return None
    fn = lib.paged_decode_attention
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i, p, p, i]
    fn.restype = i
    return lib


def available(cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can serve decode attention over a cache of this dtype on this device."""
    return device.type == "cpu" and cache_dtype in CACHE_TYPES and _library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] (one query token per sequence) → attention output [n, H, D] float32.

    block_tables int32 [n, max_blocks] and context_lens int32 [n] describe each sequence's
    cached tokens (its own new token included); k/v_scale matter only for fp8 caches.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the paged-decode kernel is not available (check available() first)")
    q = q.to(torch.float32).contiguous()
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    cache_type = CACHE_TYPES[k_cache.dtype]
    k_table = (_FP8_VALUES * k_scale.float()).contiguous() if cache_type == 2 else None
    v_table = (_FP8_VALUES * v_scale.float()).contiguous() if cache_type == 2 else None
    status = lib.paged_decode_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), num_seqs, block_tables.shape[1],
        num_heads, k_cache.shape[1], head_dim, block_size, scale, cache_type,
        None if k_table is None else k_table.data_ptr(), None if v_table is None else v_table.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"paged-decode kernel: block_size must be a power of two, got {block_size}")
    if status != 0:
        raise MemoryError("paged-decode kernel: scratch allocation failed")
    return out
