"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs (H = XᵀX).

Group scales (and zero points) are fixed up front from the original weight, as llm-compressor
does: that keeps one code path for every activation order, and a group's scale never depends
on error feedback from other groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.int_quant import compute_qparams, int_range


@dataclass(frozen=True)
class GPTQResult:
    """Quantized values and their qparams, in the layout ``quantize_weight`` takes."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, n_groups] (scale_dtype)
    zero_point: torch.Tensor | None  # [out, n_groups] int8, asymmetric only
    g_idx: torch.Tensor | None  # [in] int32, actorder "group" only


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    num_bits: int,
    group_size: int | None,
    symmetric: bool = True,
    actorder: str | None = None,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype = torch.float32,
) -> GPTQResult:
    """Solve GPTQ for one Linear.

    weight: [out, in]; hessian: [in, in], any positive multiple of XᵀX over calibration tokens.
    ``group_size`` None means one scale per output row. ``actorder`` "weight" visits columns by
    decreasing Hessian diagonal (a calibration-only change); "group" also forms the groups in that
    order and returns ``g_idx``. Scales are rounded to ``scale_dtype`` before use so the stored
    checkpoint dequantizes to exactly what was solved for. Raises ValueError when H is not
    positive definite even after dampening.
    """
    if actorder not in (None, "weight", "group"):
        raise ValueError(f"actorder must be None, 'weight' or 'group', got {actorder!r}")
    if actorder == "group" and group_size is None:
        raise ValueError("actorder 'group' needs a group size")
    out, cols = weight.shape
    if tuple(hessian.shape) != (cols, cols):
        raise ValueError(f"hessian shape {tuple(hessian.shape)} != ({cols}, {cols})")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()

    # Columns that never saw input carry no signal: zero them and keep H invertible.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = torch.argsort(torch.diag(h), descending=True) if actorder else torch.arange(cols)
    # Groups are consecutive columns in processing order for "group", in original order otherwise.
    group_cols = w[:, perm] if actorder == "group" else w
    scale, zero_point = compute_qparams(group_cols, num_bits, group_size=group_size, symmetric=symmetric)
    scale = scale.to(scale_dtype)
    g = group_size or cols
    if actorder == "group":
        g_idx = torch.empty(cols, dtype=torch.long)
        g_idx[perm] = torch.arange(cols) // g
    else:
        g_idx = torch.arange(cols) // g

    w, h = w[:, perm], h[perm][:, perm]
    col_scale = scale.float()[:, g_idx[perm]]  # [out, in] in processing order
    col_zp = zero_point.float()[:, g_idx[perm]] if zero_point is not None else torch.zeros_like(col_scale)

    h += dampening * torch.mean(torch.diag(h)) * torch.eye(cols)
    try:
        h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"GPTQ: Hessian is not positive definite after dampening {dampening}: {e}") from e

    qmin, qmax = int_range(num_bits)
    q = torch.zeros(out, cols)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        w_block = w[:, start:end].clone()
        err_block = torch.zeros_like(w_block)
        h_inv_block = h_inv[start:end, start:end]
        for i in range(end - start):
            c = start + i
            col = w_block[:, i]
            q_col = torch.round(col / col_scale[:, c] + col_zp[:, c]).clamp(qmin, qmax)
            q[:, c] = q_col
            err = (col - (q_col - col_zp[:, c]) * col_scale[:, c]) / h_inv_block[i, i]
            # Optimal update of the block's remaining columns for this column's error.
            w_block[:, i:] -= err.unsqueeze(1) * h_inv_block[i, i:].unsqueeze(0)
            err_block[:, i] = err
        # Lazy batch update of every column after the block.
        w[:, end:] -= err_block @ h_inv[start:end, end:]

    q = q[:, torch.argsort(perm)].to(torch.int8)
    return GPTQResult(
        q=q,
        scale=scale,
        zero_point=zero_point,
        g_idx=g_idx.to(torch.int32) if actorder == "group" else None,
    )


def accumulate_hessian(hessian: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Add a batch of Linear inputs to H: returns H + 2·XᵀX in fp32 (x: [..., in]).

    The scale of H does not matter to GPTQ (dampening is relative), so no sample count is kept.
    """
    x2d = x.reshape(-1, x.shape[-1]).float()
    update = 2 * x2d.t() @ x2d  # [in, in]
    return update if hessian is None else hessian + update
