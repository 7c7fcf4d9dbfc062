"""torch's own CPU FP8 GEMM where torch would hand ``torch._scaled_mm`` to oneDNN's reference matmul (test-only).

On a CPU with AMX, torch 2.13 sends ``torch._scaled_mm`` to oneDNN, whose only FP8 matmul there is its reference
implementation (``ONEDNN_VERBOSE`` names it ``ref:any``; its brgemm matmul says "datatype configuration not
supported on this isa"): about 0.1 GFLOP/s, 300 times torch's own CPU path on a 256 x 576 x 1536 GEMM. Every other
CPU (AVX2, AVX-512 without AMX) already runs torch's path, which dequantizes both operands to fp32, multiplies, applies
the scales and casts. The two compute the same exact FP8 products and differ only in the order fp32 sums them
(measured: at most one bf16 rounding flipped, fp32 outputs 1e-6 apart in relative terms).

Used where a test needs an FP8 GEMM's result, not its kernel: the engine tests' vLLM driver (vLLM's dynamic FP8
kernel on a CPU is ``torch._scaled_mm``; docs/engines.md, stand-in 4) and the suite's torchao forward checks.
``benchmarks/bench_engine.py`` keeps oneDNN: it measures what vLLM runs. This module imports torch only: the driver
loads it in vLLM's venv.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

__all__ = ["check_agreement", "install", "onednn_runs_fp8_gemms", "scaled_mm_in_torch", "torch_fp8_gemms"]


def onednn_runs_fp8_gemms() -> bool:
    """Whether torch sends FP8 GEMMs to oneDNN here (a build with oneDNN, on a CPU with AMX tiles)."""
    return torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported()


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


def check_agreement(scaled_mm: Callable, replacement: Callable) -> None:
    """Raise unless both GEMMs agree to fp32 summation noise on FP8 operands with per-token/per-channel and
    per-tensor scales, fp32 and bf16 outputs (a later torch that changed either path would fail here)."""
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
            raise AssertionError(f"torch's CPU FP8 GEMM differs from oneDNN's ({out_dtype}): max difference "
                                 f"{(ours - theirs).abs().max().item()}")


def install() -> str | None:
    """Replace ``torch._scaled_mm`` process-wide where oneDNN would run it, after :func:`check_agreement`; returns
    what was replaced, or None where nothing needed to be."""
    if not onednn_runs_fp8_gemms():
        return None
    replacement = scaled_mm_in_torch(torch._scaled_mm)
    check_agreement(torch._scaled_mm, replacement)
    torch._scaled_mm = replacement
    return "torch._scaled_mm: oneDNN's reference FP8 matmul -> torch's own CPU path (a CPU with AMX)"


@contextlib.contextmanager
def torch_fp8_gemms() -> Iterator[None]:
    """Within the block, ``torch._scaled_mm`` runs torch's own CPU path (see :func:`install`); restored after."""
    original = torch._scaled_mm
    installed = install()
    try:
        yield
    finally:
        if installed:
            torch._scaled_mm = original
