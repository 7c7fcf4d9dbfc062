"""The last step of every training twin's weight cast: scale, saturate to +-448, round to E4M3 (nearest even).

TE's kernels and torchao compute the scaled value in fp32 and convert it with a saturating cast. A bf16 weight
scaled by a power of two is exact in bf16 too (bf16 has fp32's exponent range, and a result small enough to lose
bits as a bf16 subnormal is far under E4M3's smallest value, 2**-9, so it rounds to 0 either way): there the
product is taken in bf16, half the memory traffic of a float32 copy, with the same bits (tested against the
libraries' casts).
"""

from __future__ import annotations

import torch

from converters.calibration.scaling import E4M3_MAX

__all__ = ["to_e4m3"]


def to_e4m3(values: torch.Tensor, factor: torch.Tensor, *, divide: bool = False,
            power_of_two: bool = False) -> torch.Tensor:
    """``clamp(values * factor, -448, 448)`` (``/`` with ``divide``) as float8_e4m3fn, computed as fp32 computes it.

    ``power_of_two`` says every ``factor`` is a power of two (the caller's promise; it selects the bf16 path for bf16
    ``values``). ``values`` is not modified.
    """
    if power_of_two and values.dtype is torch.bfloat16:
        factor = factor.to(torch.bfloat16)
        scaled = values / factor if divide else values * factor
    else:
        scaled = values.to(torch.float32, copy=True)
        scaled = scaled.div_(factor) if divide else scaled.mul_(factor)
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
