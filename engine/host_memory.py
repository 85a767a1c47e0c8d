"""Large host tensors on transparent huge pages, and the C heap's freed pages handed back.

Decode streams every prepacked weight and reads the KV cache at random block granularity each
step; on 4 KB pages those reads keep missing the TLB. Anonymous memory advised MADV_HUGEPAGE
before its first touch is backed by 2 MB pages where the kernel allows it (THP "madvise" or
"always"); elsewhere the advice is refused and the memory is plain pages, zeroed all the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20


def _mapped(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on a fresh anonymous mapping; torch keeps the mapping alive with the tensor."""
    if nbytes == 0:  # nothing to map (an empty cache, say)
        return torch.empty(0, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages
            pass
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros; on CPU, on a mapping of its own with huge pages where available.

    Every page is written here, so the memory is committed now (as torch.zeros would) and not
    faulted in during serving.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapped(_nbytes(shape, dtype)).zero_().view(dtype).view(shape)


class Arena:
    """Long-lived tensors (prepacked weights) back to back on huge-page mappings.

    A mapping per weight would leave each one's unaligned head and tail on 4 KB pages, and most
    of the model's weights are smaller than a huge page. A chunk stays mapped while any tensor
    carved from it lives (and the arena keeps its current one); only touched pages take memory.
    """

    ALIGN = 64  # a cache line: every tensor starts on one, whatever its dtype

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._offset = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor (contents unspecified) carved from the current chunk."""
        nbytes = _nbytes(shape, dtype)
        if nbytes > self.chunk_bytes // 4:  # large enough to fill huge pages of its own
            return _mapped(nbytes).view(dtype).view(shape)
        with self._lock:
            if self._chunk is None or self._offset + nbytes > self.chunk_bytes:
                self._chunk, self._offset = _mapped(self.chunk_bytes), 0
            start = self._offset
            self._offset += -(-nbytes // self.ALIGN) * self.ALIGN
            return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t (any layout) in the arena."""
        return self.empty(tuple(t.shape), t.dtype).copy_(t)


WEIGHTS = Arena()


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim); False where there is none.

    Loading frees more than it keeps (tensors read, int4 unpacked to bytes, float32 weights laid
    out again in panels), and glibc keeps freed pages amid its heap resident for a reuse serving
    never makes (`driftgate bench load` measures what a loaded engine keeps).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
