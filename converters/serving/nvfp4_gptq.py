"""NVFP4 weight codes rounded by GPTQ: each column's rounding error fed forward to the columns not yet rounded.

Round to nearest picks each E2M1 code on its own, so the errors of one row's codes add up in the layer's output
``x W^T`` as they fall. GPTQ (Frantar et al. 2022) rounds the columns of ``W`` one at a time and, after each,
moves the not-yet-rounded columns of the row so that the output error on calibration inputs ``X`` stays least:
with ``H = 2 X^T X / n`` (+ damping) and ``U`` the upper Cholesky factor of ``H^-1``, rounding column ``j`` with
error ``e = (w_j - q_j) / U[j, j]`` subtracts ``e U[j, k]`` from every later column ``k``. Columns go in blocks of
``block_columns`` (the update of the columns after a block is one matrix product, as in the paper's lazy batching).

The NVFP4 scales are fixed before the loop: the weight global scale from the fused group's amax and the E4M3 block
scales by :func:`~converters.serving.nvfp4.quantize_nvfp4` (``rtn``, ``mse`` or ``four_over_six``), as
llm-compressor's GPTQModifier fixes a ``tensor_group`` weight's scales from its observer before the loop. Only the
choice of codes changes, so the result is packed and stored exactly as the ordinary writer stores it (``code *
scale / global`` in every engine). A fused group (q/k/v, gate/up) shares its input, hence one Hessian for all its
members. With ``H`` a multiple of the identity the update is zero and the codes are round to nearest's, bit for bit.
"""

from __future__ import annotations

import torch

from converters.casts.emulation import e2m1_codes
from converters.serving.nvfp4 import GROUP, pack_e2m1_codes, quantize_nvfp4
from converters.serving.nvfp4_codes import SIGNED_E2M1, dequantize_stepped

__all__ = ["DAMPING", "ROUNDED_TENSORS", "HessianAccumulator", "dequantize_codes", "gptq_codes", "gptq_codes_stepped",
           "quantize_nvfp4_gptq"]

#: the tensors a rounded weight is stored as between calibration and export, in the writer's order; each under
#: ``f"{weight_key}:{name}"`` in its layer's file (converters.calibration.gptq_rounding)
ROUNDED_TENSORS = ("packed", "scale", "global_scale")
#: damping added to H's diagonal, as a fraction of its mean (GPTQ's and llm-compressor's dampening_frac 0.01)
DAMPING = 0.01
#: columns rounded between two whole-matrix updates (GPTQ's and llm-compressor's block_size)
BLOCK_COLUMNS = 128


class HessianAccumulator:
    """``2 X^T X / n`` of a Linear's (or fused group's) inputs, accumulated over calibration batches in fp64
    (thousands of bf16 rows summed in fp32 lose the small eigenvalues GPTQ's inverse depends on)."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(columns, columns, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        """Add ``inputs`` (``[..., columns]``: every leading position is one row of ``X``)."""
        x = inputs.reshape(-1, inputs.shape[-1]).to(device=self.sum.device, dtype=torch.float64)
        self.sum.addmm_(x.T, x)
        self.rows += x.shape[0]

    @property
    def matrix(self) -> torch.Tensor:
        """The Hessian of the squared output error (fp64 ``[columns, columns]``); ValueError before any input."""
        if not self.rows:
            raise ValueError("no inputs were added to the Hessian")
        return self.sum * (2.0 / self.rows)


def _inverse_cholesky_upper(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damping * mean(diag H) I)^-1`` (fp64). A Hessian that is not positive
    definite even so (rows fewer than columns and a tiny diagonal) gets ten times the damping until it is."""
    mean_diagonal = float(hessian.diagonal().mean())
    for attempt in range(6):
        damped = hessian.clone()
        damped.diagonal().add_(damping * 10 ** attempt * mean_diagonal)
        factor, info = torch.linalg.cholesky_ex(damped)
        if not info:
            inverse = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if not info:
                return upper
    raise ValueError("the Hessian stays singular after damping (no calibration inputs reached this layer?)")


def gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, scale_global: torch.Tensor, *,
               damping: float = DAMPING, block_columns: int = BLOCK_COLUMNS, act_order: bool = False
               ) -> torch.Tensor:
    """The E2M1 codes (uint8 ``[out, in]``, bit 3 the sign, as :func:`~converters.casts.emulation.e2m1_codes`)
    GPTQ gives ``weight`` under fixed NVFP4 scales.

    Args:
        weight: ``[out, in]`` (any float dtype; rounded in fp32, where a bf16 weight is exact).
        hessian: ``[in, in]``, e.g. :attr:`HessianAccumulator.matrix`; only its direction matters (damping is
            relative to its diagonal).
        scale: the E4M3 block scales (``[out, in/16]``, E4M3 or their fp32 values), held fixed.
        scale_global: the weight global scale (fp32 ``[1]``); a code dequantizes as ``code * scale / global``.
        damping: fraction of the mean diagonal added to ``H`` before inverting it.
        block_columns: columns between two updates of the rest of the matrix (a speed knob: same result up to fp32
            rounding).
        act_order: round the columns in order of decreasing ``H[j, j]`` (the inputs with most energy first, while
            the most columns are left to absorb their error), GPTQ's ``actorder``; the scales stay per block.

    The column loop is a few dozen small tensor operations per column: on a busy CPU one intra-op thread runs it
    several times faster than two (the caller's ``torch.set_num_threads``).

    Raises:
        ValueError: shapes that do not fit together, or a Hessian that stays singular after damping.
    """
    return gptq_codes_stepped(weight, hessian, scale.float() / scale_global.float(), damping=damping,
                              block_columns=block_columns, act_order=act_order)


def gptq_codes_stepped(weight: torch.Tensor, hessian: torch.Tensor, block_step: torch.Tensor, *,
                       damping: float = DAMPING, block_columns: int = BLOCK_COLUMNS, act_order: bool = False
                       ) -> torch.Tensor:
    """:func:`gptq_codes` with each block's step given as it is (fp32 ``[out, in/16]``: a code dequantizes as
    ``code * step``), for a format whose step is not ``scale / global`` (ModelOpt's ``weight_scale *
    weight_scale_2``)."""
    rows, columns = weight.shape
    if columns % GROUP or block_step.shape != (rows, columns // GROUP) or hessian.shape != (columns, columns):
        raise ValueError(f"weight {tuple(weight.shape)}, block steps {tuple(block_step.shape)} and Hessian "
                         f"{tuple(hessian.shape)} do not fit NVFP4 blocks of {GROUP}")
    step = block_step.float().repeat_interleave(GROUP, dim=1)
    work = weight.float().clone()
    hessian = hessian.to(device=work.device, dtype=torch.float64, copy=True)
    # an input that was always zero has no error to spread: a unit diagonal leaves its column to round to nearest
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1.0
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True) if act_order else None
    if order is not None:
        work, step, hessian = work[:, order], step[:, order], hessian[order][:, order]
    upper = _inverse_cholesky_upper(hessian, damping).float()

    # columns as rows ([in, out]): each column one contiguous vector for the loop's small operations
    work, step = work.T.contiguous(), step.T.contiguous()
    device = work.device  # the weight's: a GPU worker rounds on its GPU
    values = SIGNED_E2M1.to(device)
    codes = torch.empty(columns, rows, dtype=torch.uint8, device=device)
    for start in range(0, columns, block_columns):
        end = min(start + block_columns, columns)
        block = work[start:end]  # a view: the updates below land in work
        block_upper = upper[start:end, start:end]
        errors = torch.empty(end - start, rows, device=device)
        for i in range(end - start):
            column, column_step = block[i], step[start + i]
            column_codes = e2m1_codes(column / column_step)
            codes[start + i] = column_codes
            error = (column - values[column_codes.long()] * column_step) / block_upper[i, i]
            # the rest of the block absorbs this column's error (H^-1's row, through its Cholesky factor)
            block[i + 1:].sub_(torch.outer(block_upper[i, i + 1:], error))
            errors[i] = error
        work[end:].sub_(upper[start:end, end:].T @ errors)
    codes = codes.T
    if order is not None:
        codes = codes[:, torch.argsort(order)]
    return codes


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, scale_global: torch.Tensor) -> torch.Tensor:
    """The fp32 weight engines compute from E2M1 ``codes`` (uint8 ``[out, in]``, bit 3 the sign) under E4M3 block
    ``scale`` and ``scale_global``: ``value(code) * (scale / global)``."""
    return dequantize_stepped(codes, scale.float() / scale_global.float())


def quantize_nvfp4_gptq(weight: torch.Tensor, weight_amax: float, hessian: torch.Tensor, *,
                        scale_search: str = "rtn", damping: float = DAMPING, act_order: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~converters.serving.nvfp4.quantize_nvfp4`'s tensors (packed, E4M3 block scales, fp32 global scale)
    with the codes rounded by :func:`gptq_codes`: the same scales (``scale_search`` picks them from the weight as
    it is, before any rounding), the same packing, other codes.

    ``weight`` is in the model's dtype (the scales' arithmetic is the writer's); ``weight_amax`` the fused group's
    largest ``|w|``; ``hessian`` the group's input Hessian (``[in, in]``).
    """
    _, scale, scale_global = quantize_nvfp4(weight, weight_amax, scale_search=scale_search)
    codes = gptq_codes(weight, hessian, scale, scale_global, damping=damping, act_order=act_order)
    return pack_e2m1_codes(codes), scale, scale_global
