"""Element casts: FP8 (E4M3, E5M2) and FP4 (E2M1) values and codes of already scaled tensors, the amax they are
scaled by, and the bound under which an E4M3 cast needs no clamp. The scale rules and block layouts that use them
are :mod:`converters.casts.emulation`'s."""

from __future__ import annotations

import torch

from converters.model.quantized.arithmetic import fp8_as_float as _fp8_as_float

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "E2M1_MAX",
    "E2M1_GRID",
    "E4M3_UNCLAMPED_MAX",
    "FP8_ELEMENTS",
    "cast_fp8",
    "round_to_e2m1",
    "e2m1_codes",
    "max_abs",
    "divide_exactly",
    "e4m3_clamp_needed",
    "quotient_to_e4m3",
]

#: Largest finite value of each FP8 format (448 and 57344: TE ``Format`` / ``fp8_dtype_max`` in delayed_scaling.cu).
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)

E2M1_MAX = 6.0
#: The non-negative values of FP4 E2M1, in code order (code 0..7).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Each FP8 element name's torch dtype and largest finite value.
FP8_ELEMENTS = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, E5M2_MAX)}


def cast_fp8(x: torch.Tensor, element: str) -> torch.Tensor:
    """``x`` (already scaled) cast to FP8 with saturation and round-to-nearest-even, back in fp32.

    The way back reads each byte's value from a 256-entry table (``index_select``): the same values as ``.float()``,
    which converts element by element on a CPU and cost more than the cast itself."""
    dtype, top = FP8_ELEMENTS[element]
    return _fp8_as_float(x.clamp(-top, top).to(dtype))


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to nearest even onto the FP4 E2M1 values, saturating at +-6 (fp32 result).

    E2M1 steps by 0.5 below 2, by 1 below 4 and by 2 up to 6, and an even multiple of the step is an even code,
    so rounding ``|x| / step`` half to even (``torch.round``) is the format's round-to-nearest-even: a tie
    goes to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    """
    magnitude = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, x)


#: fp32 constants whose neighbours are spaced 0.5, 1 and 2 apart: ``x + M`` rounds ``x`` to that step (e2m1_codes)
_ROUND_HALF, _ROUND_ONE, _ROUND_TWO = 2.0 ** 22, 2.0 ** 23, 2.0 ** 24
_ROUND_BITS = {value: int(torch.tensor(value, dtype=torch.float32).view(torch.int32)) for value in
               (_ROUND_HALF, _ROUND_ONE, _ROUND_TWO)}


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The FP4 E2M1 code (uint8, 0..15: bit 3 the sign, set where ``x < 0``) of each fp32 ``x``, rounded to nearest
    even and saturated at +-6: the code of :func:`round_to_e2m1` ``(x)`` (a ``-0`` result of a negative ``x``
    included), computed in about ten vectorized passes instead of its branches.

    The magnitude's code is the smallest of ``round(2|x|)``, ``round(|x|) + 2``, ``round(|x| / 2) + 4`` and 7: each
    is the code within its step's range (0.5 below 2, 1 below 4, 2 above; ties to even, as the step's even multiple
    is an even code) and the largest of the three there. Each rounding is one fp32 addition: ``|x| + 2**22`` is
    rounded to the nearest multiple of 0.5 (ties to even), and its bits minus those of ``2**22`` count the halves;
    ``2**23`` and ``2**24`` do the same by 1 and by 2. A larger ``|x|`` (infinity included) gives larger counts,
    so it saturates at 7. NaN has no code (a finite weight's scaled values are never NaN).
    """
    magnitude = x.float().abs()
    halves = (magnitude + _ROUND_HALF).view(torch.int32).sub_(_ROUND_BITS[_ROUND_HALF])
    ones = (magnitude + _ROUND_ONE).view(torch.int32).sub_(_ROUND_BITS[_ROUND_ONE] - 2)
    twos = (magnitude.add_(_ROUND_TWO)).view(torch.int32).sub_(_ROUND_BITS[_ROUND_TWO] - 4)
    code = torch.minimum(halves, ones, out=halves)
    code = torch.minimum(code, twos, out=code).clamp_(max=7).to(torch.uint8)
    return code.add_((x < 0).view(torch.uint8), alpha=8)  # the sign bit (bit 3: the magnitude's code is at most 7)


def max_abs(x: torch.Tensor, dim: int | None = None, *, keepdim: bool = True) -> torch.Tensor:
    """``x.abs().amax()`` (over ``dim``, kept unless ``keepdim`` is False) in ``x``'s dtype: the same values in fewer
    passes. ``x`` must not be empty. Whole: one ``aminmax`` pass, without an ``|x|`` copy of the tensor. Along
    ``dim`` of a 16-bit float tensor: the bits with the sign cleared, as int16, and their max (a non-negative
    float's bits order as its value; the int16 reduction is vectorized where a bf16 ``amax`` over a short last dim
    is not); other dtypes: ``|x|`` then its max (``aminmax`` over a dim of a bf16 tensor is slower than that on a
    CPU, torch 2.13). A NaN gives NaN either way (its payload may differ). The measurements behind these choices:
    docs/benchmarks/requantize-2026-12-03e.md."""
    if dim is not None:
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            return (x.view(torch.int16) & 0x7FFF).amax(dim=dim, keepdim=keepdim).view(x.dtype)
        return x.abs().amax(dim=dim, keepdim=keepdim)
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low)


def divide_exactly(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded once, in ``x``'s dtype, on any device: the CPU's bits on a GPU too.

    PyTorch's CUDA division by a CPU scalar (a Python number or a 0-dim CPU tensor) multiplies by its reciprocal,
    one bit off the quotient for some values, so a scale written on a GPU worker would differ from the CPU's and the
    peers'. A 0-dim tensor on ``x``'s device is divided by. ``divisor`` must be exact in ``x``'s dtype (448, 6: the
    formats' constants).
    """
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


#: the largest ``|x|`` whose ``float8_e4m3fn`` cast is 448 by rounding alone: between 448 (code 0x7E) and 480 (0x7F,
#: NaN's pattern) a cast rounds to nearest even, and 464, the tie, goes to 0x7E, the even code. Above it torch 2.13
#: saturates to 448, where older conversions gave NaN: a quotient within this bound casts to the same byte clamped
#: to +-448 or not, whichever the conversion does.
E4M3_UNCLAMPED_MAX = 464.0


def e4m3_clamp_needed(amax: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether clamping ``w / scale`` to +-448 can change its E4M3 bytes, for blocks with these ``amax`` (each the
    exact largest ``|w|`` of its block) and positive ``scale`` s (broadcastable), in the dtypes the quotient is
    computed in: False when every ``amax / scale`` is within :data:`E4M3_UNCLAMPED_MAX`.

    That bounds every quotient of the block: ``|w| <= amax``, and rounding the exact quotient to the result's dtype
    is monotonic, so ``|w / scale|`` rounds to at most what ``amax / scale`` rounds to. A NaN (a NaN weight) or an
    infinite bound says True: the clamp then runs as before. The check is a pass over the scales only."""
    if amax.numel() == 0:
        return False
    return not bool((amax / scale).max() <= E4M3_UNCLAMPED_MAX)


def quotient_to_e4m3(quotient: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quotient`` (the caller's own ``w / scale``, clamped in place where :func:`e4m3_clamp_needed` says a clamp to
    +-448 can change its bytes) as float8_e4m3fn."""
    if e4m3_clamp_needed(amax, scale):
        quotient.clamp_(-E4M3_MAX, E4M3_MAX)
    return quotient.to(torch.float8_e4m3fn)
