"""The arithmetic a layer runs in during the quality pass: the serving engine's, not calibration's fp32 stand-in.

An engine serving a half-precision checkpoint (vLLM, on a CPU or a GPU) keeps its activations in the checkpoint's
dtype: norms, rotary embedding, attention, the MLP's activation product and the residual adds each take and return
bf16 (fp16) tensors, whatever they accumulate in inside. Its GEMMs accumulate in fp32: a half-precision GEMM (oneDNN,
cuBLAS) multiplies the half-precision operands exactly and sums in fp32, and an FP8 GEMM (``torch._scaled_mm``, or
vLLM's per-token kernel: ``_scaled_mm`` to fp32, then ``* x_scale * w_scale``) is an fp32 GEMM of the dequantized
operands; both round their output once, to the activations' dtype.

:func:`engine_arithmetic` runs a layer so: the layer stays in the checkpoint's dtype, except that each Linear holds
its weight (and bias) upcast to fp32 (exact) and is called with its input upcast to fp32 (exact), its output rounded
to the checkpoint's dtype. An FP8 Linear of :mod:`converters.quality.casts` computes in fp32 inside the same hooks,
so its input is cast from the very bf16 values the engine casts, and its product is the engine's fp32 one.

Why not calibration's :func:`converters.calibration.compute.emulating` (the whole layer upcast to fp32, rounded at
each leaf module): on a CPU without native bf16 dot products it is faster, but what it computes between modules
(residual adds, rotary embedding, attention, the gate x up product) stays in fp32 where the engine rounds, and an
FP8 model's casts turn those small differences in their inputs into different codes (measured against vLLM:
docs/benchmarks/engine-2026-12-03c.md). A checkpoint already in fp32 runs as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["engine_arithmetic", "GEMM_DTYPE"]

GEMM_DTYPE = torch.float32  #: the dtype the engine's GEMMs accumulate in, and their operands' here


@contextmanager
def engine_arithmetic(layer: nn.Module, storage: torch.dtype) -> Iterator[None]:
    """Run ``layer`` as an engine serving a ``storage`` checkpoint does (see the module docstring).

    Inside the block, every ``nn.Linear`` of ``layer`` holds fp32 parameters and computes in fp32 between a
    pre-hook that upcasts its input and a hook that rounds its output to ``storage``; every other module runs in
    ``storage``. The Linears stay in fp32 on exit (the caller releases the layer). A no-op for an fp32 ``storage``.
    """
    if storage == GEMM_DTYPE:
        yield
        return
    handles = []
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            module.to(GEMM_DTYPE)
            handles.append(module.register_forward_pre_hook(_upcast_input))
            handles.append(module.register_forward_hook(lambda _m, _a, out: _round(out, storage)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _upcast_input(_module: nn.Module, args: tuple) -> tuple:
    return tuple(arg.to(GEMM_DTYPE) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg
                 for arg in args)


def _round(output: Any, storage: torch.dtype) -> Any:
    return output.to(storage) if isinstance(output, torch.Tensor) and output.is_floating_point() else output
