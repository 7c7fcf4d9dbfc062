"""Which GEMMs of each Linear ran in FP8: a dispatch-mode trace of one forward and backward step.

What torchao really dispatches (torchao 0.18, torch 2.13, read and observed on a CPU): a ``Float8Linear`` or a
``Float8TrainingOpConfig``-wrapped weight reaches ``aten.mm`` with two ``Float8TrainingTensor`` operands (E4M3 data,
E5M2 for HYBRID gradients), which torchao's ``float8_ops`` hand to ``torch._scaled_mm`` -- or, with
``emulate=True``, dequantize and multiply in high precision (``ScaledMMConfig.emulate``). On a CPU
``torch._scaled_mm`` runs (the profiler shows ``aten::_scaled_mm``) on a CPU kernel: FP8 operands, no FP8 tensor
cores, so it is emulated. ``MXFP8TrainingOpConfig`` reaches ``aten.mm`` with two ``MXTensor`` operands, which
``kernel_preference`` emulated dequantizes. A GEMM with plain tensors ran in their dtype. TransformerEngine's GEMMs
are C++ calls no dispatch mode sees: TE modules are checked by their own FP8 state (``converters.backends.te``).

The mode sees the subclass operands at the op that takes them; what runs inside the subclass is read from the
operands' own configuration, never guessed from the recipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["GemmRecord", "GemmKind", "LinearCheck", "tracing_gemms"]

_GEMM_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._scaled_mm.", "aten._grouped_mm.",
             "aten._scaled_grouped_mm.", "aten.linear.", "aten.matmul.")


class GemmKind:
    FP8 = "fp8"  #: FP8 operands into an FP8 GEMM kernel on a GPU
    FP8_EMULATED_CPU = "fp8 (emulated on CPU)"  #: FP8 operands into torch._scaled_mm's CPU kernel
    EMULATED = "emulated"  #: FP8-rounded operands dequantized and multiplied in high precision (by configuration)
    HIGH_PRECISION = "high precision"  #: plain operands


@dataclass(frozen=True)
class GemmRecord:
    phase: str  #: ``forward`` or ``backward``
    kind: str  #: a :class:`GemmKind` value
    detail: str  #: operand types and dtypes, and the kernel they go to


@dataclass(frozen=True, kw_only=True)
class LinearCheck:
    path: str
    expected_fp8: bool  #: the artifact says this Linear trains in FP8
    ran: str  #: how its forward GEMM ran: a GemmKind value, or "did not run"
    gemms: tuple[GemmRecord, ...] = ()  #: every GEMM recorded in its forward and backward (torchao)
    detail: str = ""  #: TE: what its FP8 state showed

    @property
    def ran_backward(self) -> str:
        """How its backward GEMMs ran (distinct kinds), or "-" where none was traced."""
        kinds = dict.fromkeys(record.kind for record in self.gemms if record.phase == "backward")
        return " + ".join(kinds) or "-"

    @property
    def ran_fp8(self) -> bool:
        return self.ran not in (GemmKind.HIGH_PRECISION, "did not run")


@dataclass
class _Trace:
    gemms: dict[str, list[GemmRecord]] = field(default_factory=dict)
    stack: list[tuple[str, str]] = field(default_factory=list)  #: (module path, phase) innermost last


def _operand(tensor: torch.Tensor) -> tuple[str, str | None]:
    """(description, kind this operand implies or None for a plain tensor)."""
    name = type(tensor).__name__
    data = getattr(tensor, "_data", None)
    if data is None:
        data = getattr(tensor, "qdata", None)
    if not isinstance(data, torch.Tensor) or not data.dtype.is_floating_point or data.element_size() != 1:
        return f"{str(tensor.dtype).removeprefix('torch.')}", None
    dtype = str(data.dtype).removeprefix("torch.")
    config = getattr(getattr(tensor, "_linear_mm_config", None), "output", None)
    preference = getattr(tensor, "kernel_preference", None)
    emulated = bool(getattr(config, "emulate", False)) or str(getattr(preference, "value", preference)) == "emulated"
    if emulated:
        return f"{name}[{dtype}] (emulated)", GemmKind.EMULATED
    if data.device.type == "cpu":
        return f"{name}[{dtype}] -> torch._scaled_mm on CPU", GemmKind.FP8_EMULATED_CPU
    return f"{name}[{dtype}] -> FP8 GEMM on {data.device.type}", GemmKind.FP8


class _GemmMode(TorchDispatchMode):
    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        name = str(func)
        if self.trace.stack and name.startswith(_GEMM_OPS):
            operands = [_operand(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            kinds = [kind for _, kind in operands if kind is not None]
            if name.startswith("aten._scaled") and not kinds:  # a bare FP8 GEMM call with plain float8 tensors
                kinds = [GemmKind.FP8_EMULATED_CPU if args[0].device.type == "cpu" else GemmKind.FP8] * 2
            kind = kinds[0] if len(kinds) >= 2 else GemmKind.HIGH_PRECISION  # both GEMM operands low precision
            path, phase = self.trace.stack[-1]
            detail = f"{name.removeprefix('aten.')}({', '.join(text for text, _ in operands)})"
            self.trace.gemms.setdefault(path, []).append(GemmRecord(phase, kind, detail))
        return func(*args, **kwargs)


@contextmanager
def tracing_gemms(model: nn.Module, paths: list[str]) -> Iterator[dict[str, list[GemmRecord]]]:
    """Record, per module of ``paths``, each GEMM run inside its forward and its backward (by module hooks), while
    the block runs. Yields the records dict, filled in as the step runs; every hook and the mode are removed after."""
    trace = _Trace()
    handles = []

    def enter(path: str, phase: str):
        def hook(*_args):
            trace.stack.append((path, phase))
        return hook

    def leave(*_args):
        if trace.stack:
            trace.stack.pop()

    try:
        for path in paths:
            module = model.get_submodule(path)
            handles += [module.register_forward_pre_hook(enter(path, "forward")),
                        module.register_forward_hook(leave),
                        module.register_full_backward_pre_hook(enter(path, "backward")),
                        module.register_full_backward_hook(leave)]
        with _GemmMode(trace):
            yield trace.gemms
    finally:
        for handle in handles:
            handle.remove()
