"""Layer eligibility analysis: a pure function of (model, options) -> report.

Every ``nn.Linear`` is listed with ``eligible`` or the reasons it is skipped; transformers ``Conv1D``
layers are listed as not-a-Linear; parameters that hold matmul weights outside any Linear (fused MoE
experts, router weights) are listed with their parameter counts, so the report shows how much of the
model stays in high precision. Nothing in the model is touched.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from converters.patterns import PatternError, matches, validate_pattern

__all__ = [
    "AnalysisOptions",
    "Reason",
    "analyze_model",
    "analyze_model_reference",
    "check_include_patterns",
    "eligible_paths",
    "REPORT_VERSION",
]

logger = logging.getLogger(__name__)

REPORT_VERSION = 1
FP8_DIM_MULTIPLE = 16


class Reason(str, enum.Enum):
    """Reason codes a layer carries when it is not eligible (stable strings, documented in README)."""

    DIM_NOT_DIVISIBLE = "dim_not_divisible_by_16"
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


# Sibling projections that inference engines and TE fuse into one GEMM: a group must agree.
FUSED_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "bert_qkv": ("query", "key", "value"),
    "w1_w3": ("w1", "w3"),
}
_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
_BACKENDS = ("te", "ao")


@dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """What decides eligibility besides the shapes.

    Attributes:
        backend: ``te`` or ``ao``; recorded, and used where the backends differ.
        include: if given, only Linears matched by one of these patterns are eligible.
        exclude: Linears matched by any of these patterns are skipped.
        skip_first_last: skip the first and last ``nn.Linear`` (Accelerate's torchao rule, the seed's).
        convert_router_gates: also convert MoE router gates (skipped by default: routing is precision-
            sensitive and the gate is tiny).
    """

    backend: str = "te"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    convert_router_gates: bool = False

    def __post_init__(self) -> None:
        from converters.errors import Fp8ForgeError

        backend = str(self.backend).lower()
        if backend not in _BACKENDS:
            raise Fp8ForgeError(f"backend must be one of {_BACKENDS}, got {self.backend!r}", field="backend")
        object.__setattr__(self, "backend", backend)
        for name in ("include", "exclude"):
            patterns = tuple(getattr(self, name))
            for index, pattern in enumerate(patterns):
                validate_pattern(pattern, field=f"{name}[{index}]")
            object.__setattr__(self, name, patterns)


def analyze_model(model: nn.Module, options: AnalysisOptions | None = None) -> dict[str, Any]:
    """Build the eligibility report of ``model`` (weights may live on the meta device).

    Returns a JSON-able dict: ``layers``, ``other_weights``, ``fused_groups``, ``totals``, ``options``.
    """
    options = options or AnalysisOptions()
    # One walk over the module tree serves every rule: on a 70B config the walk dominates the cost.
    named = list(model.named_modules())
    modules = dict(named)
    linear_paths = [path for path, module in named if isinstance(module, nn.Linear)]
    first = linear_paths[0] if linear_paths else None
    last = linear_paths[-1] if linear_paths else None
    tied = _tied_head_paths(model, named)

    layers: list[dict[str, Any]] = []
    for path, module in named:
        if isinstance(module, nn.Linear):
            entry = _layer_entry(path, module, module.in_features, module.out_features)
            entry["reasons"] = _linear_reasons(path, modules, options, first=first, last=last, tied=tied)
            entry["eligible"] = not entry["reasons"]
            layers.append(entry)
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            in_features, out_features = module.weight.shape
            entry = _layer_entry(path, module, int(in_features), int(out_features))
            entry["reasons"] = [Reason.NOT_LINEAR.value]
            layers.append(entry)

    report = {
        "version": REPORT_VERSION,
        "model_class": type(model).__name__,
        "options": asdict(options),
        "rule": "both Linear dims divisible by 16"
        + ("; first and last nn.Linear skipped" if options.skip_first_last else ""),
        "layers": layers,
        "other_weights": _other_matmul_weights(named),
        "fused_groups": _fused_groups(layers),
    }
    report["totals"] = _totals(_count_parameters(named), report)
    return report


def eligible_paths(report: dict[str, Any]) -> list[str]:
    """Module paths the report calls eligible, in model order (what conversion must swap)."""
    return [layer["path"] for layer in report["layers"] if layer["eligible"]]


def check_include_patterns(report: dict[str, Any]) -> None:
    """Refuse an include pattern that selects no Linear layer of the analysed model: it is a typo or
    belongs to another model, and would leave the layers it meant to select unconverted without a word.

    Raises:
        PatternError: naming ``include[i]`` and the pattern, with a path of this model as an example.
    """
    paths = [layer["path"] for layer in report["layers"] if Reason.NOT_LINEAR.value not in layer["reasons"]]
    for index, pattern in enumerate(report["options"]["include"]):
        if any(matches(pattern, path) for path in paths):
            continue
        example = f"its Linear layers have paths like {paths[len(paths) // 2]!r}" if paths else "it has no nn.Linear"
        raise PatternError(
            f"include[{index}]: pattern {pattern!r} matches no Linear layer of this model ({example}); "
            "patterns match whole dotted path segments",
            field=f"include[{index}]",
        )


def _layer_entry(path: str, module: nn.Module, in_features: int, out_features: int) -> dict[str, Any]:
    bias = getattr(module, "bias", None)
    return {
        "path": path,
        "class": type(module).__name__,
        "in_features": in_features,
        "out_features": out_features,
        "parameters": module.weight.numel() + (bias.numel() if bias is not None else 0),
        "dtype": _dtype_name(module.weight.dtype),
        "eligible": False,
        "reasons": [],
        "group": None,
    }


def _linear_reasons(
    path: str, modules: dict[str, nn.Module], options: AnalysisOptions, *, first: str, last: str, tied: set[str]
) -> list[str]:
    module = modules[path]
    reasons = []
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        reasons.append(Reason.DIM_NOT_DIVISIBLE.value)
    if options.skip_first_last and path == first:
        reasons.append(Reason.FIRST_LINEAR.value)
    if options.skip_first_last and path == last:
        reasons.append(Reason.LAST_LINEAR.value)
    if path in tied:
        reasons.append(Reason.TIED_HEAD.value)
    if not options.convert_router_gates and _is_router_gate(path, modules):
        reasons.append(Reason.ROUTER_GATE.value)
    if options.include and not any(matches(pattern, path) for pattern in options.include):
        reasons.append(Reason.NOT_INCLUDED.value)
    if any(matches(pattern, path) for pattern in options.exclude):
        reasons.append(Reason.EXCLUDED.value)
    return reasons


def _is_router_gate(path: str, modules: dict[str, nn.Module]) -> bool:
    parent_path, _, name = path.rpartition(".")
    parent = modules.get(parent_path)
    if parent is None or not hasattr(parent, "experts"):
        return False
    return name in _ROUTER_NAMES or "router" in name


def _tied_head_paths(model: nn.Module, named: list[tuple[str, nn.Module]]) -> set[str]:
    """Linears whose weight is the input embedding's (one tensor, stored and used twice)."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if embedding is None or not hasattr(embedding, "weight"):
        return set()
    return {path for path, module in named if isinstance(module, nn.Linear) and module.weight is embedding.weight}


