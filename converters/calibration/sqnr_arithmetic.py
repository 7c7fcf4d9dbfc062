"""What the SQNR meter (:mod:`converters.calibration.sqnr_meter`) works with, apart from its bookkeeping: the casts a
recipe applies (:class:`RecipeCasts`), the records it gathers per call and per layer (the sums, delayed scaling's
amax history, the rows waiting to be measured), and its arithmetic: rows cast under a recipe's spec and the
emulated FP8 GEMM on their exact values, energies and weighted sums, and the stratified sample that picks the
token rows and weight blocks measured. Imports torch only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from converters.casts.emulation import db, fake_quantize, fake_quantize_factored

if TYPE_CHECKING:
    import torch

    from converters.casts.emulation import CastSpec

__all__ = ["CHANNEL_BLOCK", "DelayedParams", "RecipeCasts", "Sums", "DelayedHistory", "PendingRows", "CallInput",
           "CastRows", "MeasuredChannels", "amax_per_row", "energy_per_row", "rows_in_blocks", "scaled_product",
           "stratified_sample", "weight_sqnr_sums", "weighted_sum"]

#: weight rows are measured in whole blocks of this many, so that every block scale is the recipe's own
CHANNEL_BLOCK = 128


@dataclass(frozen=True, kw_only=True)
class DelayedParams:
    history_len: int = 1024
    algo: str = "max"
    margin: int = 0


@dataclass(frozen=True, kw_only=True)
class RecipeCasts:
    """What one recipe does to a Linear's forward operands."""

    label: str
    recipe: dict[str, Any]  #: the recipe as data
    weight: CastSpec
    input: CastSpec | None  #: None: the input stays in high precision (a weight-only format)
    delayed: DelayedParams | None = None  #: TE delayed scaling: per-tensor scales from the amax history
    not_emulated: tuple[str, ...] = ()  #: options of the recipe the emulation leaves out

    @property
    def casts_key(self) -> tuple[Any, ...]:
        """Equal for recipes whose forward casts are the same (measured once for all of them)."""
        return self.weight, self.input, self.delayed

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "recipe": self.recipe, "weight_format": self.weight.name,
                "input_format": self.input.name if self.input else None,
                "scale_rule": {"weight": self.weight.scale.value,
                               "input": self.input.scale.value if self.input else None},
                "delayed": self.delayed is not None, "not_emulated": list(self.not_emulated)}


@dataclass
class Sums:
    signal: float = 0.0
    noise: float = 0.0

    def add(self, signal: Any, noise: Any) -> None:
        self.signal += float(signal)
        self.noise += float(noise)

    def db(self) -> float | None:
        value = db(self.signal, self.noise)
        return None if value is None else round(value, 2)


@dataclass
class DelayedHistory:
    """A layer's input amax by step, for delayed scaling: earlier steps' non-zero amaxes, and the current step's."""

    step: int = -1
    current: float = 0.0
    earlier: list[float] = field(default_factory=list)

    def see(self, step: int, amax: float) -> None:
        if step != self.step:
            if self.current > 0:
                self.earlier = (self.earlier + [self.current])[-4096:]
            self.step, self.current = step, 0.0
        self.current = max(self.current, amax)

    def amax_for(self, params: DelayedParams) -> float:
        window = self.earlier[-params.history_len:]
        if not window:
            return self.current  # no history yet: what a calibration-seeded state would hold
        return max(window) if params.algo == "max" else window[-1]


