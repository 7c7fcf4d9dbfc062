"""What a recipe asks of a model and of a GPU: its Linear shape rule, the compute capability it runs on, its casts.

Details, and the library sources they follow: README.md beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from converters.analysis.reasons import Reason
from converters.errors import BackendUnavailableError

__all__ = [
    "CAST_FORMATS",
    "ShapeRule",
    "Hardware",
    "FP8_RULE",
    "MXFP8_RULE",
    "TORCHAO_MXFP8_RULE",
    "FP8_BLOCK_RULE",
    "NVFP4_RULE",
    "FP8_GPU",
    "MXFP8_GPU",
    "FP8_BLOCK_GPU",
    "FP8_BLOCK_F32_SCALES_GPU",
    "NVFP4_GPU",
    "TORCH_FP8_GPU",
    "TORCHAO_MXFP8_GPU",
    "ANY_DEVICE",
    "stateless_note",
    "requirements",
    "hardware_unmet_here",
    "require_recipe_hardware",
]

#: Spec names of the casts a recipe makes, for ``cast_formats()`` and the SQNR emulation. Agreed names first;
#: the last two are the 2-D weight blocks of NVFP4 (its default: ``fp4_2d_quantization`` for weights) and of
#: MXFP8 with ``enable_2d_quantization``.
CAST_FORMATS = {
    "e4m3_tensor": "E4M3, one fp32 scale per tensor",
    "e5m2_tensor": "E5M2, one fp32 scale per tensor",
    "e4m3_row": "E4M3, one fp32 scale per row (per token for inputs, per output channel for weights)",
    "e4m3_block_1x128": "E4M3, one fp32 scale per 1x128 block along the row",
    "e4m3_block_128x128": "E4M3, one fp32 scale per 128x128 block",
    "mxfp8_e4m3_block32": "E4M3, one E8M0 (power-of-two) scale per 32 values along the row",
    "nvfp4_block16": "FP4 E2M1, one E4M3 scale per 16 values along the row, times one fp32 scale per tensor",
    "nvfp4_block16x16": "FP4 E2M1, one E4M3 scale per 16x16 block, times one fp32 scale per tensor",
    "mxfp8_e4m3_block32x32": "E4M3, one E8M0 scale per 32x32 block",
}


@dataclass(frozen=True, kw_only=True)
class ShapeRule:
    """Both dims of a Linear (or an expert GEMM) must be multiples of ``multiple``; ``reason`` when they are not."""

    multiple: int
    reason: str  #: the report's reason code (``converters.analysis.eligibility.Reason``)
    source: str  #: where the library states it

    def fails(self, in_features: int, out_features: int) -> bool:
        return bool(in_features % self.multiple or out_features % self.multiple)

    def describe(self) -> str:
        return f"both Linear dims divisible by {self.multiple}"

    def to_dict(self) -> dict[str, Any]:
        return {"multiple": self.multiple, "reason": self.reason, "rule": self.describe(), "source": self.source}


FP8_RULE = ShapeRule(multiple=16, reason=Reason.DIM_NOT_DIVISIBLE.value,
                     source="TE pytorch/utils.py assert_dim_for_fp8_exec (last dim % 16); cuBLASLt FP8 GEMM "
                            "leading dims % 16 (common/gemm/cublaslt_gemm.cu); torch._scaled_mm dims % 16")
MXFP8_RULE = ShapeRule(multiple=32, reason=Reason.DIM_NOT_DIVISIBLE_MXFP8.value,
                       source="TE MXFP8_BLOCK_SCALING_SIZE = 32 (pytorch/constants.py), MXFP8Quantizer.is_quantizable "
                              "(pytorch/tensor/mxfp8_tensor.py), get_align_size_for_quantization -> 32")
TORCHAO_MXFP8_RULE = ShapeRule(multiple=32, reason=Reason.DIM_NOT_DIVISIBLE_MXFP8.value,
                               source="torchao prototype/moe_training/mxfp8_linear.py block_size = 32 (MXFP8 scales "
                                      "per 32 values along K for input, weight and grad_output)")
FP8_BLOCK_RULE = ShapeRule(multiple=128, reason=Reason.DIM_NOT_DIVISIBLE_FP8_BLOCK.value,
                           source="TE Float8BlockQuantizer.block_len = 128 and is_quantizable "
                                  "(pytorch/tensor/float8_blockwise_tensor.py); tests/pytorch/test_fusible_ops.py "
                                  "skips fp8_block_scaling below 128 (get_align_size_for_quantization says 16: "
                                  "grouped token padding only)")
NVFP4_RULE = ShapeRule(multiple=128, reason=Reason.DIM_NOT_DIVISIBLE_NVFP4.value,
                       source="TE get_align_size_for_quantization -> 128 for NVFP4 (pytorch/quantization.py); "
                              "NVFP4 transposing cast needs % 32, GEMM-swizzled scales % 128 "
                              "(common/cast/nvfp4/quantize_transpose_nvfp4.cuh)")


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The GPUs a recipe's low-precision GEMMs run on. ``min_capability`` None: no GPU needed (emulated)."""

    needs: str  #: in words, for messages and the report
    source: str
    min_capability: tuple[int, int] | None = None
    below_capability: tuple[int, int] | None = None  #: first compute capability it does not run on (yet)
    min_cuda: tuple[int, int] | None = None  #: CUDA toolkit of the torch build
    runs_on_cpu: bool = False  #: the library also runs it (unemulated) on the CPU
    needs_triton: bool = False  #: its casts are triton kernels

    def unmet(self, capability: tuple[int, int], cuda: str | None) -> str | None:
        """Why a GPU of ``capability`` with torch built for CUDA ``cuda`` cannot run the recipe; None if it can."""
        if self.min_capability is not None and tuple(capability) < self.min_capability:
            return f"it needs compute capability {_cc(self.min_capability)} or newer"
        if self.below_capability is not None and tuple(capability) >= self.below_capability:
            return f"it does not run on compute capability {_cc(self.below_capability)} or newer"
        if self.min_cuda is not None and cuda:
            version = tuple(int(part) for part in cuda.split(".")[:2] if part.isdigit())
            if version < self.min_cuda:
                return f"it needs CUDA {_cc(self.min_cuda)} or newer (torch is built for CUDA {cuda})"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "needs": self.needs,
            "min_compute_capability": _cc(self.min_capability) if self.min_capability else None,
            "below_compute_capability": _cc(self.below_capability) if self.below_capability else None,
            "min_cuda": _cc(self.min_cuda) if self.min_cuda else None,
            "runs_on_cpu": self.runs_on_cpu or self.min_capability is None,
            "source": self.source,
        }


