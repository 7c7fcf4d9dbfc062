"""The dtype a layer-sequential calibration forward computes in, and the bf16 model it then stands in for.

A CPU without native bf16 GEMM kernels (AVX2 only: no avx512_bf16 / AMX) runs a bf16 matmul several times
slower than an fp32 one, so a half-precision checkpoint may calibrate faster in fp32. The amax recorded must
still be the half-precision model's, as closely as fp32 arithmetic allows. :func:`emulating` therefore:

* loads the layer's weights in the checkpoint dtype and upcasts them (exact: every weight amax is identical);
* rounds to the checkpoint dtype the floating-point inputs and outputs of every leaf module of the layer
  (Linear, norm, activation, ...), where the half-precision model's own kernels round their results, so each
  Linear sees the rounded input the half-precision model would hand it and its output amax is a
  half-precision value;
* and the caller rounds the hidden states between layers, which are kept in the checkpoint dtype.

What still differs: arithmetic done between modules in plain functions (residual adds, rotary embedding,
attention's score/softmax/value products, the MLP's gate x up product) runs in fp32 with one rounding where
the half-precision model rounds after every operation; and a kernel's internal accumulation (which a bf16
GEMM does in fp32 too) may be ordered differently. The differences are a few half-precision ulps.

The choice is made from the CPU's own flags (:func:`choose_compute_dtype`), not by timing: a timed probe on
a busy machine flips between runs, and a job's amax must not depend on the machine's load. A CPU whose flags
(``/proc/cpuinfo``) include native half-precision dot products (``avx512_bf16`` or ``amx_bf16`` for bf16,
``avx512_fp16`` or ``amx_fp16`` for fp16) keeps the checkpoint's dtype; so does a capability override that
caps torch's kernels below them (``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` set to avx2 or lower
turns the fast kernels off, so fp32 is chosen); a machine without ``/proc/cpuinfo`` keeps the checkpoint's
dtype. Measured (``benchmarks/bench_calibration_forward.py``): with the kernels capped at AVX2 a 1024-wide
bf16 matmul took 84 ms against 20 ms in fp32, and the calibration pass ran about 11% faster in fp32.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["choose_compute_dtype", "native_half_kernels", "emulating", "cast_floats", "tensor_dtypes", "restore_dtypes"]

_HALF = (torch.bfloat16, torch.float16)
_NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}
#: kernel caps below the ISAs with native half-precision dot products, per variable
_CAPPED = {"ATEN_CPU_CAPABILITY": {"default", "avx2"},
           "ONEDNN_MAX_CPU_ISA": {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core",
                                  "avx512_core_vnni"}}


def choose_compute_dtype(requested: torch.dtype | None, storage: torch.dtype, device: torch.device
                         ) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: the dtype to run layer forwards in for a checkpoint stored in ``storage``.

    ``requested`` None is automatic: fp32 only for a half-precision checkpoint on a CPU without native
    kernels for it (see the module docstring). Otherwise ``requested`` must be ``storage`` or
    ``torch.float32``; anything else raises ValueError.
    """
    name = str(storage).removeprefix("torch.")
    if requested is not None:
        if requested not in (storage, torch.float32):
            raise ValueError(f"compute_dtype must be None, the checkpoint's {storage} or torch.float32, "
                             f"got {requested}")
        return requested, "requested"
    if storage not in _HALF:
        return storage, f"the checkpoint's own {name}"
    if device.type != "cpu":
        return storage, f"the checkpoint's own {name} on {device.type}"
    native = native_half_kernels(storage)
    if native is None:
        return storage, f"the checkpoint's own {name} (this system does not say what the CPU runs natively)"
    if native:
        return storage, f"the checkpoint's own {name}: the CPU has native {name} dot products"
    return torch.float32, f"float32: the CPU (or the kernel cap) has no native {name} dot products"


