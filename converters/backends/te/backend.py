"""TransformerEngine training artifacts: the source's weights, the recipe, and delayed-scaling state as plain tensors.

Every TE recipe is recorded whole (config.json's ``fp8.recipe`` and ``fp8.te_recipe``: the TE class and the
keyword arguments the loader builds it with). Only ``DelayedScaling`` has state to seed: the other recipes
(current scaling, MXFP8, FP8 block scaling, NVFP4) compute scales from each tensor as they cast it, and their
artifacts hold no ``fp8_state.safetensors``.

On a CUDA worker the GPU must be able to run the recipe (its compute capability, then TE's own check), or the
job fails before TE work with ``backend_unavailable``; :meth:`TEBackend.preflight` is that check. Where TE
runs, eligible layers become ``te.Linear`` and delayed and current scaling are checked in FP8 (each layer right
after its calibration in layer-sequential mode, one step of the whole model otherwise); the block-scaled recipes
are converted without that check (it pads rows to 8 and reads delayed-scaling state: see
``te_layer_check`` / ``te_check_step``). Without CUDA the checkpoint is written from the recorded calibration,
in TE's layout, with a warning, and no TE module is faked.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from converters.artifact.layout import STATE_FILE
from converters.backends.base import ConversionTargets, Converted, LayerCheck
from converters.backends.te.check_step import fp8_check_step
from converters.backends.te.layer_check import (
    LayerChecks,
    reset_te_global_state,
)
from converters.backends.te.layout import grouped_state, state_key
from converters.backends.te.loader import load_te_model
from converters.backends.te.runtime import (
    require_recipe_execution,
    te_missing,
    te_module,
    te_recipe_spec,
    te_status,
)
from converters.backends.te.state import (
    apply_scaling_state,
    te_extra_state_tensor,
)
from converters.backends.te.swap import convert_to_te
from converters.errors import BackendUnavailableError, ConversionError
from converters.model.experts import parse_unit_path
from converters.recipes import Backend
from converters.recipes.registry import recipes_of
from converters.recipes.requirements import require_recipe_hardware

if TYPE_CHECKING:
    from converters.calibration.result import CalibrationResult
    from converters.recipes import Recipe

__all__ = ["TEBackend", "TE"]


class TEBackend:
    name = "te"
    recipe_types = recipes_of(Backend.TE)

    def preflight(self, recipe: Recipe) -> list[str]:
        """Fail before any TE work when this CUDA GPU cannot run the recipe (nothing to check on a CPU worker).

        Raises BackendUnavailableError naming the GPU, what it lacks and the GPUs that run the recipe.
        """
        if not torch.cuda.is_available():
            return []
        if te_status()[0]:
            require_recipe_execution(te_module(), recipe)
        else:
            require_recipe_hardware(recipe)
        return []

    def layer_check(self, recipe: Recipe) -> LayerCheck:
        if not te_status()[0]:
            return LayerCheck(None)
        if not recipe.per_tensor_te:  # fp8forge's FP8 check (layer_check / check_step) runs per-tensor scaling only
            return LayerCheck(None, {"ran": False, "reason": _unchecked_reason(recipe)})
        return LayerCheck(LayerChecks(recipe))

    def convert(self, targets: ConversionTargets, calibration: CalibrationResult) -> Converted:
        available, why = te_status()
        recipe = targets.recipe
        if available and not targets.whole_model and recipe.per_tensor_te:  # swapped and checked as it calibrated
            return Converted(modules=list(targets.eligible), te_modules_built=True)
        if available and not targets.whole_model:  # layer-sequential (never with te_extra_state): nothing to check
            return Converted(modules=list(targets.eligible),
                             warnings=[f"the FP8 check step did not run: {_unchecked_reason(recipe)}"])
        if available:
            return self._convert_whole_model(targets, calibration)
        if targets.te_extra_state:
            raise BackendUnavailableError(
                f"te_extra_state needs TransformerEngine to write its own _extra_state, and {why}; "
                "drop te_extra_state (the plain-tensor state is complete) or run on a CUDA worker with TE"
            )
        # no fake TE modules: the checkpoint is written from the recorded calibration, in TE's layout
        state = ("delayed-scaling state computed from the recorded calibration as TE's own update would"
                 if recipe.stateful else f"no state to seed: {recipe.te_class_name} computes scales from each "
                                         "tensor as it is cast")
        return Converted(modules=list(targets.eligible), warnings=[
            f"TransformerEngine modules were not built here ({'; '.join(te_missing())}), so no FP8 check "
            f"step ran; the TE checkpoint is complete ({state}) and load_te() loads it with "
            f"{recipe.te_class_name} where TE runs it (CUDA, {recipe.hardware().needs})"])

    def _convert_whole_model(self, targets: ConversionTargets, calibration: CalibrationResult) -> Converted:
        recipe = targets.recipe
        modules = convert_to_te(targets.model, list(targets.eligible))
        if not recipe.per_tensor_te:
            reason = _unchecked_reason(recipe)
            return Converted(modules=modules, te_modules_built=True, te_check={"ran": False, "reason": reason},
                             warnings=[f"the FP8 check step did not run: {reason}"])
        if recipe.stateful:
            # experts keep their transformers module for the check step; the artifact's loader builds their
            # GroupedLinear (converters.backends.te.grouped) from the grouped state written at export
            linears = {path: state for path, state in calibration.states.items() if parse_unit_path(path) is None}
            apply_scaling_state(targets.model, linears, recipe)
        try:
            te_check = fp8_check_step(targets.model, calibration.check_batch, recipe)
            warnings = []
        except BackendUnavailableError as exc:  # TE imports, but this GPU cannot execute FP8 (before sm89)
            te_check = {"ran": False, "reason": exc.message}
            warnings = [f"the FP8 check step did not run: {exc.message}"]
        except ConversionError:
            raise
        except Exception as exc:  # TE kernels raise AssertionError/RuntimeError; the job must fail with a message
            raise ConversionError(f"the TransformerEngine FP8 check step failed: {type(exc).__name__}: {exc}") from exc
        finally:
            reset_te_global_state()
        return Converted(modules=modules, te_modules_built=True, te_check=te_check, warnings=warnings)

    def state_tensors(self, targets: ConversionTargets, converted: Converted,
                      calibration: CalibrationResult) -> dict[str, torch.Tensor]:
        tensors = {}
        if targets.recipe.stateful:
            experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
            for path, state in calibration.states.items():
                unit = parse_unit_path(path)
                if unit is None:
                    tensors.update({state_key(path, name): value.float() for name, value in state.items()})
                else:
                    experts.setdefault((unit.module, unit.gemm), {})[unit.index] = state
            tensors.update(_grouped_expert_state(targets.report, experts))
        if targets.te_extra_state and converted.te_modules_built:
            for path in converted.modules:
                tensors[f"{path}._extra_state"] = te_extra_state_tensor(targets.model.get_submodule(path))
        return tensors

    def block_fields(self, targets: ConversionTargets, converted: Converted) -> dict[str, Any]:
        recipe = targets.recipe
        fields: dict[str, Any] = {"te_recipe": te_recipe_spec(recipe), "state": recipe.state_note()}
        if not recipe.stateful:
            return fields | {"te_modules_built": converted.te_modules_built}
        return fields | {"state_file": STATE_FILE,
                "state_keys": "<layer>.fp8_scale_fwd [3], .fp8_amax_history_fwd [L,3], .fp8_scale_bwd [2], "
                              ".fp8_amax_history_bwd [L,2]",
                "expert_state_keys": "<experts>.<gate_up_proj|down_proj>.fp8_scale_fwd [3E], .fp8_amax_history_fwd "
                                     "[L,3E], .fp8_scale_bwd [2E], .fp8_amax_history_bwd [L,2E], in TE GroupedLinear "
                                     "slot order (forward 3e+0/1/2 = expert e input/weight/output)",
                "te_modules_built": converted.te_modules_built}

    def library_versions(self) -> dict[str, str]:
        return {}  # TE is optional; the report's te_check names the version that ran, if any

    def load(self, directory: Path, *, device: str) -> Any:
        return load_te_model(directory, device=device)


def _unchecked_reason(recipe: Recipe) -> str:
    return (f"fp8forge's FP8 check runs delayed and current scaling only; {recipe.te_class_name} was converted "
            "without it (its kernels need rows padded to the recipe's block size)")


def _grouped_expert_state(report: dict[str, Any], experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]]
                          ) -> dict[str, torch.Tensor]:
    """GroupedLinear state per experts module and GEMM; only where every expert of it was calibrated.

    TE applies one recipe to a whole GroupedLinear, so a GEMM kind with some experts excluded stays in high
    precision (the analysis warns about such partly eligible groups).
    """
    sizes = {block["module"]: block["experts"] for block in report["moe"]}
    tensors = {}
    for (module, gemm), by_index in experts.items():
        if len(by_index) != sizes[module]:
            continue
        grouped = grouped_state([by_index[index] for index in range(sizes[module])])
        tensors.update({state_key(f"{module}.{gemm}", name): value.float() for name, value in grouped.items()})
    return tensors


TE = TEBackend()
