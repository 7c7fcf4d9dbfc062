"""Load fp8forge artifacts back: ``load_torchao`` (CPU or GPU) and ``load_te`` (CUDA + TransformerEngine).

Both verify the manifest's checksums first, so a truncated or altered file is refused, not loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from converters.artifact.files import verify_manifest
from converters.artifact.layout import read_fp8_block
from converters.backends import backend_named
from converters.backends.te.loader import load_te_model
from converters.backends.te.runtime import require_te

__all__ = ["load_torchao", "load_te"]



def load_torchao(directory: str | Path, *, verify: bool = True, device: str = "cpu") -> Any:
    """A model with the artifact's weights and ``Float8Linear`` layers, replaying the recorded conversion.

    The torchao ``Float8LinearConfig`` is rebuilt from the artifact's ``fp8.float8_linear_config`` and
    exactly ``fp8.converted_modules`` are swapped. MoE experts GEMMs (``fp8.converted_experts``) get torchao's
    grouped GEMM of ``fp8.experts_config`` where it runs (FP8 rowwise: CUDA compute capability 9.0/10.0 with
    triton; MXFP8: 10.x, or anywhere emulated) and stay in high precision elsewhere, with a warning;
    ``model.fp8_experts`` (an
    ``ExpertsPrecision``) says which. The model is returned in train mode, ready to train.
    Raises ArtifactError for a missing/altered file or an artifact of another backend.
    """
    return _load(directory, "ao", verify=verify, device=device)


def load_te(directory: str | Path, *, verify: bool = True, device: str = "cuda", reseed_steps: int = 0) -> Any:
    """A model with ``te.Linear`` layers (and ``te.GroupedLinear`` experts GEMMs) whose scaling state equals the
    artifact's (CUDA + TE only).

    Run it under the artifact's recipe, ``model.fp8_recipe``: ``te.autocast(enabled=True,
    recipe=model.fp8_recipe)``; TE's default recipe would drop or resize the seeded state. ``reseed_steps`` > 0
    re-seeds the delayed-scaling state from that many calibration steps on the weights instead of the file's
    (resuming a run whose scales went stale: :mod:`converters.backends.te.resume`).
    Raises BackendUnavailableError (before reading any weight) where CUDA or TransformerEngine is
    missing, and ArtifactError for a missing/altered file or an artifact of another backend.
    """
    require_te()
    if reseed_steps:
        directory = Path(directory).resolve()
        if verify:
            verify_manifest(directory)
        return load_te_model(directory, device=device, reseed_steps=reseed_steps)
    return _load(directory, "te", verify=verify, device=device)


def _load(directory: str | Path, backend: str, *, verify: bool, device: str) -> Any:
    directory = Path(directory).resolve()
    if verify:
        verify_manifest(directory)
    read_fp8_block(directory, backend)
    return backend_named(backend).load(directory, device=device)
