"""Load fp8forge artifacts back: ``load_torchao`` (CPU or GPU) and ``load_te`` (CUDA + TransformerEngine).

Both verify the manifest's checksums first, so a truncated or altered file is refused, not loaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from converters.errors import ArtifactError

__all__ = ["read_fp8_block", "verify_manifest", "load_torchao", "load_te", "ArtifactError"]

logger = logging.getLogger(__name__)


def verify_manifest(directory: Path) -> list[dict[str, Any]]:
    """Check every file listed in manifest.json (size and sha256). Raises ArtifactError on any mismatch."""
    from converters.artifact_io import MANIFEST_NAME, sha256_file

    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST_NAME}: not an fp8forge artifact (or a partial one)")
    try:
        entries = json.loads(manifest_path.read_text())["files"]
        names = [entry["name"] for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{manifest_path} is malformed ({exc}); re-download the artifact") from exc
    for entry, name in zip(entries, names, strict=True):
        parts = name.split("/") if isinstance(name, str) else [""]
        if any(not part or part.startswith(".") or "\\" in part for part in parts):
            raise ArtifactError(f"{manifest_path} lists {name!r}, which is not a file name inside the artifact")
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"{path} is missing or differs from manifest.json; re-download the artifact")
    return entries


def read_fp8_block(directory: Path, backend: str) -> dict[str, Any]:
    """The ``fp8`` block of the artifact's config.json, checked to be of ``backend``.

    Raises ArtifactError when config.json is missing or unreadable, has no fp8 block, or is of another backend.
    """
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise ArtifactError(f"{directory} has no config.json; point at an fp8forge artifact directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{config_path}: cannot read it as JSON: {exc}") from exc
    block = config.get("fp8") if isinstance(config, dict) else None
    if not isinstance(block, dict):
        raise ArtifactError(f"{directory} is not an fp8forge artifact: config.json has no fp8 block "
                            f"(convert the model with the {backend} backend first)")
    if block.get("backend") != backend:
        raise ArtifactError(f"{directory} is an fp8forge artifact for backend {block.get('backend')!r}, not "
                            f"{backend}; load it with load_{block.get('backend')}()")
    return block


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


def load_te(directory: str | Path, *, verify: bool = True, device: str = "cuda") -> Any:
    """A model with ``te.Linear`` layers (and ``te.GroupedLinear`` experts GEMMs) whose scaling state equals the
    artifact's (CUDA + TE only).

    Run it under the artifact's recipe, ``model.fp8_recipe``: ``te.autocast(enabled=True,
    recipe=model.fp8_recipe)``; TE's default recipe would drop or resize the seeded state.
    Raises BackendUnavailableError (before reading any weight) where CUDA or TransformerEngine is
    missing, and ArtifactError for a missing/altered file or an artifact of another backend.
    """
    from converters.backends.transformer_engine import require_te

    require_te()
    return _load(directory, "te", verify=verify, device=device)


def _load(directory: str | Path, backend: str, *, verify: bool, device: str) -> Any:
    from converters.formats import training_format

    directory = Path(directory).resolve()
    if verify:
        verify_manifest(directory)
    read_fp8_block(directory, backend)
    return training_format(backend).load(directory, device=device)
