"""The eligibility rules, once: layer records in, one :class:`LayerDecision` per record out.

Two walks describe a model's layers: the analysis walks a model built on the meta device
(:mod:`converters.analysis.eligibility`), a model-free job walks the safetensors headers
(:mod:`converters.modelfree.eligibility`). Each says what a layer *is* in a :class:`LayerRecord` (its name, weight
shape, features, dtype, whether it is an expert, a router, the first or last Linear, its fused group);
:func:`decide` applies the same rules to both and says whether it converts and why not, with
:class:`~converters.analysis.reasons.Reason` codes in a fixed order: not a Linear, unsupported expert layout,
shape, first, last, tied head, router gate, include, exclude; then the format's own shape rule; then, where groups
convert whole, the fused group or experts module a failing member holds back; then, for the serving export of a
training artifact (:mod:`converters.sync`), what training did not convert and the fused groups it converted in part.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from converters.analysis.patterns import PatternError, check_patterns, matches
from converters.analysis.reasons import Reason

if TYPE_CHECKING:  # converters.model.experts imports torch; the rules need none
    from converters.model.experts import ExpertUnit

__all__ = ["FUSED_GROUPS", "ROUTER_NAMES", "DecisionOptions", "LayerDecision", "LayerKind", "LayerRecord",
           "check_include", "decide", "fused_groups", "is_router_name", "with_groups"]

#: Sibling projections that inference engines and TE fuse into one GEMM: a group must agree.
FUSED_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "bert_qkv": ("query", "key", "value"),
    "w1_w3": ("w1", "w3"),
    # DeepSeek-V2/V3 MLA with q_lora_rank: vLLM loads both into one fused_qkv_a_proj
    "mla_qkv_a": ("q_a_proj", "kv_a_proj_with_mqa"),
}
#: Linear names that are an MoE block's router when they sit beside its ``experts`` (any name with ``router`` too)
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
#: the reasons of a layer eligible itself but held back by its unit, which they name (``code:unit``)
_HELD = (Reason.FUSED_GROUP_PARTIAL, Reason.FUSED_GROUP_NOT_CONVERTED)


class LayerKind(str, enum.Enum):
    """What a record describes."""

    LINEAR = "linear"  #: an ``nn.Linear``, or a stored 2-D weight taken for one
    EXPERT = "expert"  #: one expert's GEMM (of a fused experts module, or one stored expert matrix)
    CONV1D = "conv1d"  #: a transformers ``Conv1D`` (GPT-2 style): listed, never converted


@dataclass(frozen=True, kw_only=True)
class LayerRecord:
    """One layer as a walk found it: the facts the rules read, nothing decided yet.

    Attributes:
        name: module path (analysis) or stored module name (the weight's key less ``.weight``).
        kind: see :class:`LayerKind`.
        shape: the weight's shape as held (``[out, in]`` for a Linear, ``[in, out]`` for a Conv1D).
        in_features, out_features: the GEMM's dims, which the shape rules read.
        dtype: the weight's dtype name (torch's in the analysis, the header's in a model-free job).
        parameters: weight (and bias) elements.
        first, last: the first / last Linear of the model in module order.
        tied: an output head sharing its weight with the input embedding.
        router: an MoE router gate.
        layout_supported: False for an experts module whose layout fp8forge does not convert.
        group: the fused group (``FUSED_GROUPS``) it is a member of.
        experts: the experts module it is one GEMM of (converted whole or not at all where groups convert whole).
        cls: the module's class name (analysis). expert: which expert GEMM unit (analysis of a fused experts module).
        key, shard: the stored weight's key and shard file (model-free).
    """

    name: str
    kind: LayerKind
    shape: tuple[int, ...]
    in_features: int
    out_features: int
    dtype: str
    parameters: int
    first: bool = False
    last: bool = False
    tied: bool = False
    router: bool = False
    layout_supported: bool = True
    group: str | None = None
    experts: str | None = None
    cls: str | None = None
    expert: ExpertUnit | None = None
    key: str | None = None
    shard: str | None = None


@dataclass(frozen=True, kw_only=True)
class DecisionOptions:
    """The rules' settings: the user's selection and the rules of the format converted to.

    Attributes:
        format: the recipe's library class or the serving format's name the decisions are for.
        shape_rule: the recipe's shape rule (``fails(in, out)`` and ``reason``; converters.recipes.requirements).
        include, exclude, skip_first_last, convert_router_gates: as :class:`~converters.analysis.eligibility.
            AnalysisOptions` has them.
        format_rule: a serving format's own shape rule, ``(in_features, out_features) -> reason code or None``,
            applied to layers the other rules let through.
        whole_groups: a fused group and an experts module convert whole or not at all (what a serving checkpoint
            needs); the analysis lists partial groups instead and leaves the choice to each export.
        trained: the modules a training run converted, where the decisions are for its serving export (which may
            cast only what training ran in FP8): any other layer stays in high precision
            (``NOT_CONVERTED_IN_TRAINING``), an expert always does (``EXPERTS_NOT_SYNCED``: no training library here
            converts experts), and so does every member of a fused group training converted in part
            (``FUSED_GROUP_NOT_CONVERTED``). Needs ``whole_groups``. None: no training run is asked about.
    """

    format: str
    shape_rule: Any
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    convert_router_gates: bool = False
    format_rule: Callable[[int, int], str | None] | None = None
    whole_groups: bool = False
    trained: frozenset[str] | None = None  # any collection of names: kept as a frozenset

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            object.__setattr__(self, name, check_patterns(tuple(getattr(self, name)), name))
        for name in ("skip_first_last", "convert_router_gates", "whole_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (callable(getattr(self.shape_rule, "fails", None)) and isinstance(self.shape_rule.reason, str)):
            raise ValueError(f"shape_rule must be a ShapeRule (fails(), reason), got {self.shape_rule!r}")
        if self.format_rule is not None and not callable(self.format_rule):
            raise ValueError(f"format_rule must be callable or None, got {self.format_rule!r}")
        if self.trained is not None:
            # a lone string would pass as an iterable of one-letter module names
            if isinstance(self.trained, str) or not all(isinstance(name, str) for name in self.trained):
                raise ValueError(f"trained must be a collection of module names, got {self.trained!r}")
            if not self.whole_groups:
                raise ValueError("trained needs whole_groups: a serving export converts fused groups whole")
            object.__setattr__(self, "trained", frozenset(self.trained))


@dataclass(frozen=True, kw_only=True)
class LayerDecision:
    """Whether one layer converts, and why not.

    Attributes:
        record: the layer as the walk found it (name, shape, features, group).
        format: as :attr:`DecisionOptions.format`.
        reasons: the codes that keep it in high precision; none when it converts.
        held_back_by: the fused group or experts GEMM named by a ``FUSED_GROUP_PARTIAL`` or
            ``FUSED_GROUP_NOT_CONVERTED`` reason.
        format_rule: what the format's own shape rule says of the layer's dims (recorded for every layer).
        scale_group: where it converts, the name its weight scale is computed under (its fused group's, else its
            own); None otherwise.
    """

    record: LayerRecord
    format: str
    reasons: tuple[Reason, ...]
    held_back_by: str | None = None
    format_rule: Reason | None = None
    scale_group: str | None = None

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.record.shape

    @property
    def group(self) -> str | None:
        return self.record.group

    @property
    def eligible(self) -> bool:
        return not self.reasons

    def reason_codes(self) -> list[str]:
        """The reasons as the reports write them (a held-back member names its group: ``code:group``)."""
        return [reason.at(self.held_back_by) if reason in _HELD and self.held_back_by else reason.value
                for reason in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        """The analysis report's layer row (keys and order are the report's, version 1)."""
        record = self.record
        row = {"path": record.name, "class": record.cls, "in_features": record.in_features,
               "out_features": record.out_features, "parameters": record.parameters, "dtype": record.dtype,
               "eligible": self.eligible, "reasons": self.reason_codes(), "group": record.group}
        if record.expert is not None:
            # the report groups an expert GEMM with the same GEMM of the module's other experts: one grouped GEMM
            row["group"] = f"{record.expert.module}.{record.expert.gemm}"
            row["expert"] = asdict(record.expert)
        return row

    def to_stored_dict(self) -> dict[str, Any]:
        """The model-free report's layer row, a stored weight (keys and order are the requantize report's)."""
        record = self.record
        return {"key": record.key, "shard": record.shard, "dtype": record.dtype, "shape": list(record.shape),
                "module": record.name, "kind": "expert" if record.kind is LayerKind.EXPERT else "linear",
                "in_features": record.in_features, "out_features": record.out_features,
                "reasons": self.reason_codes(),
                "format_rule": None if self.format_rule is None else self.format_rule.value, "group": record.group,
                "eligible": self.eligible}


def is_router_name(leaf: str) -> bool:
    """True for a Linear named like an MoE router (a router only where it sits beside the block's experts)."""
    return leaf in ROUTER_NAMES or "router" in leaf


def fused_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Group name -> member names of every ``FUSED_GROUPS`` set whose members are all among ``names``, in the
    order the groups' first members come (``model.layers.0.self_attn.qkv`` for q/k/v siblings)."""
    present = list(names)
    known = set(present)
    groups: dict[str, list[str]] = {}
    for name in present:
        parent, _, leaf = name.rpartition(".")
        for kind, members in FUSED_GROUPS.items():
            paths = [f"{parent}.{member}" if parent else member for member in members]
            if leaf == members[0] and all(path in known for path in paths):
                groups[f"{parent}.{kind}" if parent else kind] = paths
    return groups


def with_groups(records: Sequence[LayerRecord]) -> tuple[list[LayerRecord], dict[str, list[str]]]:
    """``records`` with their fused group set (see :func:`fused_groups`), and the groups."""
    groups = fused_groups(record.name for record in records)
    group_of = {member: group for group, members in groups.items() for member in members}
    return [replace(record, group=group_of.get(record.name, record.group)) for record in records], groups


def check_include(include: Sequence[str], names: Sequence[str], *, where: str, noun: str) -> None:
    """Refuse an include pattern that selects none of ``names`` (the Linear layers of ``where``, Conv1D left
    out): it is a typo or belongs to another model, and would leave the layers it meant to select unconverted
    without a word.

    Raises:
        PatternError: naming ``include[i]`` and the pattern, with one of the ``names`` (``noun``) as an example.
    """
    for index, pattern in enumerate(include):
        if any(matches(pattern, name) for name in names):
            continue
        example = f"its Linear layers have {noun} like {names[len(names) // 2]!r}" if names else "it has no Linear"
        raise PatternError(f"include[{index}]: pattern {pattern!r} matches no Linear layer of {where} ({example}); "
                           f"patterns match whole dotted segments of the {noun}", field=f"include[{index}]")


def decide(records: Sequence[LayerRecord], options: DecisionOptions) -> list[LayerDecision]:
    """One decision per record, in the records' order (see the module's docstring for the rules and their order).

    Raises:
        ValueError: a format rule answered with a code that is not a :class:`Reason`.
    """
    reasons = {record.name: _own_reasons(record, options) for record in records}
    format_rules = {record.name: _format_rule(record, options) for record in records}
    for record in records:
        if not reasons[record.name] and format_rules[record.name] is not None:
            reasons[record.name].append(format_rules[record.name])
    held = _held_back(records, reasons) if options.whole_groups else {}
    if options.trained is not None:
        held.update(_not_trained(records, reasons, options.trained))
    whole = {group for group, members in _members(records, "group").items()
             if all(not reasons[member] for member in members)}
    return [LayerDecision(record=record, format=options.format, reasons=tuple(reasons[record.name]),
                          held_back_by=held.get(record.name), format_rule=format_rules[record.name],
                          scale_group=None if reasons[record.name] else
                          record.group if record.group in whole else record.name)
            for record in records]


def _own_reasons(record: LayerRecord, options: DecisionOptions) -> list[Reason]:
    """The rules that read one record alone."""
    if record.kind is LayerKind.CONV1D:
        return [Reason.NOT_LINEAR]
    checks = [
        (not record.layout_supported, Reason.EXPERT_LAYOUT),
        (options.shape_rule.fails(record.in_features, record.out_features), Reason(options.shape_rule.reason)),
        (options.skip_first_last and record.first, Reason.FIRST_LINEAR),
        (options.skip_first_last and record.last, Reason.LAST_LINEAR),
        (record.tied, Reason.TIED_HEAD),
        (record.router and not options.convert_router_gates, Reason.ROUTER_GATE),
        (bool(options.include) and not any(matches(pattern, record.name) for pattern in options.include),
         Reason.NOT_INCLUDED),
        (any(matches(pattern, record.name) for pattern in options.exclude), Reason.EXCLUDED),
    ]
    return [reason for failed, reason in checks if failed]


def _format_rule(record: LayerRecord, options: DecisionOptions) -> Reason | None:
    if options.format_rule is None:
        return None
    code = options.format_rule(record.in_features, record.out_features)
    return None if code is None else Reason(code)


def _members(records: Sequence[LayerRecord], field: str) -> dict[str, list[str]]:
    """``group`` or ``experts`` -> the names of its members, in record order."""
    members: dict[str, list[str]] = {}
    for record in records:
        if getattr(record, field) is not None:
            members.setdefault(getattr(record, field), []).append(record.name)
    return members


def _held_back(records: Sequence[LayerRecord], reasons: dict[str, list[Reason]]) -> dict[str, str]:
    """Member -> the unit it is held back by. An experts module converts whole (an engine runs it as one fused MoE
    layer of one scheme; the unit named is the first failing member's GEMM); then each fused group does."""
    held: dict[str, str] = {}
    for module, members in _members(records, "experts").items():
        failed = next((member for member in members if reasons[member]), None)
        if failed is not None:
            _hold(members, f"{module}.{failed.rpartition('.')[2]}", reasons, held)
    for group, members in _members(records, "group").items():
        if any(reasons[member] for member in members):
            _hold(members, group, reasons, held)
    return held


def _not_trained(records: Sequence[LayerRecord], reasons: dict[str, list[Reason]], trained: frozenset[str]
                 ) -> dict[str, str]:
    """The training run's reasons (after the others: a serving export of it reports them last), then member ->
    the fused group that training converted in part: an engine would run the group's GEMM in one scheme, and
    training ran some members in FP8 and some not."""
    for record in records:
        if record.kind is LayerKind.EXPERT:
            reasons[record.name].append(Reason.EXPERTS_NOT_SYNCED)
        elif record.name not in trained:
            reasons[record.name].append(Reason.NOT_CONVERTED_IN_TRAINING)
    held: dict[str, str] = {}
    for group, members in _members(records, "group").items():
        if any(reasons[member] for member in members):
            _hold(members, group, reasons, held, Reason.FUSED_GROUP_NOT_CONVERTED)
    return held


def _hold(members: list[str], unit: str, reasons: dict[str, list[Reason]], held: dict[str, str],
          reason: Reason = Reason.FUSED_GROUP_PARTIAL) -> None:
    for member in members:
        if not reasons[member]:
            reasons[member].append(reason)
            held[member] = unit
