"""Which weights a model-free conversion quantizes, from the tensor headers and config.json alone.

The analysis walks a model built on the meta device; a model-free job has no model class, only names, dtypes and
shapes. This walk turns the headers into the same :class:`~converters.analysis.decision.LayerRecord` the analysis
makes and leaves the rules to :func:`~converters.analysis.decision.decide`. A stored tensor counts as a Linear's
weight when it is a 2-D floating ``*.weight`` that is not an embedding or a norm. The first and last Linear are
found by the order the analysis sees them in: decoder layer index, then attention before MLP and each block's
projections in the order model code defines them (q, k, v, o; gate, up, down), with the head (``lm_head``) last
even when it is tied and not stored. Fused groups (q/k/v, gate/up, an expert's w1/w3) and experts modules are
quantized whole or not at all, as :func:`converters.serving.selection.select_serving` decides.

Differences from the analysis: include/exclude match on-disk names (Mixtral's ``block_sparse_moe.experts.3.w1``,
not the loaded model's ``mlp.experts.3.gate_up_proj``), and an expert matrix's shape rule is checked per stored
matrix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from converters.analysis.decision import (
    DecisionOptions,
    LayerKind,
    LayerRecord,
    check_include,
    decide,
    is_router_name,
    with_groups,
)
from converters.analysis.patterns import check_patterns
from converters.analysis.reasons import Reason
from converters.recipes.requirements import FP8_RULE

__all__ = ["ModelFreeOptions", "TensorInfo", "order_key", "report_from_headers", "stored_records"]

_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"}
_EMBEDDINGS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings", "token_type_embeddings", "shared")
_HEADS = ("lm_head", "embed_out", "output")
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<leaf>[^.]+)$")
#: the order model code defines a block's projections in (what decides the first Linear of a layer)
_LEAF_ORDER = ("q_proj", "query", "qkv_proj", "query_key_value", "Wqkv", "c_attn", "k_proj", "key", "v_proj",
               "value", "o_proj", "out_proj", "dense", "c_proj", "gate_proj", "w1", "up_proj", "w3", "gate_up_proj",
               "fc1", "c_fc", "dense_h_to_4h", "down_proj", "w2", "fc2", "dense_4h_to_h")
#: model types whose 2-D projection weights belong to transformers' Conv1D, not nn.Linear
_CONV1D_MODEL_TYPES = ("gpt2",)


@dataclass(frozen=True, kw_only=True)
class ModelFreeOptions:
    """The selection of a model-free job (as :class:`~converters.analysis.eligibility.AnalysisOptions` has it), and
    whether its report measures what it wrote."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    #: each converted weight's SQNR in the report, read back from the tensors written: a pass over every weight and
    #: its codes that costs more CPU than the cast itself (docs/requantize.md); False writes the same bytes without it
    measure: bool = True

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            object.__setattr__(self, name, check_patterns(tuple(getattr(self, name)), name))
        for name in ("skip_first_last", "measure"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"include": list(self.include), "exclude": list(self.exclude), "skip_first_last": self.skip_first_last,
                "measure": self.measure}


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


def report_from_headers(tensors: list[TensorInfo], config: Mapping[str, Any], options: ModelFreeOptions,
                        fmt: Any, *, trained: Iterable[str] | None = None) -> dict[str, Any]:
    """The model-free eligibility report: every Linear-like weight eligible or with reasons, and what quantizes.

    ``fmt`` is the target format (its ``name`` and ``layer_rule(in_features, out_features)``, a reason or None).
    ``trained``: the modules a training run converted, for its serving export (``DecisionOptions.trained``).
    Returns a JSON-able dict: ``layers`` (module order), ``other`` (embeddings, norms, fused expert tensors),
    ``fused_groups``, ``quantized`` (weight key -> amax group: the key's module itself or its fused group).

    Raises:
        PatternError: an include pattern matches no Linear weight (``include[i]``).
    """
    records, other = stored_records(tensors, config)
    records, groups = with_groups(records)
    check_include(options.include, [record.name for record in records if record.kind is not LayerKind.CONV1D],
                  where="this checkpoint", noun="stored names")
    decisions = decide(records, DecisionOptions(
        format=fmt.name, shape_rule=FP8_RULE, include=options.include, exclude=options.exclude,
        skip_first_last=options.skip_first_last, format_rule=fmt.layer_rule, whole_groups=True,
        trained=trained))
    return {"options": options.to_dict(), "layers": [decision.to_stored_dict() for decision in decisions],
            "other": other,
            "quantized": {decision.record.key: decision.scale_group for decision in decisions if decision.eligible},
            "fused_groups": [{"name": name, "members": members} for name, members in groups.items()]}


