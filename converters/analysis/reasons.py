"""The reason codes of the analysis report, defined once: the rules, the recipes' shape rules and the serving
formats all use these members."""

from __future__ import annotations

import enum

__all__ = ["Reason"]


class Reason(str, enum.Enum):
    """Reason codes a layer carries when it is not eligible (stable strings, documented in docs/cli.md)."""

    DIM_NOT_DIVISIBLE = "dim_not_divisible_by_16"
    # Each recipe's own shape rule (converters.recipes.requirements: TE's block sizes and alignments)
    DIM_NOT_DIVISIBLE_MXFP8 = "dim_not_divisible_by_32_for_mxfp8"  #: MXFP8 (TE MXFP8BlockScaling, torchao MXFP8)
    DIM_NOT_DIVISIBLE_FP8_BLOCK = "dim_not_divisible_by_128_for_fp8_block"  #: TE Float8BlockScaling
    DIM_NOT_DIVISIBLE_NVFP4 = "dim_not_divisible_by_128_for_nvfp4"  #: TE NVFP4BlockScaling
    FIRST_LINEAR = "first_linear"
    LAST_LINEAR = "last_linear"
    EXCLUDED = "excluded_by_pattern"
    NOT_INCLUDED = "not_matched_by_include"
    ROUTER_GATE = "moe_router_gate"
    TIED_HEAD = "tied_to_input_embedding"
    NOT_LINEAR = "not_nn_linear"
    FUSED_EXPERTS = "fused_expert_parameter"
    ROUTER_WEIGHT = "router_parameter"
    OTHER_MATMUL = "matmul_weight_outside_linear"
    EXPERT_LAYOUT = "expert_layout_unsupported"
    #: serving format fp8-block: a dim not a multiple of its 128x128 blocks (converters.serving.fp8_block)
    SERVING_BLOCK = "dim_not_divisible_by_128"
    #: serving formats nvfp4, nvfp4-a16, modelopt-nvfp4: in_features not a whole number of 16-element FP4 blocks
    #: (converters.serving.nvfp4)
    SERVING_NVFP4 = "in_features_not_divisible_by_16_for_nvfp4"
    LOW_SQNR = "low_sqnr"  #: output SQNR under the recipe below min_sqnr_db (converters.calibration.sensitivity)
    #: eligible itself, but another member of its fused group (q/k/v, gate/up, an expert's w1/w3) or of its experts
    #: module is not: engines run the group as one GEMM of one scheme. Written with the unit: see :meth:`at`.
    FUSED_GROUP_PARTIAL = "fused_group_not_fully_eligible"
    # Stored tensors a model-free job keeps in high precision, listed apart from the Linear weights
    EMBEDDING = "embedding"  #: an embedding table (a lookup, not a matmul weight)
    NORM = "norm"  #: a norm's scale vector or matrix
    # A training artifact's serving export (converters.sync) writes only what the training run converted
    NOT_CONVERTED_IN_TRAINING = "not_converted_in_training"  #: the artifact keeps this Linear in high precision
    EXPERTS_NOT_SYNCED = "experts_not_synced"  #: expert weights: no training library here converts them
    #: converted in training, but another member of its fused group was not: written with the unit (:meth:`at`)
    FUSED_GROUP_NOT_CONVERTED = "fused_group_not_fully_converted"

    def at(self, unit: str) -> str:
        """The code with the unit it concerns, ``code:unit`` (e.g. the fused group that held a layer back)."""
        return f"{self.value}:{unit}"