def _fused_groups(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_path = {layer["path"]: layer for layer in layers}
    groups = []
    for layer in layers:
        parent, _, name = layer["path"].rpartition(".")
        for kind, members in FUSED_GROUPS.items():
            if name != members[0]:
                continue
            paths = [f"{parent}.{member}" if parent else member for member in members]
            if not all(path in by_path for path in paths):
                continue
            group_name = f"{parent}.{kind}" if parent else kind
            for path in paths:
                by_path[path]["group"] = group_name
            eligible = [path for path in paths if by_path[path]["eligible"]]
            groups.append(
                {
                    "name": group_name,
                    "members": paths,
                    "eligible_members": eligible,
                    "partly_eligible": 0 < len(eligible) < len(paths),
                }
            )
    return groups


def _other_matmul_weights(named: list[tuple[str, nn.Module]]) -> list[dict[str, Any]]:
    """Parameters of 2+ dims outside Linear/Conv1D/embedding/norm modules: fused experts, routers."""
    skipped_types = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.modules.conv._ConvNd)
    entries = []
    for path, module in named:
        if isinstance(module, skipped_types) or type(module).__name__ in ("Conv1D",) or "Norm" in type(module).__name__:
            continue
        # The module's own parameter dict: named_parameters() would start a module walk per module.
        for name, parameter in module._parameters.items():
            if parameter is None:
                continue
            # Learned tokens and position tables are lookups, not matmul weights.
            if parameter.dim() < 2 or any(word in name for word in ("embed", "token", "position")):
                continue
            full = f"{path}.{name}" if path else name
            entries.append(
                {
                    "path": full,
                    "module": path,
                    "cls": type(module).__name__,
                    "shape": list(parameter.shape),
                    "parameters": parameter.numel(),
                    "dtype": _dtype_name(parameter.dtype),
                    "reason": _other_reason(module, name, parameter),
                }
            )
    return entries


