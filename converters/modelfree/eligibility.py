"""Which weights a model-free conversion quantizes, decided from the tensor headers and config.json alone.

The analysis (:mod:`converters.analysis.eligibility`) walks a model built on the meta device; a model-free job
has no model class, only names, dtypes and shapes. A stored tensor counts as a Linear's weight when it is a 2-D
floating ``*.weight`` that is not an embedding, a norm or a router; it then gets the analysis' reason codes
(:class:`~converters.analysis.reasons.Reason`) and the serving format's own ``layer_rule``. The first and last
Linear are found by the order the analysis sees them in: decoder layer index, then attention before MLP and each
block's projections in the order model code defines them (q, k, v, o; gate, up, down), with the head (``lm_head``)
last even when it is tied and not stored. Fused groups (q/k/v, gate/up, an expert's w1/w3) and experts modules are
quantized whole or not at all, as :func:`converters.serving.plan.plan_serving` decides.

Differences from the analysis: include/exclude match on-disk names (Mixtral's ``block_sparse_moe.experts.3.w1``,
not the loaded model's ``mlp.experts.3.gate_up_proj``), and an expert matrix's shape rule is checked per stored
matrix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from converters.analysis.eligibility import FUSED_GROUPS
from converters.analysis.patterns import PatternError, check_patterns, matches
from converters.analysis.reasons import Reason

__all__ = ["ModelFreeOptions", "TensorInfo", "decide", "order_key"]

_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"}
_EMBEDDINGS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings", "token_type_embeddings", "shared")
_HEADS = ("lm_head", "embed_out", "output")
_ROUTERS = ("gate", "router", "shared_expert_gate")
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<leaf>[^.]+)$")
#: the order model code defines a block's projections in (what decides the first Linear of a layer)
_LEAF_ORDER = ("q_proj", "query", "qkv_proj", "query_key_value", "Wqkv", "c_attn", "k_proj", "key", "v_proj",
               "value", "o_proj", "out_proj", "dense", "c_proj", "gate_proj", "w1", "up_proj", "w3", "gate_up_proj",
               "fc1", "c_fc", "dense_h_to_4h", "down_proj", "w2", "fc2", "dense_4h_to_h")
#: model types whose 2-D projection weights belong to transformers' Conv1D, not nn.Linear
_CONV1D_MODEL_TYPES = ("gpt2",)
_DIVISOR = 16


@dataclass(frozen=True, kw_only=True)
class ModelFreeOptions:
    """The selection of a model-free job (as :class:`~converters.analysis.eligibility.AnalysisOptions` has it)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            object.__setattr__(self, name, check_patterns(tuple(getattr(self, name)), name))
        if not isinstance(self.skip_first_last, bool):
            raise ValueError(f"skip_first_last must be a bool, got {self.skip_first_last!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"include": list(self.include), "exclude": list(self.exclude), "skip_first_last": self.skip_first_last}


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor as its shard's header describes it."""

    key: str
    shard: str
    dtype: str
    shape: tuple[int, ...]


def order_key(module: str) -> tuple[int, int, int, int, str]:
    """Where a Linear comes in the model's module order: before the layers, layer index and place in it, or after."""
    parts = module.split(".")
    index = next((int(part) for part in parts if part.isdigit()), None)
    if index is None:
        return (2 if parts[-1] in _HEADS or "head" in parts[-1] else 0, 0, 0, 0, module)
    block = 0 if any("attn" in part or "attention" in part for part in parts) else 1
    leaf = _LEAF_ORDER.index(parts[-1]) if parts[-1] in _LEAF_ORDER else len(_LEAF_ORDER)
    return (1, index, block, leaf, module)


def _kind(info: TensorInfo, moe_blocks: set[str], config: Mapping[str, Any]) -> tuple[str, str | None]:
    """``("linear" | "expert" | "other" | "ignored", reason)`` of one stored tensor."""
    module, _, leaf = info.key.rpartition(".")
    if leaf != "weight" or info.dtype not in _FLOAT_DTYPES:
        return "ignored", None
    last = module.rpartition(".")[2]
    if len(info.shape) != 2:
        if len(info.shape) > 2 and "expert" in module:
            return "other", Reason.FUSED_EXPERTS.value
        return "ignored", None
    if any(word in last for word in _EMBEDDINGS) and last not in _HEADS:
        return "other", "embedding"
    if "norm" in last.lower() or "ln" in last.split("_"):
        return "other", "norm"
    parent = module.rpartition(".")[0]
    if (last in _ROUTERS and parent in moe_blocks) or "router" in last:
        return "linear", Reason.ROUTER_GATE.value
    if _EXPERT.match(module):
        return "expert", None
    if config.get("model_type") in _CONV1D_MODEL_TYPES and last.startswith("c_"):
        return "linear", Reason.NOT_LINEAR.value
    return "linear", None


def decide(tensors: list[TensorInfo], config: Mapping[str, Any], options: ModelFreeOptions,
           layer_rule: Any) -> dict[str, Any]:
    """The model-free eligibility report: every Linear-like weight eligible or with reasons, and what quantizes.

    ``layer_rule(in_features, out_features)`` is the serving format's own shape rule (reason or None).
    Returns a JSON-able dict: ``layers`` (module order), ``other`` (embeddings, norms, fused expert tensors),
    ``fused_groups``, ``quantized`` (weight key -> amax group: the key itself, the fused group or the expert's
    gate/up unit).

    Raises:
        PatternError: an include pattern matches no Linear weight (``include[i]``).
    """
    # the modules holding an ``experts`` list: their ``gate`` is the router
    moe_blocks = {found["module"].removesuffix(".experts") for found in map(_EXPERT.match, (
        info.key.rpartition(".")[0] for info in tensors)) if found}
    layers, other = [], []
    for info in tensors:
        kind, reason = _kind(info, moe_blocks, config)
        if kind == "other":
            other.append({"key": info.key, "shard": info.shard, "reason": reason})
        elif kind in ("linear", "expert"):
            layers.append(_entry(info, kind, reason, options, layer_rule))
    _check_include(layers, options)
    layers.sort(key=lambda layer: order_key(layer["module"]))
    _first_last(layers, config, options)
    for layer in layers:
        layer["reasons"] = [reason for reason in layer["reasons"] if reason]
        layer["eligible"] = not layer["reasons"]
    groups = _fused_groups(layers)
    quantized = _resolve_groups(layers, groups)
    return {"options": options.to_dict(), "layers": layers, "other": other, "quantized": quantized,
            "fused_groups": [{"name": name, "members": members} for name, members in groups.items()]}


def _entry(info: TensorInfo, kind: str, reason: str | None, options: ModelFreeOptions, layer_rule: Any
           ) -> dict[str, Any]:
    module = info.key.removesuffix(".weight")
    out_features, in_features = info.shape
    if reason == Reason.NOT_LINEAR.value:
        checks = [reason]
    else:
        # In the analysis' order of reasons: shape, first, last, tied, router, include, exclude.
        checks = [Reason.DIM_NOT_DIVISIBLE.value if in_features % _DIVISOR or out_features % _DIVISOR else None,
                  None, None, None, reason,
                  Reason.NOT_INCLUDED.value if options.include and not any(
                      matches(pattern, module) for pattern in options.include) else None,
                  Reason.EXCLUDED.value if any(matches(pattern, module) for pattern in options.exclude) else None]
    return {**asdict(info), "shape": list(info.shape), "module": module, "kind": kind,
            "in_features": in_features, "out_features": out_features, "reasons": checks,
            "format_rule": layer_rule(in_features, out_features), "group": None, "eligible": False}


def _check_include(layers: list[dict[str, Any]], options: ModelFreeOptions) -> None:
    for index, pattern in enumerate(options.include):
        if not any(matches(pattern, layer["module"]) for layer in layers):
            raise PatternError(f"include[{index}]: pattern {pattern!r} matches no Linear weight of this checkpoint; "
                               "patterns match whole dotted segments of the stored names", field=f"include[{index}]")


def _first_last(layers: list[dict[str, Any]], config: Mapping[str, Any], options: ModelFreeOptions) -> None:
    """The analysis' first/last rule (slots 1 and 2 of the reasons); a tied head (slot 3) is the last Linear even
    where the files do not store it."""
    linears = [layer for layer in layers if layer["kind"] == "linear" and len(layer["reasons"]) > 1]
    tied = bool(config.get("tie_word_embeddings", False))
    for layer in linears:
        if tied and layer["module"].rpartition(".")[2] in _HEADS:
            layer["reasons"][3] = Reason.TIED_HEAD.value
    if not options.skip_first_last or not linears:
        return
    linears[0]["reasons"][1] = Reason.FIRST_LINEAR.value
    head_stored = any(layer["module"].rpartition(".")[2] in _HEADS for layer in linears)
    if head_stored or not _has_head(config):
        linears[-1]["reasons"][2] = Reason.LAST_LINEAR.value


def _has_head(config: Mapping[str, Any]) -> bool:
    return any(str(name).endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
               for name in config.get("architectures") or [])


def _fused_groups(layers: list[dict[str, Any]]) -> dict[str, list[str]]:
    """q/k/v, gate/up, w1/w3 siblings (an expert's gate and up matrices too): they share one weight amax."""
    by_module = {layer["module"]: layer for layer in layers}
    groups: dict[str, list[str]] = {}
    for layer in layers:
        parent, _, leaf = layer["module"].rpartition(".")
        for kind, members in FUSED_GROUPS.items():
            paths = [f"{parent}.{member}" if parent else member for member in members]
            if leaf == members[0] and all(path in by_module for path in paths):
                groups[f"{parent}.{kind}" if parent else kind] = paths
                for path in paths:
                    by_module[path]["group"] = f"{parent}.{kind}" if parent else kind
    return groups


def _resolve_groups(layers: list[dict[str, Any]], groups: dict[str, list[str]]) -> dict[str, str]:
    """Eligible and fitting the format, whole groups and whole experts modules only: weight key -> the name its
    weight amax is shared under (its fused group's, or its own module path)."""
    by_module = {layer["module"]: layer for layer in layers}
    for layer in layers:
        if layer["eligible"] and layer["format_rule"]:
            layer["eligible"] = False
            layer["reasons"].append(layer["format_rule"])
    experts: dict[str, list[str]] = {}
    for layer in layers:
        if layer["kind"] == "expert":
            experts.setdefault(_EXPERT.match(layer["module"])["module"], []).append(layer["module"])
    # An engine runs an experts module as one fused MoE layer of one scheme: all of it or none.
    for module, members in experts.items():
        failed = next((by_module[m] for m in members if not by_module[m]["eligible"]), None)
        if failed is not None:
            leaf = _EXPERT.match(failed["module"])["leaf"]
            _drop(by_module, members, f"fused_group_not_fully_eligible:{module}.{leaf}")
    for name, members in groups.items():
        if not all(by_module[member]["eligible"] for member in members):
            _drop(by_module, members, f"fused_group_not_fully_eligible:{name}")
    shared = {member: name for name, members in groups.items() for member in members}
    return {layer["key"]: shared.get(layer["module"], layer["module"]) for layer in layers if layer["eligible"]}


def _drop(by_module: dict[str, dict[str, Any]], members: list[str], reason: str) -> None:
    for member in members:
        if by_module[member]["eligible"]:
            by_module[member]["eligible"] = False
            by_module[member]["reasons"].append(reason)
