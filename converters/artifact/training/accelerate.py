"""Accelerate ``config.yaml`` for an artifact's recipe, where Accelerate can express it.

Accelerate 1.15 (``accelerate/commands/launch.py`` copies each ``fp8_config`` key to ``args.fp8_<key>``;
``utils/launch.py`` ``setup_fp8_env`` exports it as ``ACCELERATE_FP8_<KEY>``; ``utils/dataclasses.py``
``TERecipeKwargs`` / ``AORecipeKwargs`` read those variables) builds only TE ``DelayedScaling``, TE
``MXFP8BlockScaling`` (``use_mxfp8_block_scaling``) and torchao's default ``Float8LinearConfig`` (tensorwise, with
``pad_inner_dim`` and ``enable_fsdp_float8_all_gather``). It has no key for per-layer choices: its torchao path
keeps the first and last Linear and any Linear with a dimension not divisible by 16 in high precision, its TE path
converts every Linear whose dimensions divide by 16. The file says where that differs from the artifact.
"""

from __future__ import annotations

from typing import Any

import yaml

from converters.artifact.training.decisions import LinearDecision, TrainingDecisions
from converters.recipes import AORecipeName, TEDelayedScalingRecipe, TEMXFP8BlockScalingRecipe, TorchAORecipe

__all__ = ["accelerate_config", "accelerate_unsupported", "accelerate_selection"]


def accelerate_unsupported(decisions: TrainingDecisions) -> str | None:
    """Why Accelerate cannot run the artifact's recipe (None when it can)."""
    recipe = decisions.recipe
    if isinstance(recipe, (TEDelayedScalingRecipe, TEMXFP8BlockScalingRecipe)):
        return None
    if isinstance(recipe, TorchAORecipe) and recipe.recipe_name is AORecipeName.TENSORWISE:
        return None
    return (f"Accelerate builds only TE DelayedScaling, TE MXFP8BlockScaling and torchao's tensorwise "
            f"Float8LinearConfig; this artifact's recipe is {recipe.library_class}")


def accelerate_selection(decisions: TrainingDecisions) -> set[str]:
    """The Linears Accelerate's own conversion would put in FP8 (its rules in the module docstring)."""
    divisible = [linear for linear in decisions.linears
                 if linear.in_features % 16 == 0 and linear.out_features % 16 == 0]
    if decisions.recipe.backend.value == "te":
        return {linear.path for linear in divisible}
    ends = {decisions.linears[0].path, decisions.linears[-1].path} if decisions.linears else set()
    return {linear.path for linear in divisible if linear.path not in ends}


def _fp8_config(decisions: TrainingDecisions) -> dict[str, Any]:
    recipe = decisions.recipe
    if isinstance(recipe, TorchAORecipe):
        return {"backend": "AO", "pad_inner_dim": recipe.pad_inner_dim,
                "enable_fsdp_float8_all_gather": recipe.enable_fsdp_float8_all_gather}
    if isinstance(recipe, TEMXFP8BlockScalingRecipe):
        return {"backend": "TE", "use_mxfp8_block_scaling": True, "fp8_format": recipe.fp8_format.value,
                "margin": recipe.margin}
    return {"backend": "TE", "use_mxfp8_block_scaling": False, "fp8_format": recipe.fp8_format.value,
            "amax_history_len": recipe.amax_history_len, "amax_compute_algo": recipe.amax_compute_algo.value,
            "margin": recipe.margin, "use_autocast_during_eval": recipe.use_autocast_during_eval}


def accelerate_config(decisions: TrainingDecisions) -> str | None:
    """The ``config.yaml`` text (comments first), or None where Accelerate cannot express the recipe."""
    if accelerate_unsupported(decisions) is not None:
        return None
    document = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_processes": 1,
                "mixed_precision": "fp8", "fp8_config": _fp8_config(decisions)}
    return "".join(f"# {line}\n" if line else "#\n" for line in _comments(decisions)) + yaml.safe_dump(
        document, sort_keys=False)


def _comments(decisions: TrainingDecisions) -> list[str]:
    ours = {linear.path for linear in decisions.linears if linear.fp8}
    theirs = accelerate_selection(decisions)
    lines = [f"Accelerate config for {decisions.recipe.library_class}, written by fp8forge from this artifact's "
             "recipe.",
             "Use it to train the source checkpoint with Accelerate's own FP8 conversion (accelerate launch",
             "--config_file accelerate_config.yaml train.py). Accelerate has no per-layer key: "
             + ("its TE path converts every Linear whose dimensions divide by 16."
                if decisions.recipe.backend.value == "te" else
                "its torchao path keeps the first and last Linear and any Linear with a dimension not divisible "
                "by 16 in high precision."),
             "Not expressible here, so not applied by Accelerate:"]
    lines += [f"  Accelerate converts {path}, which the artifact keeps in high precision "
              f"({', '.join(_reasons(decisions, path))})" for path in sorted(theirs - ours)]
    lines += [f"  Accelerate keeps {path} in high precision; the artifact trains it in FP8" for path in
              sorted(ours - theirs)]
    if theirs == ours:
        lines.append("  nothing: Accelerate's own layer choice equals the artifact's")
    lines.append("To train exactly the artifact's layers, load it with load_torchao()/load_te() (train_one_step.py).")
    return lines


def _reasons(decisions: TrainingDecisions, path: str) -> tuple[str, ...]:
    found: LinearDecision = next(linear for linear in decisions.linears if linear.path == path)
    return found.reasons or ("excluded",)
