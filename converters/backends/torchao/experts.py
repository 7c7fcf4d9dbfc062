"""MoE experts on torchao's low-precision grouped GEMMs, wrapped on the experts' 3-D weights.

torchao 0.18's ``torchao.prototype.moe_training`` wraps a parameter in a ``TrainingWeightWrapperBaseTensor``
(``quantize_`` with its handler ``_moe_training_transform``, here through ``FqnToConfig`` keyed by the parameter
paths ``<experts>.<gate_up_proj|down_proj>`` the artifact records, so a module with only one GEMM converted keeps
the other in high precision). The wrapper intercepts ``torch._grouped_mm`` (``tensor.py``), which transformers
calls only with ``experts_implementation="grouped_mm"``: the eager and batched_mm paths index the weight, which
drops the wrapper, and run in high precision.

Which grouped GEMM: a job whose recipe is ``mxfp8_training_op`` gives its experts that recipe's own
``MXFP8TrainingOpConfig`` (blocks of 32 with E8M0 scales, ``mxfp8_grouped_mm.py``); every other torchao job gives
them ``Float8TrainingOpConfig``, whose grouped GEMM is rowwise FP8 whatever ``float8_linear_recipe`` the Linear
layers use (``fp8_grouped_mm.py``). The artifact records which as ``fp8.experts_config``.

Hardware: the FP8 rowwise path quantizes with Triton kernels and multiplies with ``torch._scaled_grouped_mm``,
which has no CPU kernel and, in torch's own check, runs on "CUDA devices with compute capability = [9.0, 10.0]"
(``aten/src/ATen/native/cuda`` ``_scaled_grouped_mm_cuda``). MXFP8 runs its SM100 kernels (compute capability
10.x) or, with ``kernel_preference`` emulated, native PyTorch anywhere, the CPU included. Elsewhere the experts
stay in high precision and :func:`load_experts` says so. torchao imports are inside the functions.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converters.backends.torchao.config import training_op_config
from converters.backends.torchao.swap import training_op_unavailable
from converters.errors import ConversionError, RecipeError
from converters.model.experts import EXPERT_GEMMS
from converters.recipes import recipe_from_dict

__all__ = ["EXPERTS_CONFIG", "MX_EXPERTS_CONFIG", "ExpertsPrecision", "experts_config_fields",
           "experts_config_from_dict", "fp8_grouped_gemm_unavailable", "grouped_gemm_unavailable",
           "convert_experts_to_torchao", "load_experts"]

logger = logging.getLogger(__name__)

EXPERTS_CONFIG = "Float8TrainingOpConfig"
MX_EXPERTS_CONFIG = "MXFP8TrainingOpConfig"
_GROUPED_MM = "grouped_mm"
_INPUT_DTYPES = ("float32", "bfloat16")  # what torchao's FP8 grouped GEMM accepts (asserted in fp8_grouped_mm.py)
_NEEDS = ("torchao's FP8 grouped GEMM needs CUDA compute capability 9.0 or 10.0 (torch._scaled_grouped_mm) "
          "with triton")


@dataclass(frozen=True, kw_only=True)
class ExpertsPrecision:
    """How a loaded torchao artifact's experts run here (``model.fp8_experts``)."""

    gemms: tuple[str, ...]  #: the artifact's ``converted_experts``
    fp8: bool  #: whether they run torchao's FP8 grouped GEMM here
    note: str  #: what runs in FP8, what in high precision, and why


