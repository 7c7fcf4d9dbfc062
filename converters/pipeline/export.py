"""The export stage's writers: the files of one artifact (names and layout in :mod:`converters.artifact.layout`)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

from converters._version import __version__
from converters.analysis.eligibility import converted_expert_gemms
from converters.artifact.files import copy_weight_files, save_tensors, write_json
from converters.artifact.layout import CALIBRATION_FILE, FP8_BLOCK_VERSION, REPORT_FILE, STATE_FILE
from converters.artifact.training import write_training_configs
from converters.backends import backend_named
from converters.calibration.amax import BACKWARD_SLOTS, FORWARD_SLOTS
from converters.calibration.result import amax_swing
from converters.model.checkpoint import weight_files
from converters.model.files import read_model_text
from converters.model.quantized.stored import write_dequantized_files
from converters.model.sources import confinement_for
from converters.pipeline.state import Run
from converters.recipes.requirements import requirements

__all__ = [
    "write_weight_files",
    "write_state_file",
    "write_calibration_file",
    "write_json_files",
    "versions",
]

def versions(backend: str) -> dict[str, str]:
    import safetensors
    import transformers


    return {
        "fp8forge": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
        **backend_named(backend).library_versions(),
    }


def write_weight_files(run: Run, staging: Path) -> list[str]:
    """Copy the source's weight files: the weights do not change, so they are never decoded. The driver started
    the copy when resolve found them (``run.weight_copy``); this waits for it."""
    if run.weight_copy is not None:
        return run.weight_copy.result()
    checkpoint = run.resolved.checkpoint
    if checkpoint.stored is not None:  # a quantized source: its weights dequantized (converters.model.quantized)
        return write_dequantized_files(weight_files(run.resolved.directory), staging, checkpoint.stored,
                                       checkpoint.dtype, digests=run.digests)
    return copy_weight_files(weight_files(run.resolved.directory), staging, confinement_for(run.sources))


def write_state_file(run: Run, staging: Path) -> list[str]:
    """``fp8_state.safetensors`` for recipes that carry state (TE delayed scaling); nothing otherwise."""

    tensors = run.backend.state_tensors(run.targets, run.conversion, run.calibration)
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



def write_calibration_file(run: Run, staging: Path) -> list[str]:
    tensors = {}
    for path, layer in run.calibration.amax.items():
        tensors[f"{path}.amax_forward"] = layer.forward.float()
        if layer.backward is not None:
            tensors[f"{path}.amax_backward"] = layer.backward.float()
        per_step = run.calibration.states.get(path, {}).get("scale_fwd_per_step")
        if per_step is not None and not run.recipe.block_scaled():
            tensors[f"{path}.scale_fwd_per_step"] = per_step.float()
    save_tensors(tensors, staging / CALIBRATION_FILE, {"format": "pt", "fp8_calibration": "amax per step"})
    return [CALIBRATION_FILE]


def fp8_block(run: Run) -> dict[str, Any]:
    """The ``fp8`` block of config.json: enough to replay or load the conversion."""
    block = {
        "version": FP8_BLOCK_VERSION,
        "backend": run.recipe.backend.value,
        "recipe": run.recipe.to_dict(),
        "converted_modules": list(run.conversion.modules),
        # <experts module>.<gate_up_proj|down_proj>: expert GEMMs converted together (converters.model.experts)
        "converted_experts": converted_expert_gemms(run.report),
        # Readers of the files see the checkpoint's own names; where one differs from the module path, it is here.
        "converted_weights_on_disk": run.weights_on_disk,
        "tied_weights": run.resolved.tied_weights,
    }
    if run.resolved.checkpoint.stored is not None:  # what the source's weights were dequantized from
        block["dequantized_from"] = run.resolved.checkpoint.stored.quantization.describe()
    block.update(run.backend.block_fields(run.targets, run.conversion))
    return block


def _calibration_report(run: Run) -> dict[str, Any]:
    settings = run.request.calibration
    block = run.recipe.block_scaled()
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
        "forward": run.calibration.forward,
        # the NVFP4 exports' GPTQ rounding, run in this walk (converters.calibration.gptq_rounding), where asked
        **({"nvfp4_rounding": run.calibration.rounding} if run.calibration.rounding else {}),
        # the smoothing the job ran on its source first (converters.pipeline.source_smoothing), where asked
        **({"nvfp4_smoothing": run.calibration.smoothing} if run.calibration.smoothing else {}),
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "backward": settings.backward,
        "data_source": run.calibration.data_source,
        "slots_forward": list(FORWARD_SLOTS),
        "slots_backward": list(BACKWARD_SLOTS),
        "layers": layers,
        "te_check": run.te_check,
    }


def write_json_files(run: Run, staging: Path, written: list[str]) -> list[str]:
    config = json.loads(read_model_text(run.resolved.directory / "config.json", confinement_for(run.sources)))
    stored = run.resolved.checkpoint.stored
    if stored is not None:  # the weight files hold the dequantized weights: no quantization applies to them
        config.pop("quantization_config", None)
        config.pop("compression_config", None)
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
        "converted_modules": list(run.conversion.modules),
        "analysis": run.report,
        "recipe_requirements": requirements(run.recipe),
        "calibration": _calibration_report(run),
        "amax_swing": amax_swing(run.calibration.amax, stateless=not run.recipe.stateful),
        "plan": run.plan_block,  # the plan stage's (None without a plan in the request)
        "quality": run.quality,
        "serving": {name: selection.report() for name, selection in run.serving.items()},
        "files": sorted(written),
    }
    write_json(staging / REPORT_FILE, report)
    return ["config.json", REPORT_FILE, *write_training_configs(staging)]  # training/: read back from both
