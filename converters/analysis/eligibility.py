"""Layer eligibility analysis: a pure function of (model, options) -> report.

Every ``nn.Linear`` is listed with ``eligible`` or the reasons it is skipped; transformers ``Conv1D``
layers are listed as not-a-Linear; parameters that hold matmul weights outside any Linear (fused MoE
experts, router weights) are listed with their parameter counts, so the report shows how much of the
model stays in high precision. Nothing in the model is touched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from converters.analysis.decision import (
    DecisionOptions,
    LayerDecision,
    LayerKind,
    LayerRecord,
    check_include,
    decide,
    is_router_name,
    with_groups,
)
from converters.analysis.patterns import check_patterns
from converters.analysis.reasons import Reason
from converters.analysis.totals import compute_totals, count_parameters, dtype_name
from converters.errors import ConversionError, Fp8ForgeError, ModelConfigError, RecipeError, RequestError
from converters.model.experts import EXPERT_GEMMS, ExpertsModule, ExpertUnit, find_experts, unit_path
from converters.model.quantized import describe_source_quantization
from converters.model.sources import build_meta_model, load_config, resolve_model_dir
from converters.recipes import default_recipe, recipe_from_dict
from converters.recipes.registry import is_recipe
from converters.recipes.requirements import requirements

__all__ = [
    "AnalysisOptions",
    "analyze_model",
    "analyze_model_reference",
    "check_include_patterns",
    "check_report_rule",
    "converted_expert_gemms",
    "eligible_expert_units",
    "eligible_paths",
    "layer_records",
    "options_recipe",
    "REPORT_VERSION",
]


REPORT_VERSION = 1


_BACKENDS = ("te", "ao")


@dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """What decides eligibility besides the shapes.

    Attributes:
        backend: ``te`` or ``ao``; recorded, and used where the backends differ (the recipe's, when given).
        recipe: the recipe (object or its JSON) whose shape rule applies (``recipe.shape_rule()``: 16, or 32
            for MXFP8, 128 for FP8 block scaling and NVFP4) and whose requirements the report lists; by default
            the backend's default recipe. Stored as its ``to_dict()``.
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
    recipe: Any = None
    _recipe: Any = field(default=None, init=False, repr=False, compare=False)  #: ``recipe`` parsed, once

    def __post_init__(self) -> None:
        if self.recipe is not None:
            recipe = _parsed_recipe(self.recipe)
            object.__setattr__(self, "recipe", recipe.to_dict())
            object.__setattr__(self, "backend", recipe.backend.value)
            object.__setattr__(self, "_recipe", recipe)
        backend = str(self.backend).lower()
        if backend not in _BACKENDS:
            raise RequestError(f"backend must be one of {_BACKENDS}, got {self.backend!r}", field="backend")
        object.__setattr__(self, "backend", backend)
        for name in ("include", "exclude"):
            object.__setattr__(self, name, check_patterns(tuple(getattr(self, name)), name))


def _parsed_recipe(recipe: Any) -> Any:
    """A recipe object from a recipe object (validated when it was built) or its JSON; RecipeError naming
    ``recipe.<field>``."""
    if is_recipe(recipe):
        return recipe
    try:
        return recipe_from_dict(recipe)
    except RecipeError as exc:
        raise RecipeError(exc.message, field="recipe" if exc.field in (None, "recipe") else f"recipe.{exc.field}"
                          ) from exc


def options_recipe(options: AnalysisOptions) -> Any:
    """The recipe whose rules an analysis applies: ``options.recipe``, else the backend's default recipe."""
    return options._recipe if options.recipe is not None else default_recipe(options.backend)


def analyze_model(model: nn.Module, options: AnalysisOptions | None = None) -> dict[str, Any]:
    """Build the eligibility report of ``model`` (weights may live on the meta device).

    Returns a JSON-able dict: ``layers``, ``other_weights``, ``fused_groups``, ``totals``, ``options``.
    """
    options = options or AnalysisOptions()
    recipe = options_recipe(options)
    rule = recipe.shape_rule()
    # One walk over the module tree serves every rule: on a 70B config the walk dominates the cost.
    named = list(model.named_modules())
    experts = {block.path: block for block in find_experts(named)}
    records, groups = with_groups(layer_records(model, named, experts))
    decisions = decide(records, DecisionOptions(
        format=recipe.library_class, shape_rule=rule, include=options.include, exclude=options.exclude,
        skip_first_last=options.skip_first_last, convert_router_gates=options.convert_router_gates))
    layers = [decision.to_dict() for decision in decisions]
    report = {
        "version": REPORT_VERSION,
        "model_class": type(model).__name__,
        "options": {name: value for name, value in asdict(options).items() if not name.startswith("_")},
        "rule": rule.describe() + ("; first and last nn.Linear skipped" if options.skip_first_last else ""),
        "recipe_requirements": requirements(recipe),
        "layers": layers,
        "other_weights": _other_matmul_weights(named, set(experts)),
        "fused_groups": _group_rows(groups, decisions) + _expert_groups(experts.values(), decisions),
        "moe": [_moe_entry(block) for block in experts.values()],
    }
    report["totals"] = compute_totals(count_parameters(named), report)
    return report


def eligible_paths(report: dict[str, Any]) -> list[str]:
    """Linear module paths the report calls eligible, in model order (what conversion must swap)."""
    return [layer["path"] for layer in report["layers"] if layer["eligible"] and "expert" not in layer]


def eligible_expert_units(report: dict[str, Any]) -> list[str]:
    """Expert GEMM units (``<experts>.<e>.<gemm>``, see ``converters.model.experts``) the report calls eligible."""
    return [layer["path"] for layer in report["layers"] if layer["eligible"] and "expert" in layer]


def layer_records(model: nn.Module, named: list[tuple[str, nn.Module]], experts: dict[str, ExpertsModule]
                  ) -> list[LayerRecord]:
    """What each Linear, Conv1D and expert GEMM of ``model`` is, in module order (experts: expert by expert)."""
    modules = dict(named)
    linear_paths = [path for path, module in named if isinstance(module, nn.Linear)]
    ends = (linear_paths[0], linear_paths[-1]) if linear_paths else (None, None)
    tied = _tied_head_paths(model, named)
    records: list[LayerRecord] = []
    for path, module in named:
        if path in experts:
            records += _expert_records(experts[path], module)
        elif isinstance(module, nn.Linear):
            records.append(_module_record(path, module, LayerKind.LINEAR, module.in_features, module.out_features,
                                          first=path == ends[0], last=path == ends[1], tied=path in tied,
                                          router=_is_router_gate(path, modules)))
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            in_features, out_features = module.weight.shape
            records.append(_module_record(path, module, LayerKind.CONV1D, int(in_features), int(out_features)))
    return records


def _module_record(path: str, module: nn.Module, kind: LayerKind, in_features: int, out_features: int,
                   **flags: bool) -> LayerRecord:
    bias = getattr(module, "bias", None)
    return LayerRecord(name=path, kind=kind, shape=tuple(module.weight.shape), in_features=in_features,
                       out_features=out_features, dtype=dtype_name(module.weight.dtype),
                       parameters=module.weight.numel() + (bias.numel() if bias is not None else 0),
                       cls=type(module).__name__, **flags)


def _expert_records(block: ExpertsModule, module: nn.Module) -> list[LayerRecord]:
    """One record per expert GEMM (the GEMM's own dims: the rules apply per GEMM)."""
    dtype = dtype_name(module.gate_up_proj.dtype)
    records = []
    for e in range(block.num_experts):
        for gemm in EXPERT_GEMMS:
            in_features, out_features = block.features(gemm)
            records.append(LayerRecord(
                name=unit_path(block.path, e, gemm), kind=LayerKind.EXPERT, shape=(out_features, in_features),
                in_features=in_features, out_features=out_features, dtype=dtype,
                parameters=in_features * out_features, layout_supported=block.supported, experts=block.path,
                cls=block.cls, expert=ExpertUnit(module=block.path, index=e, gemm=gemm)))
    return records


def _group_rows(groups: dict[str, list[str]], decisions: list[LayerDecision]) -> list[dict[str, Any]]:
    """The report's fused groups: q/k/v, gate/up and the like, which serving engines run as one GEMM."""
    eligible = {decision.name for decision in decisions if decision.eligible}
    rows = []
    for name, members in groups.items():
        members_eligible = [member for member in members if member in eligible]
        rows.append({"name": name, "members": members, "eligible_members": members_eligible,
                     "partly_eligible": 0 < len(members_eligible) < len(members)})
    return rows


def _expert_groups(blocks: Any, decisions: list[LayerDecision]) -> list[dict[str, Any]]:
    """One group per experts module and GEMM kind: TE and serving engines run it as one grouped GEMM."""
    return _group_rows({f"{block.path}.{gemm}": [unit_path(block.path, e, gemm) for e in range(block.num_experts)]
                        for block in blocks for gemm in EXPERT_GEMMS}, decisions)


def converted_expert_gemms(report: dict[str, Any]) -> list[str]:
    """``<experts>.<gemm>`` of every expert GEMM kind whose experts are all eligible (they convert together)."""
    groups = {group["name"]: group for group in report["fused_groups"]}
    names = [f"{block['module']}.{gemm}" for block in report.get("moe", []) for gemm in EXPERT_GEMMS]
    return [name for name in names if len(groups[name]["eligible_members"]) == len(groups[name]["members"])]


def _moe_entry(block: ExpertsModule) -> dict[str, Any]:
    entry = {"module": block.path, "class": block.cls, "experts": block.num_experts, "hidden": block.hidden,
             "intermediate": block.intermediate, "supported": block.supported}
    if not block.supported:
        entry["why_not"] = block.why_not
    return entry


def check_include_patterns(report: dict[str, Any]) -> None:
    """Refuse an include pattern that selects no Linear layer of the analysed model: it is a typo or
    belongs to another model, and would leave the layers it meant to select unconverted without a word.

    Raises:
        PatternError: naming ``include[i]`` and the pattern, with a path of this model as an example.
    """
    paths = [layer["path"] for layer in report["layers"] if Reason.NOT_LINEAR.value not in layer["reasons"]]
    check_include(report["options"]["include"], paths, where="this model", noun="paths")


def _is_router_gate(path: str, modules: dict[str, nn.Module]) -> bool:
    parent_path, _, name = path.rpartition(".")
    parent = modules.get(parent_path)
    if parent is None or not hasattr(parent, "experts"):
        return False
    return is_router_name(name)


def _tied_head_paths(model: nn.Module, named: list[tuple[str, nn.Module]]) -> set[str]:
    """Linears whose weight is the input embedding's (one tensor, stored and used twice)."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if embedding is None or not hasattr(embedding, "weight"):
        return set()
    return {path for path, module in named if isinstance(module, nn.Linear) and module.weight is embedding.weight}


def _other_matmul_weights(named: list[tuple[str, nn.Module]], experts: set[str]) -> list[dict[str, Any]]:
    """Parameters of 2+ dims outside Linear/Conv1D/embedding/norm and experts modules: routers, the rest."""
    skipped_types = (nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.modules.conv._ConvNd)
    entries = []
    for path, module in named:
        if isinstance(module, skipped_types) or type(module).__name__ in ("Conv1D",) or "Norm" in type(module).__name__:
            continue
        if path in experts:  # listed per expert GEMM among the layers (biases are not matmul weights)
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
                    "dtype": dtype_name(parameter.dtype),
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


def analyze_model_reference(ref: str, sources: Any, *, backend: str = "te", include=(), exclude=(),
                            skip_first_last: bool = True, convert_router_gates: bool = False,
                            recipe: Any = None) -> dict[str, Any]:
    """Resolve ``ref`` (config only), build it on the meta device and analyze it (``recipe``: see AnalysisOptions).

    Raises:
        Fp8ForgeError subclasses: bad reference, missing model or config, bad options.
    """
    options = AnalysisOptions(
        backend=backend,
        include=tuple(include),
        exclude=tuple(exclude),
        skip_first_last=skip_first_last,
        convert_router_gates=convert_router_gates,
        recipe=recipe,
    )
    directory = resolve_model_dir(ref, sources, with_weights=False)
    config = load_config(directory, sources)  # within sources.config_limits (converters.model.limits)
    model = _build_meta_model(config, sources)
    report = analyze_model(model, options)
    check_include_patterns(report)
    report["model"] = {"reference": ref, "model_type": getattr(config, "model_type", None)}
    quantization = describe_source_quantization(directory)  # a quantized source: its scheme, or why it is unread
    if quantization is not None:
        report["source_quantization"] = quantization
    return report


def check_report_rule(report: dict[str, Any], recipe: Any) -> None:
    """Refuse a report whose eligible layers break the recipe's shape rule (an analysis run without the recipe).

    Conversion follows the report and never filters again; this only makes sure the report was built for this
    recipe. Raises ConversionError naming a layer, the rule and the fix.
    """
    rule = recipe.shape_rule()
    bad = [layer["path"] for layer in report["layers"]
           if layer["eligible"] and rule.fails(layer["in_features"], layer["out_features"])]
    if bad:
        raise ConversionError(f"{len(bad)} layers the analysis called eligible break {recipe.library_class}'s "
                              f"shape rule ({rule.describe()}), e.g. {bad[0]}: the analysis ran without the recipe; "
                              "analyze with AnalysisOptions(recipe=...)")


def _build_meta_model(config: Any, sources: Any) -> nn.Module:
    """The model on the meta device; what transformers trips on while building a client's config (a head count
    that does not divide the width, a field the architecture reads with the wrong type) is the config's fault."""
    try:
        return build_meta_model(config, sources)
    except Fp8ForgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        raise ModelConfigError(f"no model can be built from config.json: {type(exc).__name__}: {exc}",
                               field="model") from exc