@dataclass
class PendingRows:
    """A layer's sampled rows since its last flush, with what the recipes cast each row's call with."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: int = 0
    own_output: bool = True  #: every call came with the layer's own output (else it is computed at the flush)
    x: list[torch.Tensor] = field(default_factory=list)
    reference: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)  #: per row, how many rows it stands for
    calls: list[tuple[float, dict[DelayedParams, float], int]] = field(default_factory=list)
    """per call: its whole input's amax, what delayed scaling's history held for it, and its rows gathered"""
    steps: list[int] = field(default_factory=list)  #: per call, its calibration step

    def add(self, x: torch.Tensor, reference: torch.Tensor | None, weights: torch.Tensor, call_amax: float,
            delayed: dict[DelayedParams, float], step: int = -1) -> None:
        rows = x.shape[0]
        self.steps.append(step)
        self.x.append(x)
        self.own_output = self.own_output and reference is not None
        if reference is not None:
            self.reference.append(reference)
        self.weights.append(weights)
        self.calls.append((call_amax, delayed, rows))
        self.rows += rows

    def call_amax(self) -> torch.Tensor:
        """Per row, its call's whole-input amax (per-tensor current scaling and NVFP4's global scale)."""
        return self._per_row([amax for amax, _, _ in self.calls])

    def delayed_amax(self, params: DelayedParams | None) -> torch.Tensor | None:
        """Per row, the amax delayed scaling under ``params`` cast its call's input with (None: not delayed)."""
        return None if params is None else self._per_row([delayed[params] for _, delayed, _ in self.calls])

    def _per_row(self, values: list[float]) -> torch.Tensor:
        import torch

        device = self.x[0].device  # the rows' (a GPU worker's calibration gathers them on its GPU)
        counts = torch.tensor([rows for _, _, rows in self.calls], device=device)
        return torch.tensor(values, dtype=torch.float32, device=device).repeat_interleave(counts)


@dataclass
class CallInput:
    """A call's input as the meter uses it (see :meth:`SqnrMeter.input_rows`)."""

    tensor: torch.Tensor  #: the input itself, kept so that the next call on it is recognized
    version: int  #: its in-place version counter then
    step: int
    row_amax: torch.Tensor  #: each token row's max |x| (fp32)
    amax: float  #: the whole input's
    picked: torch.Tensor | None  #: the sampled rows (None: every row)
    weights: torch.Tensor  #: per sampled row, how many rows it stands for
    rows: torch.Tensor  #: the sampled rows of the input, ``[rows, in]``, in the input's dtype


def rows_in_blocks(blocks: Any, out: int) -> float:
    """How many weight rows the 128-row ``blocks`` hold (the last block of ``out`` rows may be partial)."""
    return float(sum(min(CHANNEL_BLOCK, out - int(block) * CHANNEL_BLOCK) for block in blocks))


@dataclass(frozen=True)
class CastRows:
    """Rows cast under a spec: ``values * factor`` (``factor`` per row ``[rows, 1]``, per tensor, or None) are the
    dequantized rows; ``exact``: the values are exact in bf16 (:func:`fake_quantize_factored`)."""

    values: torch.Tensor
    factor: torch.Tensor | None
    exact: bool

    @classmethod
    def of(cls, x: torch.Tensor, spec: CastSpec, *, scale: torch.Tensor | None = None,
           tensor_amax: torch.Tensor | None = None, values_dtype: torch.dtype | None = None) -> CastRows:
        """``x`` (any float dtype) cast; ``values_dtype``: exact values in that dtype (bf16, for a bf16 GEMM)
        where the cast has them (None: fp32)."""
        import torch

        parts = fake_quantize_factored(x, spec, scale=scale, tensor_amax=tensor_amax,
                                       values_dtype=values_dtype or torch.float32)
        if parts is None:
            return cls(values=fake_quantize(x, spec, scale=scale, tensor_amax=tensor_amax), factor=None, exact=False)
        return cls(values=parts[0], factor=parts[1], exact=True)

    def dequantized(self) -> torch.Tensor:
        """The dequantized rows in fp32: a fresh tensor, except for fp32 values without a factor (the values)."""
        values = self.values.float()
        if self.factor is None:
            return values
        return values * self.factor if values is self.values else values.mul_(self.factor)

    def compact(self) -> CastRows:
        """The same cast with exact values held in bf16 (half the bytes of a cached weight cast)."""
        import torch

        if not self.exact or self.values.dtype == torch.bfloat16:
            return self
        return CastRows(values=self.values.to(torch.bfloat16), factor=self.factor, exact=True)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.factor is None else self.factor.nbytes)


