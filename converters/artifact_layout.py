"""The files of one artifact: source weights, FP8 state, calibration tensors, config, report.

Layout (all in one directory, listed with checksums in manifest.json):
- the source checkpoint's weight files, copied byte for byte (``model.safetensors``, or its shards and
  ``model.safetensors.index.json``): TE and torchao keep high-precision weights, so the files keep the
  source's own tensor names, and a plain ``from_pretrained`` loads them as it loads the source.
- ``fp8_state.safetensors`` (TE delayed scaling, the one recipe with state): each converted layer's scaling state
  under the keys of :mod:`converters.te_layout`, keyed by the layer's module path in the loaded model. Stateless
  recipes (current scaling, block scaling, MXFP8, NVFP4, every torchao recipe) have none.
- ``fp8_calibration.safetensors``: per layer ``<path>.amax_forward [steps, 3]`` (input, weight, output),
  ``<path>.amax_backward [steps, 2]`` when gradients were recorded, and for per-tensor and rowwise dynamic
  recipes ``<path>.scale_fwd_per_step [steps, 3]`` (a per-tensor E4M3 scale says nothing of block-scaled casts).
- ``config.json``: the model's own config plus an ``fp8`` block (backend, the full recipe, converted modules, and
  what the format adds: TE's recipe class and arguments, torchao's config).
- ``fp8_report.json``: analysis, pipeline mode, calibration statistics, final scales, data source, warnings.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from converters.analysis import converted_expert_gemms
from converters.artifact_io import copy_weight_files, save_tensors, write_json
from converters.recipe_requirements import requirements
from converters.te_layout import BACKWARD_SLOTS, FORWARD_SLOTS

if TYPE_CHECKING:
    from converters.pipeline import _Run

__all__ = [
    "FP8_BLOCK_VERSION",
    "STATE_FILE",
    "CALIBRATION_FILE",
    "REPORT_FILE",
    "write_weight_files",
    "write_state_file",
    "write_calibration_file",
    "write_json_files",
    "versions",
]

# Version 2: the weights are the source's files, untouched; the TE state lives in its own file.
FP8_BLOCK_VERSION = 2
STATE_FILE = "fp8_state.safetensors"
CALIBRATION_FILE = "fp8_calibration.safetensors"
REPORT_FILE = "fp8_report.json"


def versions(backend: str) -> dict[str, str]:
    import safetensors
    import transformers

    from converters import __version__
    from converters.formats import training_format

    return {
        "fp8forge": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
        **training_format(backend).library_versions(),
    }


def write_weight_files(run: _Run, staging: Path) -> list[str]:
    """Copy the source's weight files: the weights do not change, so they are never decoded."""
    from converters.checkpoint import weight_files
    from converters.model_sources import confinement_for

    return copy_weight_files(weight_files(run.model_dir), staging, confinement_for(run.sources))


def write_state_file(run: _Run, staging: Path) -> list[str]:
    """``fp8_state.safetensors`` for recipes that carry state (TE delayed scaling); nothing otherwise."""
    from converters.formats import training_format

    tensors = training_format(run.recipe.backend.value).state_tensors(run)
    if not tensors:
        return []
    metadata = {
        "format": "pt",
        "fp8_backend": run.recipe.backend.value,
        "fp8_recipe": json.dumps(run.recipe.to_dict(), sort_keys=True),
        "te_state_key_scheme": "converters.te_layout v1: <layer>.fp8_{scale,amax_history}_{fwd,bwd}",
        **{f"version_{name}": value for name, value in versions(run.recipe.backend.value).items()},
    }
    save_tensors(tensors, staging / STATE_FILE, metadata)
    return [STATE_FILE]


def _block_scaled(run: _Run) -> bool:
    """Whether the recipe's forward casts are block-scaled (MXFP8, NVFP4, FP8 blocks): no per-tensor scale applies."""
    return any("block" in spec for spec in run.recipe.cast_formats().values())


def write_calibration_file(run: _Run, staging: Path) -> list[str]:
    tensors = {}
    for path, layer in run.calibration.amax.items():
        tensors[f"{path}.amax_forward"] = layer.forward.float()
        if layer.backward is not None:
            tensors[f"{path}.amax_backward"] = layer.backward.float()
        per_step = run.calibration.states.get(path, {}).get("scale_fwd_per_step")
        if per_step is not None and not _block_scaled(run):
            tensors[f"{path}.scale_fwd_per_step"] = per_step.float()
    save_tensors(tensors, staging / CALIBRATION_FILE, {"format": "pt", "fp8_calibration": "amax per step"})
    return [CALIBRATION_FILE]


def fp8_block(run: _Run) -> dict[str, Any]:
    """The ``fp8`` block of config.json: enough to replay or load the conversion."""
    block = {
        "version": FP8_BLOCK_VERSION,
        "backend": run.recipe.backend.value,
        "recipe": run.recipe.to_dict(),
        "converted_modules": list(run.converted),
        # <experts module>.<gate_up_proj|down_proj>: expert GEMMs converted together (converters.experts)
        "converted_experts": converted_expert_gemms(run.report),
        # Readers of the files see the checkpoint's own names; where one differs from the module path, it is here.
        "converted_weights_on_disk": run.weights_on_disk,
        "tied_weights": run.tied_weights,
    }
    from converters.formats import training_format

    block.update(training_format(block["backend"]).block_fields(run))
    return block


def _calibration_report(run: _Run) -> dict[str, Any]:
    settings = run.request.calibration
    block = _block_scaled(run)
    layers = {}
    for path, layer in run.calibration.amax.items():
        entry = {"amax_forward": layer.forward.tolist()}
        if layer.backward is not None:
            entry["amax_backward"] = layer.backward.tolist()
        entry.update({name: value.tolist() for name, value in run.calibration.states[path].items()
                      if not name.startswith("amax_history") and not (name == "scale_fwd_per_step" and block)})
        layers[path] = entry
    return {
        # what the artifact seeds: "none: <recipe> computes scales from each tensor as it is cast" when stateless
        "state": run.recipe.state_note(),
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "backward": settings.backward,
        "data_source": run.calibration.data_source,
        "slots_forward": list(FORWARD_SLOTS),
        "slots_backward": list(BACKWARD_SLOTS),
        "layers": layers,
        "te_check": run.calibration.te_check,
    }


def write_json_files(run: _Run, staging: Path, written: list[str]) -> list[str]:
    with open(run.model_dir / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    config["fp8"] = fp8_block(run)
    write_json(staging / "config.json", config)
    report = {
        "version": FP8_BLOCK_VERSION,
        "model": run.request.model,
        "backend": run.recipe.backend.value,
        "recipe": run.recipe.to_dict(),
        "request": run.request.to_dict(),
        "versions": versions(run.recipe.backend.value),
        "warnings": run.warnings,
        "stage_seconds": run.stage_seconds,
        "pipeline": run.pipeline,
        "converted_modules": list(run.converted),
        "analysis": run.report,
        "recipe_requirements": requirements(run.recipe),
        "calibration": _calibration_report(run),
        "serving": {name: plan.report() for name, plan in run.serving.items()},
        "files": sorted(written),
    }
    write_json(staging / REPORT_FILE, report)
    return ["config.json", REPORT_FILE]
