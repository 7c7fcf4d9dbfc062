"""The analysis report's totals: parameter counts, FP8 shares and weight sizes, from the report's entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["count_parameters", "compute_totals", "refresh_totals", "dtype_name"]


@dataclass(frozen=True, kw_only=True)
class _Parameters:
    """The model's parameters, each tensor once (a tied head shares the embedding's)."""

    count: int
    bytes: int
    dtypes: tuple[str, ...]  # most bytes first


def count_parameters(named: list[tuple[str, nn.Module]]) -> _Parameters:
    seen: set[int] = set()
    count = 0
    bytes_by_dtype: dict[str, int] = {}
    for _, module in named:
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                count += parameter.numel()
                dtype = dtype_name(parameter.dtype)
                bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + parameter.numel() * parameter.element_size()
    dtypes = tuple(sorted(bytes_by_dtype, key=lambda name: -bytes_by_dtype[name]))
    return _Parameters(count=count, bytes=sum(bytes_by_dtype.values()), dtypes=dtypes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refresh_totals(report: dict[str, Any]) -> None:
    """Recount ``report["totals"]`` after layers changed eligibility (the model's size is in the totals already)."""
    totals = report["totals"]
    dtypes = tuple(name for name in totals["weight_dtype"].split("+") if name != "none")
    report["totals"] = compute_totals(_Parameters(count=totals["model_parameters"], bytes=totals["weight_bytes"],
                                           dtypes=dtypes), report)


def compute_totals(parameters: _Parameters, report: dict[str, Any]) -> dict[str, Any]:
    units = [layer for layer in report["layers"] if "expert" in layer]
    linear_layers = [layer for layer in report["layers"] if layer["class"] != "Conv1D" and "expert" not in layer]
    eligible = [layer for layer in linear_layers if layer["eligible"]]
    eligible_units = [unit for unit in units if unit["eligible"]]
    linear_params = sum(layer["parameters"] for layer in linear_layers)
    expert_params = sum(unit["parameters"] for unit in units)
    fp8_linear_params = sum(layer["in_features"] * layer["out_features"] for layer in eligible)
    fp8_weight_params = fp8_linear_params + sum(unit["parameters"] for unit in eligible_units)
    outside = sum(entry["parameters"] for entry in report["other_weights"])
    conv1d = sum(layer["parameters"] for layer in report["layers"] if layer["class"] == "Conv1D")
    # One byte per FP8 weight element, in place of the layer's own element size.
    fp8_saving = sum(layer["in_features"] * layer["out_features"] * (getattr(torch, layer["dtype"]).itemsize - 1)
                     for layer in eligible + eligible_units)
    bytes_before = parameters.count * 2
    return {
        "linear_layers": len(linear_layers),
        "eligible_layers": len(eligible),
        "skipped_layers": len(linear_layers) - len(eligible),
        "conv1d_layers": len(report["layers"]) - len(linear_layers) - len(units),
        "expert_units": len(units),
        "eligible_expert_units": len(eligible_units),
        "linear_parameters": linear_params,
        "expert_parameters": expert_params,
        "fp8_parameters": fp8_weight_params,
        "fp8_share_of_linear_parameters": _ratio(fp8_linear_params, linear_params),
        "fp8_share_of_expert_parameters": _ratio(fp8_weight_params - fp8_linear_params, expert_params),
        "matmul_parameters_outside_linear": outside + conv1d + expert_params,
        "fp8_share_of_all_matmul_parameters": _ratio(fp8_weight_params,
                                                     linear_params + expert_params + outside + conv1d),
        "model_parameters": parameters.count,
        "partly_eligible_groups": sum(1 for group in report["fused_groups"] if group["partly_eligible"]),
        "weight_dtype": "+".join(parameters.dtypes) or "none",
        "weight_bytes": parameters.bytes,
        "weight_bytes_with_fp8": parameters.bytes - fp8_saving,
        # The same two figures as if every parameter were bf16.
        "weight_bytes_bf16": bytes_before,
        "weight_bytes_fp8": bytes_before - fp8_weight_params,
    }


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0
