"""Megatron-Bridge settings for a TransformerEngine artifact: the ``mixed_precision`` override and the per-module TE
precision file.

Read from Megatron-Bridge (github NVIDIA-NeMo/Megatron-Bridge at 067f987, ``src/megatron/bridge/training/
mixed_precision.py`` ``MixedPrecisionConfig``: ``fp8`` "hybrid"|"e4m3", ``fp8_recipe`` "tensorwise" (TE
``Float8CurrentScaling``) | "delayed" | "mxfp8" | "blockwise", ``fp8_margin``, ``fp8_amax_history_len``,
``fp8_amax_compute_algo``, ``first_last_layers_bf16`` with ``num_layers_at_start_in_bf16`` /
``num_layers_at_end_in_bf16`` (whole transformer blocks), ``fp4`` "e2m1" with ``fp4_recipe`` "nvfp4"; a YAML
override of ``ConfigContainer`` sets dataclass fields by name, ``training/utils/omegaconf_utils.py``) and from
Megatron-Core (``megatron/core/quantization/quant_config.py`` ``RecipeConfig``: ``configs`` + ordered glob
``matchers`` over module paths; ``megatron/core/extensions/transformer_engine.py`` ``TEQuantizationParams``: a
``training_recipe`` of ``{}`` runs the module in BF16), loaded by ``--te-precision-config-file`` /
``load_quantization_recipe``. Module names follow the Megatron-Bridge Llama mapping (``models/llama/
llama_bridge.py``): q/k/v_proj fuse into ``linear_qkv``, gate/up_proj into ``linear_fc1``.
"""

from __future__ import annotations

from typing import Any

import yaml

from converters.artifact.training.decisions import TrainingDecisions, block_index
from converters.recipes import (
    TECurrentScalingRecipe,
    TEDelayedScalingRecipe,
    TEFloat8BlockScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
)

__all__ = ["megatron_mixed_precision", "megatron_precision_file", "MEGATRON_NAMES", "megatron_unsupported"]

#: Hugging Face module (inside ``model.layers.N.``) -> Megatron module (inside ``decoder.layers.N.``)
MEGATRON_NAMES = {"self_attn.q_proj": "self_attention.linear_qkv", "self_attn.k_proj": "self_attention.linear_qkv",
                  "self_attn.v_proj": "self_attention.linear_qkv", "self_attn.o_proj": "self_attention.linear_proj",
                  "mlp.gate_proj": "mlp.linear_fc1", "mlp.up_proj": "mlp.linear_fc1", "mlp.down_proj": "mlp.linear_fc2"}
_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
_RECIPE_NAMES = {TEDelayedScalingRecipe: "delayed", TECurrentScalingRecipe: "tensorwise",
                 TEMXFP8BlockScalingRecipe: "mxfp8", TEFloat8BlockScalingRecipe: "blockwise"}


def megatron_unsupported(decisions: TrainingDecisions) -> str | None:
    """Why no Megatron-Bridge settings are written (None when they are)."""
    if decisions.recipe.backend.value != "te":
        return "Megatron-Bridge trains with TransformerEngine; this is a torchao artifact"
    return None


def megatron_mixed_precision(decisions: TrainingDecisions) -> tuple[dict[str, Any], list[str]]:
    """The ``mixed_precision`` fields and the notes on what they cannot say."""
    recipe, notes = decisions.recipe, []
    if isinstance(recipe, TENVFP4BlockScalingRecipe):
        fields: dict[str, Any] = {"fp4": "e2m1", "fp4_recipe": "nvfp4"}
        notes.append("NVFP4BlockScaling's options (disable_rht, disable_stochastic_rounding, 4over6, ...) have no "
                     "Megatron-Bridge field: Megatron builds NVFP4BlockScaling() with TE's defaults")
    else:
        fields = {"fp8": recipe.fp8_format.value.lower(), "fp8_recipe": _RECIPE_NAMES[type(recipe)]}
        if isinstance(recipe, TEDelayedScalingRecipe):
            fields |= {"fp8_margin": recipe.margin, "fp8_amax_history_len": recipe.amax_history_len,
                       "fp8_amax_compute_algo": recipe.amax_compute_algo.value}
        elif isinstance(recipe, TEFloat8BlockScalingRecipe):
            notes.append("Float8BlockScaling's block dims and scale kind have no Megatron-Bridge field: Megatron uses "
                         "TE's defaults (power-of-two scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"
                         + (", which this artifact's use_f32_scales needs" if recipe.use_f32_scales else "") + ")")
        elif isinstance(recipe, TEMXFP8BlockScalingRecipe) and (recipe.margin or recipe.enable_2d_quantization):
            notes.append("MXFP8BlockScaling's margin / enable_2d_quantization have no Megatron-Bridge field")
    start, end = _bf16_blocks(decisions)
    fields |= {"first_last_layers_bf16": bool(start or end), "num_layers_at_start_in_bf16": start,
               "num_layers_at_end_in_bf16": end}
    return fields, notes


