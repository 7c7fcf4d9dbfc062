"""FP8 GEMMs on a CPU through torch's own path where torch would hand ``torch._scaled_mm`` to oneDNN's reference
matmul.

On a CPU with AMX, torch 2.13 sends ``torch._scaled_mm`` to oneDNN, whose only FP8 matmul there is its reference
implementation (``ONEDNN_VERBOSE`` names it ``ref:any``; its brgemm matmul says "datatype configuration not
supported on this isa"), many times slower than torch's own CPU path, which every other CPU (AVX2, AVX-512 without
AMX) already runs: dequantize both operands to fp32, multiply, apply the scales, cast. The two compute the same exact
FP8 products and differ only in the order fp32 sums them; through a model with dynamic tensorwise scales such
last-bit differences spread (one flipped amax moves every code of the next cast), as between any two GEMM kernels.
So a torchao training step on such a CPU (``fp8forge check``, :mod:`converters.backends.probe`) runs its FP8 GEMMs
through torch's path: still ``aten::_scaled_mm`` on FP8 operands, called with oneDNN off. The figures:
docs/benchmarks/cpu-fp8-gemm-2026-12-05.md (benchmarks/bench_cpu_fp8_gemm.py).

The replacement is installed only after a sample agrees with the GEMM torch picks (:func:`disagreement`); where it
does not, oneDNN's stays. Imports torch only: the engine tests' vLLM driver loads this file by path in vLLM's venv
(docs/engines.md, stand-in 4).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

__all__ = ["disagreement", "install", "onednn_runs_fp8_gemms", "scaled_mm_in_torch", "torch_fp8_gemms"]

logger = logging.getLogger(__name__)


def onednn_runs_fp8_gemms() -> bool:
    """Whether torch sends FP8 GEMMs to oneDNN here (a build with oneDNN, on a CPU with AMX tiles)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.13: a later torch may move it
    return torch.backends.mkldnn.is_available() and amx is not None and amx()


def scaled_mm_in_torch(scaled_mm: Callable) -> Callable:
    """``scaled_mm`` (``torch._scaled_mm``) run with oneDNN off, which selects torch's own CPU path."""

    @functools.wraps(scaled_mm)
    def without_onednn(*args, **kwargs):
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            return scaled_mm(*args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = enabled

    return without_onednn


def disagreement(scaled_mm: Callable, replacement: Callable) -> str | None:
    """How ``replacement`` differs from ``scaled_mm`` beyond fp32 summation noise on FP8 operands, with
    per-token/per-channel and per-tensor scales, fp32 and bf16 outputs; None where it does not."""
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 128, generator=generator) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(64, 128, generator=generator) * 4).to(torch.float8_e4m3fn).t()
    cases = [(torch.rand(32, 1, generator=generator) + 0.5, torch.rand(1, 64, generator=generator) + 0.5,
              torch.float32), (torch.tensor(0.37), torch.tensor(1.7), torch.bfloat16)]
    for scale_a, scale_b, out_dtype in cases:
        ours, theirs = (gemm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype).float()
                        for gemm in (replacement, scaled_mm))
        tolerance = 2 ** -7 if out_dtype == torch.bfloat16 else 2 ** -16  # one bf16 rounding; fp32 sums
        if not torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item()):
            return (f"torch's CPU FP8 GEMM differs from oneDNN's ({out_dtype} output): max difference "
                    f"{(ours - theirs).abs().max().item()}")
    return None


def install() -> str | None:
    """Replace ``torch._scaled_mm`` process-wide where oneDNN would run it and the two agree; returns what was
    replaced, or None where nothing was."""
    if not onednn_runs_fp8_gemms():
        return None
    replacement = scaled_mm_in_torch(torch._scaled_mm)
    problem = disagreement(torch._scaled_mm, replacement)
    if problem:
        logger.warning("%s: FP8 GEMMs stay on oneDNN's reference matmul (slow on this CPU)", problem)
        return None
    torch._scaled_mm = replacement
    return "torch._scaled_mm: oneDNN's reference FP8 matmul -> torch's own CPU path (a CPU with AMX)"


@contextlib.contextmanager
def torch_fp8_gemms() -> Iterator[None]:
    """Within the block, ``torch._scaled_mm`` runs torch's own CPU path where :func:`install` would put it;
    restored after."""
    original = torch._scaled_mm
    installed = install()
    try:
        yield
    finally:
        if installed:
            torch._scaled_mm = original