def _other_reason(module: nn.Module, name: str, parameter: torch.Tensor) -> str:
    class_name = type(module).__name__.lower()
    if parameter.dim() == 3 and ("expert" in class_name or "expert" in name or "proj" in name):
        return Reason.FUSED_EXPERTS.value
    if "router" in class_name or "gate" in class_name:
        return Reason.ROUTER_WEIGHT.value
    return Reason.OTHER_MATMUL.value


@dataclass(frozen=True, kw_only=True)
class _Parameters:
    """The model's parameters, each tensor once (a tied head shares the embedding's)."""

    count: int
    bytes: int
    dtypes: tuple[str, ...]  # most bytes first


def _count_parameters(named: list[tuple[str, nn.Module]]) -> _Parameters:
    seen: set[int] = set()
    count = 0
    bytes_by_dtype: dict[str, int] = {}
    for _, module in named:
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                count += parameter.numel()
                dtype = _dtype_name(parameter.dtype)
                bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + parameter.numel() * parameter.element_size()
    dtypes = tuple(sorted(bytes_by_dtype, key=lambda name: -bytes_by_dtype[name]))
    return _Parameters(count=count, bytes=sum(bytes_by_dtype.values()), dtypes=dtypes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _totals(parameters: _Parameters, report: dict[str, Any]) -> dict[str, Any]:
    linear_layers = [layer for layer in report["layers"] if layer["class"] != "Conv1D"]
    eligible = [layer for layer in linear_layers if layer["eligible"]]
    linear_params = sum(layer["parameters"] for layer in linear_layers)
    fp8_weight_params = sum(layer["in_features"] * layer["out_features"] for layer in eligible)
    outside = sum(entry["parameters"] for entry in report["other_weights"])
    conv1d = sum(layer["parameters"] for layer in report["layers"] if layer["class"] == "Conv1D")
    # One byte per FP8 weight element, in place of the layer's own element size.
    fp8_saving = sum(layer["in_features"] * layer["out_features"] * (getattr(torch, layer["dtype"]).itemsize - 1)
                     for layer in eligible)
    bytes_before = parameters.count * 2
    return {
        "linear_layers": len(linear_layers),
        "eligible_layers": len(eligible),
        "skipped_layers": len(linear_layers) - len(eligible),
        "conv1d_layers": len(report["layers"]) - len(linear_layers),
        "linear_parameters": linear_params,
        "fp8_parameters": fp8_weight_params,
        "fp8_share_of_linear_parameters": _ratio(fp8_weight_params, linear_params),
        "matmul_parameters_outside_linear": outside + conv1d,
        "fp8_share_of_all_matmul_parameters": _ratio(fp8_weight_params, linear_params + outside + conv1d),
        "model_parameters": parameters.count,
        "partly_eligible_groups": sum(1 for group in report["fused_groups"] if group["partly_eligible"]),
        "weight_dtype": "+".join(parameters.dtypes) or "none",
        "weight_bytes": parameters.bytes,
        "weight_bytes_with_fp8": parameters.bytes - fp8_saving,
        # The same two figures as if every parameter were bf16 (report version 1 had only these).
        "weight_bytes_bf16": bytes_before,
        "weight_bytes_fp8": bytes_before - fp8_weight_params,
    }


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


def analyze_model_reference(ref: str, sources: Any, *, backend: str = "te", include=(), exclude=(),
                            skip_first_last: bool = True, convert_router_gates: bool = False) -> dict[str, Any]:
    """Resolve ``ref`` (config only), build it on the meta device and analyze it.

    Raises:
        Fp8ForgeError subclasses: bad reference, missing model or config, bad options.
    """
    from converters.model_sources import build_meta_model, load_config, resolve_model_dir

    options = AnalysisOptions(
        backend=backend,
        include=tuple(include),
        exclude=tuple(exclude),
        skip_first_last=skip_first_last,
        convert_router_gates=convert_router_gates,
    )
    directory = resolve_model_dir(ref, sources, with_weights=False)
    config = load_config(directory, sources)
    model = build_meta_model(config, sources)
    report = analyze_model(model, options)
    check_include_patterns(report)
    report["model"] = {"reference": ref, "model_type": getattr(config, "model_type", None)}
    return report
