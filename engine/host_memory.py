"""Large host tensors on transparent huge pages.

The KV cache is read at random block granularity every decode step; on 4 KB pages each block
crosses pages whose translations miss the TLB. Anonymous memory advised MADV_HUGEPAGE before its
first touch is backed by 2 MB pages where the kernel allows it (THP "madvise" or "always");
elsewhere the advice is refused and the memory is plain, still zeroed.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on fresh anonymous pages, huge pages where available.

    Every page is written here, so the memory is committed now (as torch.zeros would) and not
    faulted in during serving. The mapping lives as long as the tensor and its views: torch
    keeps the buffer alive.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages
            pass
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).zero_().view(dtype).view(shape)
