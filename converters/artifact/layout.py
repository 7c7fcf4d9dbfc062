"""The files of one artifact: source weights, FP8 state, calibration tensors, config, report.

Layout (all in one directory, listed with checksums in manifest.json):
- the source checkpoint's weight files, copied byte for byte (``model.safetensors``, or its shards and
  ``model.safetensors.index.json``): TE and torchao keep high-precision weights, so the files keep the
  source's own tensor names, and a plain ``from_pretrained`` loads them as it loads the source.
- ``fp8_state.safetensors`` (TE delayed scaling, the one recipe with state): each converted layer's scaling state
  under the keys of :mod:`converters.backends.te.layout`, keyed by the layer's module path in the loaded model.
  Stateless
  recipes (current scaling, block scaling, MXFP8, NVFP4, every torchao recipe) have none.
- ``fp8_calibration.safetensors``: per layer ``<path>.amax_forward [steps, 3]`` (input, weight, output),
  ``<path>.amax_backward [steps, 2]`` when gradients were recorded, and for per-tensor and rowwise dynamic
  recipes ``<path>.scale_fwd_per_step [steps, 3]`` (a per-tensor E4M3 scale says nothing of block-scaled casts).
- ``config.json``: the model's own config plus an ``fp8`` block (backend, the full recipe, converted modules, and
  what the format adds: TE's recipe class and arguments, torchao's config).
- ``fp8_report.json``: analysis, pipeline mode, calibration statistics, final scales, data source, warnings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from converters.errors import ArtifactError

__all__ = ["FP8_BLOCK_VERSION", "STATE_FILE", "CALIBRATION_FILE", "REPORT_FILE", "MANIFEST_NAME",
           "staging_dir_for", "sha256_file", "read_fp8_block"]

# Version 2: the weights are the source's files, untouched; the TE state lives in its own file.
FP8_BLOCK_VERSION = 2
STATE_FILE = "fp8_state.safetensors"
CALIBRATION_FILE = "fp8_calibration.safetensors"
REPORT_FILE = "fp8_report.json"
MANIFEST_NAME = "manifest.json"


def staging_dir_for(out_dir: Path) -> Path:
    """The hidden sibling a run of ``out_dir`` writes into before the final rename."""
    return out_dir.parent / f".{out_dir.name}.partial"


def sha256_file(path: Path, chunk_bytes: int = 4 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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
        # callers that read the backend from this very block pass what they found: "None"
        flag = f"--backend {backend}`" if backend in ("te", "ao") else "--backend ao` (torchao runs on a CPU)"
        raise ArtifactError(f"{directory} is a plain model, not an fp8forge artifact (its config.json has no fp8 "
                            f"block): convert it first, e.g. `fp8forge convert {directory} --out DIR {flag}, then "
                            "point at DIR")
    if block.get("backend") != backend:
        raise ArtifactError(f"{directory} is an fp8forge artifact for backend {block.get('backend')!r}, not "
                            f"{backend}; load it with load_{block.get('backend')}()")
    return block