def native_half_kernels(dtype: torch.dtype, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether torch's CPU kernels run ``dtype`` matmuls natively here; None when the system does not say."""
    for variable, capped in _CAPPED.items():
        if os.environ.get(variable, "").lower() in capped:
            return False
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    if not flags:
        return None
    return bool(flags & _NATIVE_FLAGS[dtype])


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(cast_floats(item, dtype) for item in value)
    if isinstance(value, list):
        return [cast_floats(item, dtype) for item in value]
    if isinstance(value, dict):
        return {key: cast_floats(item, dtype) for key, item in value.items()}
    return value


@contextmanager
def emulating(layer: nn.Module, storage: torch.dtype, compute: torch.dtype) -> Iterator[None]:
    """Run ``layer`` in ``compute`` while rounding at its leaf modules as a ``storage`` model would.

    A no-op when the two dtypes are the same. The rounding hooks are registered before any hook the block
    adds (the amax recorder's), so those see the rounded tensors. The layer stays in ``compute`` on exit
    (the caller releases it). A tensor is rounded once (see :class:`_Rounder`).
    """
    if compute == storage:
        yield
        return
    layer.to(compute)
    rounder = _Rounder(storage)
    handles = []
    for module in layer.modules():
        if next(module.children(), None) is None:
            handles.append(module.register_forward_pre_hook(rounder.pre_hook))
            handles.append(module.register_forward_hook(rounder.hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        rounder.forget()


class _Rounder:
    """Rounds the floating-point inputs and outputs of leaf modules to ``storage`` (values stay in the compute dtype).

    Most leaf inputs are another leaf's output (a norm's output feeding q/k/v, a gate projection feeding the
    activation) or one tensor handed to several Linears; rounding is idempotent, so such a tensor is rounded
    once and the rounded tensor reused: the values are exactly those of rounding at every leaf, at about half
    the conversions. A tensor is recognised by identity and its in-place version counter (an in-place change
    after rounding makes it a new value), among the last ``keep`` tensors seen.
    """

    def __init__(self, storage: torch.dtype, keep: int = 16) -> None:
        self.storage = storage
        self.keep = keep
        # id(tensor) -> (tensor, its version, the rounded tensor); a rounded tensor maps to itself
        self._seen: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def forget(self) -> None:
        self._seen.clear()

    def _remember(self, source: torch.Tensor, rounded: torch.Tensor) -> None:
        self._seen.pop(id(source), None)
        self._seen[id(source)] = (source, source._version, rounded)
        while len(self._seen) > self.keep:
            self._seen.pop(next(iter(self._seen)))

    def round(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.storage:
            seen = self._seen.get(id(value))
            if seen is not None and seen[0] is value and seen[1] == value._version:
                return seen[2]
            rounded = value.to(self.storage).to(value.dtype)
            self._remember(value, rounded)
            self._remember(rounded, rounded)
            return rounded
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.round(item) for item in value)
        return value

    def pre_hook(self, _module: nn.Module, args: tuple) -> tuple:
        return self.round(args)

    def hook(self, _module: nn.Module, _args: tuple, output: Any) -> Any:
        return self.round(output)


def tensor_dtypes(module: nn.Module) -> dict[tuple[int, str], torch.dtype]:
    """The dtype of each floating-point parameter and buffer of ``module`` (for :func:`restore_dtypes`)."""
    return {(id(sub), name): tensor.dtype for sub in module.modules()
            for table in (sub._parameters, sub._buffers) for name, tensor in table.items()
            if tensor is not None and tensor.is_floating_point()}


def restore_dtypes(module: nn.Module, dtypes: dict[tuple[int, str], torch.dtype]) -> None:
    """Give ``module``'s released (meta) tensors back the dtypes :func:`tensor_dtypes` saw, so that a later load of
    the meta model (the export) builds them in the checkpoint's dtypes, not the compute dtype."""
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, tensor in list(table.items()):
                dtype = dtypes.get((id(sub), name))
                if tensor is None or dtype is None or tensor.dtype == dtype:
                    continue
                meta = torch.empty_like(tensor, device="meta", dtype=dtype)
                table[name] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta
