"""NVFP4's 4-bit codes as values: unpacked, dequantized under each block's step, and measured against the weight.

A code's bit 3 is its sign, bits 0-2 index E2M1's eight magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); two codes share a
byte, the even column in the low nibble (:func:`~converters.serving.nvfp4.pack_e2m1_codes`). A block of ``GROUP``
values dequantizes as ``value(code) * step``: ``scale / global`` in compressed-tensors' layout, ``weight_scale *
weight_scale_2`` in ModelOpt's.
"""

from __future__ import annotations

import torch

from converters.casts.emulation import E2M1_GRID, db, e2m1_codes

__all__ = ["GROUP", "SIGNED_E2M1", "dequantize_stepped", "rounding_stats", "unpack_codes"]

GROUP = 16
#: the value of each 4-bit code (bit 3: the sign), so a code dequantizes by one lookup
SIGNED_E2M1 = torch.tensor([*E2M1_GRID, *(-value for value in E2M1_GRID)], dtype=torch.float32)


def dequantize_stepped(codes: torch.Tensor, block_step: torch.Tensor) -> torch.Tensor:
    """``value(code) * step`` (fp32), each block's step given (``[out, in/16]``)."""
    return SIGNED_E2M1.to(codes.device)[codes.long()] * block_step.float().repeat_interleave(GROUP, dim=1)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """:func:`~converters.serving.nvfp4.pack_e2m1_codes` undone: uint8 ``[out, in/2]`` -> codes ``[out, in]``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def rounding_stats(weight: torch.Tensor, codes: torch.Tensor, block_step: torch.Tensor) -> dict[str, float | None]:
    """The weight SQNR (dB) of ``codes`` under ``block_step``, and of round to nearest under the same steps."""
    reference = weight.float()
    nearest = e2m1_codes(reference / block_step.float().repeat_interleave(GROUP, dim=1))
    signal = float(reference.square().sum())

    def sqnr(of: torch.Tensor) -> float | None:
        return db(signal, float((dequantize_stepped(of, block_step) - reference).square().sum()))

    return {"weight_sqnr_db": sqnr(codes), "nearest_weight_sqnr_db": sqnr(nearest)}
