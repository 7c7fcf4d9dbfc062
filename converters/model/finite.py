"""Whether a tensor holds only finite numbers, checked without a second copy of a large weight.

A NaN or infinite value in a weight or a scale survives every later step (a NaN block's amax makes its scale 1
and its codes NaN; an infinite scale is written as it is), so a checkpoint that holds one is published broken
unless it is refused where weights and scales are read and where they are produced.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from converters.errors import ModelConfigError

__all__ = ["all_finite", "check_converted"]

#: a tensor this small is checked by an elementwise test on an fp32 copy (a few KiB: scales)
_SMALL = 1 << 16


def all_finite(tensor: torch.Tensor) -> bool:
    """True when every element of ``tensor`` is finite (always, for an integer tensor or an empty one).

    A large floating tensor is checked by its smallest and largest element (one ``aminmax`` pass, which propagates
    NaN), where ``isfinite(x).all()`` writes a boolean copy of the tensor first.
    """
    if tensor.numel() == 0 or not tensor.dtype.is_floating_point:
        return True
    if tensor.numel() <= _SMALL or tensor.element_size() == 1:
        return bool(torch.isfinite(tensor.float()).all())
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_converted(key: str, weight: torch.Tensor, outputs: Mapping[str, torch.Tensor], target: str, *,
                    check_weight: bool = True) -> None:
    """Refuse ``weight`` (``key``) or what quantizing it to ``target`` gave (``outputs``: name -> tensor) when
    either holds NaN or an infinity.

    ``check_weight`` False: the weight was checked where it was read (a quantized source's weight, dequantized).
    FP8 and integer codes are not read again: from a finite weight and finite scales they are finite.

    Raises:
        ModelConfigError: (field ``model``) naming the tensor.
    """
    if check_weight and not all_finite(weight):
        raise ModelConfigError(f"{key} holds NaN or infinite values, which no {target} checkpoint can carry. The "
                               f"checkpoint is damaged: fix it or download it again", field="model")
    for name, value in outputs.items():
        if value.element_size() == 1 or value.data_ptr() == weight.data_ptr():
            continue
        if not all_finite(value):
            raise ModelConfigError(f"quantizing {key} to {target} gave NaN or infinite values in {name}: a weight "
                                   f"or input range beyond what the format's scale holds. Keep that layer in high "
                                   f"precision (exclude it)", field="model")