def _bf16_blocks(decisions: TrainingDecisions) -> tuple[int, int]:
    """Leading and trailing decoder blocks whose every Linear stays in high precision."""
    if not decisions.num_blocks:
        return 0, 0
    start = 0
    while start < decisions.num_blocks and decisions.block_all_high_precision(start):
        start += 1
    end = 0
    while end < decisions.num_blocks - start and decisions.block_all_high_precision(decisions.num_blocks - 1 - end):
        end += 1
    return start, end


def megatron_precision_file(decisions: TrainingDecisions) -> tuple[dict[str, Any] | None, list[str]]:
    """The per-module TE precision file (``configs`` + ``matchers``) keeping the artifact's other high-precision
    Linears in BF16, and notes; None when nothing is left to override or the names cannot be mapped."""
    start, end = _bf16_blocks(decisions)
    blocks = decisions.num_blocks or 0
    kept = [linear for linear in decisions.kept_high_precision
            if (index := block_index(linear.path)) is None or start <= index < blocks - end]
    notes: list[str] = []
    if not kept:
        return None, notes
    if decisions.model_type not in _LLAMA_FAMILY:
        notes.append(f"no per-module file: fp8forge maps Hugging Face names to Megatron's for "
                     f"{', '.join(_LLAMA_FAMILY)} models, and this is a {decisions.model_type!r}; keep in BF16 by "
                     "hand: "
                     + ", ".join(linear.path for linear in kept))
        return None, notes
    patterns: dict[str, list[str]] = {}
    for linear in kept:
        index, _, inner = linear.path.partition("layers.")[2].partition(".")
        if linear.path.endswith("lm_head"):
            notes.append("lm_head stays in BF16 in Megatron as well: its output_layer is not a TE module")
            continue
        if not index.isdigit() or inner not in MEGATRON_NAMES:
            notes.append(f"{linear.path} has no Megatron counterpart fp8forge knows; it is not overridden")
            continue
        patterns.setdefault(f"decoder.layers.{index}.{MEGATRON_NAMES[inner]}", []).append(linear.path)
    fp8_paths = {linear.path for linear in decisions.linears if linear.fp8}
    for pattern, members in patterns.items():
        fused = sorted(path for path in fp8_paths if _megatron_name(path) == pattern)
        if fused:
            notes.append(f"{pattern} fuses {', '.join(sorted(members + fused))}: the whole fused GEMM runs in BF16, "
                         f"so {', '.join(fused)} (FP8 in the artifact) runs in BF16 under Megatron too")
    if not patterns:
        return None, notes
    matchers = {f"keep_bf16_{number}": {"config": "bf16", "type": "glob", "pattern": f"*{pattern}", "enabled": True}
                for number, pattern in enumerate(sorted(patterns))}
    return {"configs": {"bf16": {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}},
            "matchers": matchers}, notes


def _megatron_name(path: str) -> str | None:
    index, _, inner = path.partition("layers.")[2].partition(".")
    return f"decoder.layers.{index}.{MEGATRON_NAMES[inner]}" if index.isdigit() and inner in MEGATRON_NAMES else None


def dump_with_comments(document: dict[str, Any], comments: list[str]) -> str:
    """YAML text with ``comments`` as ``#`` lines first."""
    return "".join(f"# {line}\n" for line in comments) + yaml.safe_dump(document, sort_keys=False)
