"""torchao training artifacts: the source's weights plus the conversion to replay.

torchao scales dynamically (no amax history), so the artifact carries no FP8 state: config.json's ``fp8``
block holds the ``Float8LinearConfig`` (``float8_linear_config``) or the ``quantize_`` training config
(``training_op_config``: ``Float8TrainingOpConfig`` / ``MXFP8TrainingOpConfig``) and the converted layers, and
:meth:`load` swaps (or wraps) exactly those; a training config the loading device cannot run leaves the layers in
high precision, and ``model.fp8_linears`` says so. MoE
experts GEMMs (``converted_experts``) get torchao's grouped GEMM (``fp8.experts_config``: the job's own
``MXFP8TrainingOpConfig`` for an ``mxfp8_training_op`` recipe, ``Float8TrainingOpConfig`` rowwise otherwise) where
it runs (see :mod:`converters.backends.torchao.experts`); elsewhere the loaded experts stay in high precision and
``model.fp8_experts`` says so.
In layer-sequential mode the swaps run on the meta-device model, which checks that every eligible layer
converts without holding any weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from converters.analysis.eligibility import converted_expert_gemms
from converters.artifact.layout import read_fp8_block
from converters.backends.base import ConversionTargets, Converted, LayerCheck
from converters.backends.torchao.config import (
    float8_config_dict,
    float8_linear_config,
    float8_linear_config_from_dict,
    training_op_config,
    training_op_config_from_dict,
)
from converters.backends.torchao.experts import (
    convert_experts_to_torchao,
    experts_config_fields,
    experts_config_from_dict,
    load_experts,
)
from converters.backends.torchao.swap import (
    convert_to_torchao,
    convert_to_training_op,
    load_training_op,
    torchao_version,
)
from converters.errors import ArtifactError, RecipeError
from converters.model.sources import ModelSourceOptions, load_model
from converters.recipes import Backend, recipe_from_dict
from converters.recipes.registry import recipes_of
from converters.recipes.requirements import require_recipe_hardware

if TYPE_CHECKING:
    from torch import nn

    from converters.calibration.result import CalibrationResult
    from converters.recipes import Recipe

__all__ = ["TorchAOBackend", "TORCHAO"]


class TorchAOBackend:
    name = "ao"
    recipe_types = recipes_of(Backend.AO)

    def preflight(self, recipe: Recipe) -> list[str]:
        """Fail before any work when this CUDA GPU cannot run the recipe; on a CPU worker, warn when the recipe
        does not run on the CPU either (the artifact is written all the same).

        Raises BackendUnavailableError naming the GPU, what it lacks and the GPUs that run the recipe.
        """
        require_recipe_hardware(recipe)
        hardware = recipe.hardware()
        if not torch.cuda.is_available() and hardware.min_capability is not None and not hardware.runs_on_cpu:
            return [f"{recipe.library_class} does not run on this CPU-only worker; the artifact is complete: "
                    f"its layers train with it on {hardware.needs}, and load in high precision elsewhere"]
        return []

    def layer_check(self, recipe: Recipe) -> LayerCheck:
        return LayerCheck(None)

    def convert(self, targets: ConversionTargets, calibration: CalibrationResult) -> Converted:
        gemms = converted_expert_gemms(targets.report)
        if gemms:  # a check that the recorded experts config applies to exactly these weights (before any Linear
            # weight is wrapped by a training config: the experts check counts every wrapped parameter)
            convert_experts_to_torchao(targets.model, gemms,
                                       experts_config_from_dict(_experts_fields(targets.recipe, targets.model, gemms)))
        if targets.recipe.training_op:
            modules = convert_to_training_op(targets.model, list(targets.eligible), training_op_config(targets.recipe))
        else:
            modules = convert_to_torchao(targets.model, list(targets.eligible), float8_linear_config(targets.recipe))
        return Converted(modules=modules)

    def state_tensors(self, targets: ConversionTargets, converted: Converted,
                      calibration: CalibrationResult) -> dict[str, Any]:
        return {}

    def block_fields(self, targets: ConversionTargets, converted: Converted) -> dict[str, Any]:
        fields: dict[str, Any] = {"state": targets.recipe.state_note()}
        if targets.recipe.training_op:
            fields["training_op_config"] = targets.recipe.config_fields()
        else:
            fields["float8_linear_config"] = float8_config_dict(targets.recipe)
        gemms = converted_expert_gemms(targets.report)
        if gemms:
            fields["experts_config"] = _experts_fields(targets.recipe, targets.model, gemms)
        return fields

    def library_versions(self) -> dict[str, str]:
        return {"torchao": torchao_version()}

    def load(self, directory: Path, *, device: str) -> Any:
        block = read_fp8_block(directory, self.name)
        experts = block.get("converted_experts", [])
        if "training_op_config" in block:
            recipe, config = _recorded_training_op(directory, block)
            model = load_model(directory, ModelSourceOptions(allowed_roots=(directory,)))
            model.to(device)
            # experts first: their wrapping checks every wrapped parameter, the Linear weights' included
            model.fp8_experts = load_experts(model, experts, block.get("experts_config"), device=device,
                                             linear_emulate=None)
            model.fp8_linears = load_training_op(model, block["converted_modules"], recipe, config, device=device)
        else:
            float8_config = float8_linear_config_from_dict(block["float8_linear_config"])
            model = load_model(directory, ModelSourceOptions(allowed_roots=(directory,)))
            convert_to_torchao(model, block["converted_modules"], float8_config)
            model.to(device)
            model.fp8_experts = load_experts(model, experts, block.get("experts_config"), device=device,
                                             linear_emulate=float8_config.emulate)
        model.train()
        return model


def _recorded_training_op(directory: Path, block: dict[str, Any]) -> tuple[Any, Any]:
    """The artifact's training-op recipe and torchao config; they must agree (ArtifactError otherwise)."""

    try:
        recipe = recipe_from_dict(block.get("recipe"))
    except RecipeError as exc:
        raise RecipeError(f"{directory}: fp8.recipe: {exc.message}", field=exc.field) from exc
    if not recipe.training_op or recipe.config_fields() != block["training_op_config"]:
        raise ArtifactError(f"{directory}: fp8.training_op_config does not match fp8.recipe; the artifact was "
                            "edited: convert the model again")
    return recipe, training_op_config_from_dict(block["training_op_config"])


def _experts_fields(recipe: Recipe, model: nn.Module, gemms: list[str]) -> dict[str, Any]:
    param = model.get_parameter(gemms[0])
    return experts_config_fields(getattr(param, "dtype", None), recipe)


TORCHAO = TorchAOBackend()