def scaled_product(x: CastRows, w: CastRows, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in fp32 from a GEMM in ``dtype`` on the exact values, the factors applied after it (an
    FP8 GEMM's own order: products of codes accumulated, then the scales). A fresh tensor (scaled in place)."""
    from torch.nn.functional import linear

    y = linear(x.values.to(dtype), w.values.to(dtype)).float()
    if x.factor is not None:
        y.mul_(x.factor)
    if w.factor is not None:
        y.mul_(w.factor.reshape(1, -1) if w.factor.dim() else w.factor)
    return y if bias is None else y.add_(bias)


def stratified_sample(amax: torch.Tensor, budget: int, offset: int = 0, *, by_score: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top, rest, spread)``: the sampling rule for token rows and weight blocks alike. A quarter of the
    ``budget`` goes to the units with the largest ``amax`` (outliers carry much of the signal and the noise,
    so they are measured exactly); the rest of it is spread evenly (from ``offset``) over the ``rest``, each
    sampled unit standing for ``len(rest) / len(spread)`` of them: in their order, or with ``by_score`` in the
    order of ``amax`` (a systematic sample over the sorted scores, so large and small ones are both represented:
    far less spread in the estimate where the units differ widely, as a vocabulary's logit blocks do).
    Needs ``len(amax) > budget``."""
    import numpy as np
    import torch

    top = amax.topk(max(1, budget // 4)).indices
    # the index bookkeeping on a few hundred units in numpy: each torch op costs more to dispatch than to run,
    # and this runs for every distinct input of every call
    others = np.ones(amax.shape[0], dtype=bool)
    others[top.cpu().numpy()] = False
    rest = torch.from_numpy(np.flatnonzero(others)).to(amax.device)
    stride = -(-rest.numel() // (budget - top.numel()))
    if by_score:  # the middle unit of each stretch of the sorted order stands for it
        rest = rest[amax[rest].argsort(descending=True)]
        offset = stride // 2
    return top, rest, rest[offset % stride::stride]


#: a 16-bit float tensor up to this many elements takes its row amax from its bits (see amax_per_row)
_BITWISE_AMAX_ELEMENTS = 1 << 22


def amax_per_row(tensor: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` in fp32. A 16-bit float tensor of a call's size: the largest of its bit patterns with
    the sign bit cleared, as integers (they order as the magnitudes do, a NaN above infinity, which it is as the float
    maximum would propagate it): one reduction, 2 to 4 times faster than two float ones on a CPU for a
    ``[256, 576]`` to ``[4096, 576]`` bf16 input. Otherwise (fp32, or a tensor of tens of millions of elements,
    where the integer reduction is slower) two reductions, no ``|x|`` copy of the tensor."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16) and tensor.numel() <= _BITWISE_AMAX_ELEMENTS:
        return (tensor.view(torch.int16) & 0x7FFF).amax(dim=1).view(tensor.dtype).float()
    return torch.maximum(tensor.amax(dim=1), -tensor.amin(dim=1)).float()


def weight_sqnr_sums(w: torch.Tensor, q: torch.Tensor, stands: torch.Tensor | None) -> tuple[float, float]:
    """Signal and noise sums of fp32 weight rows ``w`` cast to ``q`` (each row standing for ``stands`` rows)."""
    if stands is None:  # dot products: one pass each, no squared copy (half the time of square().sum())
        import torch

        error = (w - q).reshape(-1)
        return float(torch.dot(w.reshape(-1), w.reshape(-1))), float(torch.dot(error, error))
    return float(weighted_sum(energy_per_row(w), stands)), float(weighted_sum(energy_per_row(w - q), stands))


def energy_per_row(t: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's sum of squares in fp32 (``t`` of any float dtype, ``[rows, ...]``), each column counted
    ``columns[column]`` times where given: a norm per row instead of a squared copy of ``t`` (the meter's sums
    were as much of its time as its GEMMs)."""
    import torch

    if columns is not None:
        return t.reshape(t.shape[0], -1).float().square().mv(columns)
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1, dtype=torch.float32).square()


def weighted_sum(energy: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The sum of the rows' ``energy`` (:func:`energy_per_row`), each row counted ``weights[row]`` times."""
    return energy.sum() if weights is None else (energy * weights).sum()


@dataclass(frozen=True)
class MeasuredChannels:
    """The output channels (weight rows) of a layer that are measured, and what each stands for."""

    rows: torch.Tensor | None  #: sorted row indices, whole 128-row blocks; None: every row
    weights: torch.Tensor | None  #: per measured row, how many rows it stands for; None: one each
    amax: torch.Tensor  #: the whole weight's amax (per-tensor and NVFP4 global scales come from it)