FP8_GPU = Hardware(min_capability=(8, 9), needs="compute capability 8.9 or newer (Ada, Hopper, Blackwell)",
                   source="TE pytorch/quantization.py _compute_fp8_support (check_fp8_support); on 8.9 also CUDA "
                          ">= 12.1 and cuBLASLt >= 12.1.3")
MXFP8_GPU = Hardware(min_capability=(10, 0), below_capability=(12, 0),
                     needs="compute capability 10.x or 11.x (Blackwell data-center GPUs); TE does not run MXFP8 on "
                           "12.x yet",
                     source="TE pytorch/quantization.py _compute_mxfp8_support (check_mxfp8_support)")
FP8_BLOCK_GPU = Hardware(min_capability=(9, 0), min_cuda=(12, 9),
                         needs="compute capability 9.0 or newer with CUDA 12.9+ (TE emulates it with MXFP8 GEMMs on "
                               "10.0+; TE 2.5-2.8 run it on 9.x only)",
                         source="TE pytorch/quantization.py _compute_fp8_block_scaling_support "
                                "(check_fp8_block_scaling_support)")
FP8_BLOCK_F32_SCALES_GPU = Hardware(
    min_capability=(9, 0), below_capability=(10, 0), min_cuda=(12, 9),
    needs="compute capability 9.x (Hopper) with CUDA 12.9+: fp32 block scales (use_f32_scales) do not run on 10.0+, "
          "where TE emulates block scaling with MXFP8 and needs power-of-two scales",
    source="TE common/transpose/quantize_transpose_{square,vector}_blockwise.cu NVTE_CHECK(pow_2_scale) on sm_arch "
           ">= 100; _compute_fp8_block_scaling_support")
NVFP4_GPU = Hardware(min_capability=(10, 0), needs="compute capability 10.0 or newer (Blackwell)",
                     source="TE pytorch/quantization.py _compute_nvfp4_support (check_nvfp4_support)")
TORCH_FP8_GPU = Hardware(min_capability=(8, 9), runs_on_cpu=True,
                         needs="compute capability 8.9 or newer for torch._scaled_mm FP8 (tensorwise and rowwise "
                               "kernels for 8.9, 9.x, 10.x); torch 2.13 also runs it on the CPU",
                         source="PyTorch aten/src/ATen/native/cuda/RowwiseScaledMM.cu (sm89, sm9x, sm10x); torchao "
                                "float8 docs")
TORCHAO_MXFP8_GPU = Hardware(min_capability=(10, 0), needs_triton=True,
                             needs="compute capability 10.0 or newer (Blackwell) with triton and torchao's CUDA "
                                   "kernels; kernel_preference emulated runs anywhere",
                             source="torchao prototype/moe_training/config.py MXFP8TrainingOpConfig (AUTO: CUDA/Triton "
                                    "casts, MXFP8 GEMMs; EMULATED for non-SM100 machines)")
ANY_DEVICE = Hardware(needs="none: emulated (dequantized GEMMs), runs on the CPU or any GPU",
                      source="torchao emulate / KernelPreference.EMULATED")


def stateless_note(library_class: str) -> str:
    """The calibration-state line of a recipe that scales from the tensor being cast."""
    return f"none: {library_class} computes scales from each tensor as it is cast"


def requirements(recipe: Any) -> dict[str, Any]:
    """What ``recipe`` needs and does, for the analysis report (``report["recipe_requirements"]``)."""
    return {
        "recipe": f"{recipe.backend.value}/{recipe.scaling.value}",
        "library_class": recipe.library_class,
        "shape_rule": recipe.shape_rule().to_dict(),
        "hardware": recipe.hardware().to_dict(),
        "state": recipe.state_note(),
        "cast_formats": recipe.cast_formats(),
    }


def hardware_unmet_here(recipe: Any) -> str | None:
    """Why the CUDA GPU of this process cannot run ``recipe`` (None on a CPU-only machine or when it can).

    Reads only torch's view of the device; TE's own check, where TE imports, is
    :func:`converters.backends.te.runtime.te_recipe_unsupported`.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    why = recipe.hardware().unmet(capability, torch.version.cuda)
    if why is None:
        return None
    return (f"{torch.cuda.get_device_name()} (compute capability {_cc(capability)}) cannot run {recipe.library_class}: "
            f"{why}")


def require_recipe_hardware(recipe: Any) -> None:
    """Raise BackendUnavailableError (field ``recipe``) when this CUDA GPU cannot run ``recipe``.

    A CPU-only machine passes: it writes the artifact without running the recipe (the caller warns).
    """
    why = hardware_unmet_here(recipe)
    if why is not None:
        raise BackendUnavailableError(f"{why}; run the job on a worker whose GPU has {recipe.hardware().needs}",
                                      field="recipe")
