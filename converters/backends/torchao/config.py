"""torchao configs <-> JSON, so an artifact records the exact config and can replay it: ``Float8LinearConfig``
(the ``Float8Linear`` swap) and the ``quantize_`` training configs ``Float8TrainingOpConfig`` /
``MXFP8TrainingOpConfig``."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from converters.errors import RecipeError
from converters.recipes.base import check_bool

__all__ = ["float8_linear_config", "float8_config_dict", "training_op_config", "float8_config_to_dict",
           "float8_linear_config_from_dict", "training_op_config_from_dict"]


def float8_linear_config(recipe: Any) -> Any:
    """The torchao ``Float8LinearConfig`` a :class:`~converters.recipes.torchao.TorchAORecipe` stands for."""
    from torchao.float8 import Float8LinearConfig  # torchao: the backend's heavy optional library

    base = Float8LinearConfig.from_recipe_name(recipe.recipe_name.value)
    return dataclasses.replace(base, pad_inner_dim=recipe.pad_inner_dim,
                               enable_fsdp_float8_all_gather=recipe.enable_fsdp_float8_all_gather,
                               emulate=recipe.emulate)


def float8_config_dict(recipe: Any) -> dict[str, Any]:
    """The recipe's fully resolved ``Float8LinearConfig`` as JSON-able data, for replaying a conversion.

    Rebuild it with :func:`float8_linear_config_from_dict`.
    """
    return float8_config_to_dict(float8_linear_config(recipe))


def training_op_config(recipe: Any) -> Any:
    """The torchao ``quantize_`` training config of a training-op recipe (``recipe.config_fields()``)."""
    return training_op_config_from_dict(recipe.config_fields())


def float8_config_to_dict(config: Any) -> dict[str, Any]:
    """The fully resolved ``Float8LinearConfig`` as JSON-able data (enums as their values)."""
    return _jsonable(config)


_FLOAT8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    text = str(value)
    if text.startswith("torch.float8"):
        return text.removeprefix("torch.")
    # A new torchao field of a type we cannot write would make the replay silently incomplete.
    raise TypeError(f"Cannot write {type(value).__name__} value {value!r} of Float8LinearConfig as JSON.")


def float8_linear_config_from_dict(data: Mapping[str, Any]) -> Any:
    """Rebuild a torchao ``Float8LinearConfig`` from :func:`float8_config_dict` output.

    Omitted fields take torchao's defaults. Raises RecipeError naming the field for an unknown key or a
    value torchao rejects.
    """
    import torch
    from torchao.float8.config import (
        CastConfig,
        Float8GemmConfig,
        Float8LinearConfig,
        ScalingGranularity,
        ScalingType,
    )

    if not isinstance(data, Mapping):
        raise RecipeError("float8 config must be a JSON object.", field="float8_config")
    names = [f.name for f in dataclasses.fields(Float8LinearConfig)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise RecipeError(
                f"Unknown Float8LinearConfig field {key!r}; allowed: {', '.join(names)}.", field=key
            )
        try:
            if key.startswith("cast_config"):
                if value is None:
                    kwargs[key] = None
                    continue
                dtype_name = value.get("target_dtype")
                if dtype_name is not None and dtype_name not in _FLOAT8_DTYPE_NAMES:
                    raise ValueError(f"target_dtype must be one of {_FLOAT8_DTYPE_NAMES}")
                kwargs[key] = CastConfig(
                    scaling_type=ScalingType(value.get("scaling_type", "dynamic")),
                    scaling_granularity=ScalingGranularity(value.get("scaling_granularity", "tensorwise")),
                    target_dtype=getattr(torch, dtype_name) if dtype_name else None,
                )
            elif key.startswith("gemm_config"):
                fast = value.get("use_fast_accum", False)
                check_bool(fast, f"{key}.use_fast_accum")
                kwargs[key] = Float8GemmConfig(use_fast_accum=fast)
            else:
                check_bool(value, key)
                kwargs[key] = value
        except RecipeError:
            raise
        except (AttributeError, ValueError, AssertionError) as exc:
            raise RecipeError(f"Invalid Float8LinearConfig field {key}: {exc}", field=key) from exc
    try:
        return Float8LinearConfig(**kwargs)
    except AssertionError as exc:  # torchao validates with asserts
        raise RecipeError(f"torchao rejects this Float8LinearConfig: {exc}", field="float8_config") from exc


_TRAINING_OP_FIELDS = {
    "Float8TrainingOpConfig": ("float8_dtype", "out_dtype", "pad_token_groups_for_grouped_mm", "float8_linear_recipe"),
    "MXFP8TrainingOpConfig": ("kernel_preference", "out_dtype", "wgrad_with_hp", "scale_calculation_mode",
                              "pad_token_groups_for_grouped_mm"),
}


def training_op_config_from_dict(data: Mapping[str, Any]) -> Any:
    """torchao's ``Float8TrainingOpConfig`` or ``MXFP8TrainingOpConfig`` from its recorded fields
    (``{"config": <class name>, ...}``, as a training-op recipe's ``config_fields()`` writes them).

    Raises RecipeError naming the field for an unknown config or key, or a value torchao rejects.
    """
    import torch
    from torchao.prototype.moe_training import config as moe_config
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    if not isinstance(data, Mapping) or data.get("config") not in _TRAINING_OP_FIELDS:
        raise RecipeError(f"a training-op config must be a JSON object with config one of "
                          f"{', '.join(_TRAINING_OP_FIELDS)}, got {data!r}", field="training_op_config")
    name = data["config"]
    kwargs = {key: value for key, value in data.items() if key != "config"}
    for key in kwargs:
        if key not in _TRAINING_OP_FIELDS[name]:
            raise RecipeError(f"Unknown {name} field {key!r}; allowed: {', '.join(_TRAINING_OP_FIELDS[name])}.",
                              field=key)
    try:
        for key in ("float8_dtype", "out_dtype"):
            if key in kwargs:
                kwargs[key] = _torch_dtype(torch, kwargs[key], key)
        if "kernel_preference" in kwargs:
            kwargs["kernel_preference"] = KernelPreference(kwargs["kernel_preference"])
        if "scale_calculation_mode" in kwargs:
            kwargs["scale_calculation_mode"] = ScaleCalculationMode(kwargs["scale_calculation_mode"])
        for key in ("pad_token_groups_for_grouped_mm", "wgrad_with_hp"):
            if key in kwargs:
                check_bool(kwargs[key], key)
        return getattr(moe_config, name)(**kwargs)
    except RecipeError:
        raise
    except (TypeError, ValueError, AssertionError) as exc:
        raise RecipeError(f"torchao rejects this {name}: {exc}", field="training_op_config") from exc


def _torch_dtype(torch: Any, name: Any, field: str) -> Any:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise RecipeError(f"{field} must name a torch dtype like bfloat16, got {name!r}", field=field)
    return dtype