def experts_config_fields(weight_dtype: torch.dtype, recipe: Any = None) -> dict[str, Any]:
    """The ``experts_config`` recorded in the fp8 block for experts with weights of ``weight_dtype``, converted
    under the job's ``recipe`` (an ``mxfp8_training_op`` recipe gives its own MXFP8 config; any other, FP8 rowwise).

    Raises ConversionError for a dtype torchao's grouped GEMMs do not take (they assert float32 or bfloat16).
    """
    dtype = str(weight_dtype).removeprefix("torch.")
    if dtype not in _INPUT_DTYPES:
        raise ConversionError(f"torchao's FP8 grouped GEMM takes {' or '.join(_INPUT_DTYPES)} expert weights, these "
                              f"are {dtype}: exclude the experts modules, or convert a bfloat16 checkpoint")
    if getattr(recipe, "config_name", None) == MX_EXPERTS_CONFIG:
        return {**recipe.config_fields(), "experts_implementation": _GROUPED_MM}
    # torch._scaled_grouped_mm writes bfloat16 only ("Only bf16 high precision output types are supported")
    return {"config": EXPERTS_CONFIG, "float8_recipe": "rowwise", "float8_dtype": "float8_e4m3fn",
            "out_dtype": "bfloat16", "experts_implementation": _GROUPED_MM}


def experts_config_from_dict(fields: Mapping[str, Any]) -> Any:
    """torchao's ``Float8TrainingOpConfig`` or ``MXFP8TrainingOpConfig`` for a recorded ``experts_config``.

    Raises ConversionError for anything else (an artifact from another fp8forge, or one edited by hand).
    """
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    if isinstance(fields, Mapping) and fields.get("config") == MX_EXPERTS_CONFIG:
        return training_op_config(_mx_recipe(fields))
    if not isinstance(fields, Mapping) or fields.get("config") != EXPERTS_CONFIG \
            or fields.get("float8_recipe") != "rowwise" or fields.get("float8_dtype") != "float8_e4m3fn" \
            or fields.get("out_dtype") != "bfloat16":
        raise ConversionError(f"fp8.experts_config {fields!r} is not a {EXPERTS_CONFIG} with recipe rowwise or an "
                              f"{MX_EXPERTS_CONFIG} this fp8forge can replay; convert the model again")
    return Float8TrainingOpConfig(float8_dtype=getattr(torch, fields["float8_dtype"]),
                                  out_dtype=getattr(torch, fields["out_dtype"]))


def _mx_recipe(fields: Mapping[str, Any]) -> Any:
    """The ``mxfp8_training_op`` recipe whose config an MXFP8 ``experts_config`` records (ConversionError if none)."""
    options = {k: v for k, v in fields.items() if k not in ("config", "out_dtype", "experts_implementation")}
    try:
        recipe = recipe_from_dict({"backend": "ao", "scaling": "mxfp8_training_op", **options})
    except RecipeError as exc:
        raise ConversionError(f"fp8.experts_config {dict(fields)!r} is not an {MX_EXPERTS_CONFIG} this fp8forge can "
                              f"replay ({exc.message}); convert the model again") from exc
    if {**recipe.config_fields(), "experts_implementation": _GROUPED_MM} != dict(fields):
        raise ConversionError(f"fp8.experts_config {dict(fields)!r} is not an {MX_EXPERTS_CONFIG} this fp8forge "
                              "writes; convert the model again")
    return recipe


def grouped_gemm_unavailable(fields: Mapping[str, Any], device: str | torch.device) -> str | None:
    """Why the grouped GEMM an ``experts_config`` records cannot run on ``device`` (None when it can).

    Raises ConversionError for a config this fp8forge does not write.
    """
    if fields.get("config") == MX_EXPERTS_CONFIG:
        recipe = _mx_recipe(fields)
        why = training_op_unavailable(recipe, device)
        return None if why is None else f"{MX_EXPERTS_CONFIG} needs {recipe.hardware().needs}, and {why}"
    why = fp8_grouped_gemm_unavailable(device)
    return None if why is None else f"{_NEEDS}, and {why}"