def stored_records(tensors: list[TensorInfo], config: Mapping[str, Any]
                   ) -> tuple[list[LayerRecord], list[dict[str, Any]]]:
    """The Linear-like weights of the headers as records, in module order, and the other tensors the job keeps in
    high precision (``key``, ``shard``, ``reason``)."""
    # the modules holding experts (a list of them or fused tensors): a router is a gate beside them
    moe_blocks = {info.key.partition(".experts.")[0] for info in tensors if ".experts." in info.key}
    conv1d = config.get("model_type") in _CONV1D_MODEL_TYPES
    records, other = [], []
    for info in tensors:
        module, _, leaf = info.key.rpartition(".")
        if leaf != "weight" or info.dtype not in _FLOAT_DTYPES:
            continue
        reason = _kept_reason(info, module)
        if reason is not None:
            other.append({"key": info.key, "shard": info.shard, "reason": reason.value})
        elif len(info.shape) == 2:
            records.append(_record(info, module, moe_blocks, conv1d))
    records.sort(key=lambda record: order_key(record.name))
    return _with_ends(records, config), other


def _kept_reason(info: TensorInfo, module: str) -> Reason | None:
    """Why a stored floating weight is no Linear's: fused experts, an embedding, a norm; None for the others."""
    last = module.rpartition(".")[2]
    if len(info.shape) > 2 and "expert" in module:
        return Reason.FUSED_EXPERTS
    if len(info.shape) != 2:
        return None
    if any(word in last for word in _EMBEDDINGS) and last not in _HEADS:
        return Reason.EMBEDDING
    if "norm" in last.lower() or "ln" in last.split("_"):
        return Reason.NORM
    return None


def _record(info: TensorInfo, module: str, moe_blocks: set[str], conv1d: bool) -> LayerRecord:
    parent, _, last = module.rpartition(".")
    router = is_router_name(last) and parent in moe_blocks
    expert = None if router else _EXPERT.match(module)
    if router or expert:
        kind = LayerKind.EXPERT if expert else LayerKind.LINEAR
    else:
        kind = LayerKind.CONV1D if conv1d and last.startswith("c_") else LayerKind.LINEAR
    out_features, in_features = info.shape
    return LayerRecord(name=module, kind=kind, shape=tuple(info.shape), in_features=in_features,
                       out_features=out_features, dtype=info.dtype, parameters=in_features * out_features,
                       router=router, experts=expert["module"] if expert else None, key=info.key, shard=info.shard)


def _with_ends(records: list[LayerRecord], config: Mapping[str, Any]) -> list[LayerRecord]:
    """The first and last Linear and a tied head flagged; a head the files do not store (tied) is the last Linear,
    so no stored one is."""
    linears = [index for index, record in enumerate(records) if record.kind is LayerKind.LINEAR]
    tied = bool(config.get("tie_word_embeddings", False))
    heads = [index for index in linears if records[index].name.rpartition(".")[2] in _HEADS]
    records = [replace(records[index], tied=True) if tied and index in heads else records[index]
               for index in range(len(records))]
    if linears:
        records[linears[0]] = replace(records[linears[0]], first=True)
        if heads or not _has_head(config):
            records[linears[-1]] = replace(records[linears[-1]], last=True)
    return records


def _has_head(config: Mapping[str, Any]) -> bool:
    return any(str(name).endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
               for name in config.get("architectures") or [])