def fp8_grouped_gemm_unavailable(device: str | torch.device) -> str | None:
    """Why torchao's FP8 rowwise grouped GEMM cannot run on ``device`` (None when it can). Never raises.

    (MXFP8 experts: :func:`grouped_gemm_unavailable`.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the model is on {device.type}"
    if not torch.cuda.is_available():
        return f"no CUDA device is visible to torch {torch.__version__}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"this GPU has compute capability {major}.{minor}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def convert_experts_to_torchao(model: nn.Module, gemm_paths: Sequence[str], config: Any) -> list[str]:
    """Wrap exactly the experts parameters ``gemm_paths`` for torchao's grouped GEMM of ``config``, in place.

    Raises ConversionError when a path is not a 3-D experts parameter, or when the wrapped parameters afterwards
    differ from ``gemm_paths``.
    """
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor
    from torchao.quantization import FqnToConfig, quantize_

    params = dict(model.named_parameters())
    for path in gemm_paths:
        param = params.get(path)
        if path.rpartition(".")[2] not in EXPERT_GEMMS or param is None or param.dim() != 3:
            found = f"a {param.dim()}-D parameter" if param is not None else "no parameter"
            raise ConversionError(f"converted experts GEMM {path!r} is {found} in the loaded model, not a 3-D "
                                  f"experts weight ({'/'.join(EXPERT_GEMMS)})")
    quantize_(model, FqnToConfig({path: config for path in gemm_paths}), filter_fn=None)
    wrapped = [path for path, param in model.named_parameters() if isinstance(param, TrainingWeightWrapperBaseTensor)]
    if sorted(wrapped) != sorted(gemm_paths):
        raise ConversionError(f"torchao wrapped {len(wrapped)} experts weights, {len(gemm_paths)} were listed "
                              f"(unexpected: {sorted(set(wrapped) - set(gemm_paths))[:5]}, not wrapped: "
                              f"{sorted(set(gemm_paths) - set(wrapped))[:5]})")
    logger.info("wrapped %d experts weights for torchao's %s grouped GEMM", len(wrapped), type(config).__name__)
    return list(gemm_paths)


def load_experts(model: nn.Module, gemm_paths: Sequence[str], fields: Mapping[str, Any] | None, *,
                 device: str | torch.device, linear_emulate: bool | None) -> ExpertsPrecision:
    """Replay the artifact's experts conversion on ``model`` (already on ``device``) where torchao can run it.

    Where it cannot (no CUDA, another GPU generation, no triton), the experts stay in high precision, the model
    still trains, and a warning and the returned note say so. ``linear_emulate``: the ``Float8Linear`` layers'
    ``emulate``, or None when a training-op config wraps the Linear weights instead (``model.fp8_linears`` says
    how those run). Raises ConversionError from the swap.
    """
    gemms = tuple(gemm_paths)
    linears = ("the Linear layers: see model.fp8_linears" if linear_emulate is None else
               f"the Float8Linear layers run as recorded (emulate={linear_emulate}; torch 2.13 also runs "
               "torch._scaled_mm on CPU)")
    if not gemms:
        return ExpertsPrecision(gemms=gemms, fp8=False, note=f"the artifact converts no experts; {linears}")
    if fields is None:
        note = (f"experts run in high precision: the artifact records no experts_config (written before fp8forge "
                f"ran torchao experts in FP8; convert again); {linears}")
    elif (why := grouped_gemm_unavailable(fields, device)) is not None:
        note = f"experts run in high precision here: {why}; {linears}"
    else:
        model.set_experts_implementation(fields["experts_implementation"])
        convert_experts_to_torchao(model, gemms, experts_config_from_dict(fields))
        kind = ("MXFP8" + (" (emulated)" if fields.get("kernel_preference") == "emulated" else "")
                if fields["config"] == MX_EXPERTS_CONFIG else "FP8 rowwise")
        return ExpertsPrecision(gemms=gemms, fp8=True, note=f"experts run torchao's {kind} grouped GEMM "
                                                            f"(experts_implementation=grouped_mm); {linears}")
    logger.warning("%s", note)
    return ExpertsPrecision(gemms=gemms, fp8=False, note=note)
