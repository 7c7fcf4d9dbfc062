"""Load audit of a serving export: would vLLM use every tensor, with the scheme the files claim?

:func:`audit_export` replays, on CPU and from the safetensors headers and ``config.json`` alone (no weight is
read), the rules vLLM applies when it builds the model for a quantization config and loads a checkpoint
into it. Each broken rule is a :class:`Problem` with a :class:`Rule` code, the tensor or module it concerns,
what the engine would do and how to fix it.

Neither vLLM nor SGLang installs on this CPU-only machine: vLLM 0.33.0 pins ``torch==2.14.0`` and pulls CUDA 13
wheels (cuda-toolkit, nvidia-cublas, triton), SGLang 0.5.23 pins ``torch==2.14.1``, ``flashinfer_python[cu13]``
and ``sglang-kernel``; the project runs torch 2.13 CPU. So the rules are restated here, from vLLM v0.33.0
(git ``4ba787ec9``, the commit recorded in the wheel's ``vllm/_version.py``; paths under ``vllm/model_executor``):

- Name mapping (:data:`Rule.SCALE_DROPPED`): ``models/utils.py`` ``WeightsMapper`` and
  ``AutoWeightsLoader.load_weights`` (an unknown name raises, except the KV-scale suffixes of
  ``layers/quantization/base_config.py`` ``_ignore_unexpected_suffixes``, which are dropped silently);
  ``QuantizationConfig.get_cache_scale_mapper`` there and ``Fp8Config.get_cache_scale_mapper`` in
  ``layers/quantization/fp8.py`` (``.self_attn.k_scale -> .self_attn.attn.k_scale``, ``.k_proj.output_scale``,
  ...); the same rules as ``model_loader/weight_utils.py`` ``maybe_remap_kv_scale_name``; each model's
  ``hf_to_vllm_mapper.orig_to_new_stacked`` / ``packed_modules_mapping`` (``models/llama.py``, ``qwen2.py``,
  ``mixtral.py``, ``qwen2_moe.py``, ``qwen3_moe.py``, ``bert.py``); experts from
  ``layers/fused_moe/routed_experts.py`` ``build_expert_params_mapping`` (``experts.<e>.<ckpt>.`` ->
  ``experts.w13_`` / ``w2_``). Parameters per scheme: ``compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py``
  and ``compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py`` (``weight``, ``weight_scale``,
  ``input_scale`` when static), ``fp8.py`` ``Fp8LinearMethod`` / ``Fp8MoEMethod`` (``weight_scale_inv`` for
  blocks). Routers are ``GateLinear`` and Qwen's ``shared_expert_gate`` a ``ReplicatedLinear`` built without a
  quant config: never quantized, whatever the config says.
- Fused shards (:data:`Rule.PARTLY_QUANTIZED_FUSED_GROUP`, :data:`Rule.PARTLY_IGNORED_FUSED_GROUP`):
  ``layers/quantization/compressed_tensors/utils.py`` ``should_ignore_layer`` and
  ``layers/quantization/utils/quant_utils.py`` ``is_layer_skipped`` (both raise on shards that disagree).
- Ignore lists (:data:`Rule.IGNORED_MODULE_MISSING`, :data:`Rule.UNQUANTIZED_NOT_IGNORED`,
  :data:`Rule.QUANTIZED_BUT_IGNORED`): the same two functions plus ``find_matched_target`` (``re:`` entries use
  ``re.match``; a class-name target matches by substring, so ``Linear`` covers every ``*Linear`` and the fused
  MoE layer); ``compressed_tensors_moe/compressed_tensors_moe.py`` ``get_moe_method`` asks about an experts
  module through ``<prefix>.0.<gate|up|down>``; entries are renamed by ``hf_to_vllm_mapper.get_rename_mapper()``.
- Scheme completeness (:data:`Rule.MISSING_SCALE`, :data:`Rule.WRONG_SCALE_SHAPE`,
  :data:`Rule.WRONG_SCALE_DTYPE`): ``create_fp8_scale_parameter`` / ``create_fp8_input_scale`` shapes (one
  per-tensor scale per shard, ``[out, 1]`` per channel, ``[ceil(out/bn), ceil(in/bk)]`` per block).

Formats without rules here (nvfp4, mxfp8, ModelOpt, anything new) are not passed: the result says
``audited=False`` with a note naming the format.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from converters.model.files import INDEX_NAME
from converters.model.safetensors_stream import SourceTensor, read_tensor_index

__all__ = ["AuditResult", "Problem", "Rule", "audit_export"]

logger = logging.getLogger(__name__)

FP8 = "F8_E4M3"
FLOAT_SCALES = ("F32", "BF16", "F16")
KV_SUFFIXES = ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale")
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "output_scale", "weight_scale_2",
                  "weight_global_scale", "input_global_scale", *KV_SUFFIXES)
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


class Rule(str, Enum):
    """What a problem breaks; each member says what vLLM does with such a checkpoint."""

    SCALE_DROPPED = "scale_dropped"  #: maps to no parameter: load error, or (KV scales) ignored -> scale 1.0
    PARTLY_QUANTIZED_FUSED_GROUP = "partly_quantized_fused_group"  #: FP8 and high-precision shards in one fused layer
    PARTLY_IGNORED_FUSED_GROUP = "partly_ignored_fused_group"  #: ignore list names some shards of a fused layer
    IGNORED_MODULE_MISSING = "ignored_module_missing"  #: an ignore entry matches no module of the checkpoint
    UNQUANTIZED_NOT_IGNORED = "unquantized_not_ignored"  #: engine builds FP8 params for a high-precision weight
    QUANTIZED_BUT_IGNORED = "quantized_but_ignored"  #: engine builds high-precision params for an FP8 weight
    MISSING_SCALE = "missing_scale"  #: a quantized weight lacks a scale its scheme needs
    WRONG_SCALE_SHAPE = "wrong_scale_shape"  #: a scale's shape is not the one its scheme creates
    WRONG_SCALE_DTYPE = "wrong_scale_dtype"  #: a scale is not a float tensor


@dataclass(frozen=True, kw_only=True)
class Problem:
    rule: Rule
    name: str  #: checkpoint tensor or module (or vLLM fused layer) it concerns
    message: str  #: what the engine would do, and how to fix it


@dataclass(kw_only=True)
class AuditResult:
    format: str  #: quant_method (and format) read from config.json
    audited: bool  #: False when the format has no rules here (see ``notes``)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    scales_checked: int = 0
    kv_scales_found: int = 0

    @property
    def ok(self) -> bool:
        """Audited and no problem found."""
        return self.audited and not self.problems

    def rules(self) -> set[Rule]:
        return {problem.rule for problem in self.problems}

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "audited": self.audited, "ok": self.ok, "notes": self.notes,
                "tensors_checked": self.tensors_checked, "scales_checked": self.scales_checked,
                "kv_scales_found": self.kv_scales_found,
                "problems": [{"rule": p.rule.value, "name": p.name, "message": p.message} for p in self.problems]}


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """How vLLM names one model family's layers (its ``packed_modules_mapping`` and expert checkpoint names)."""

    packed: dict[str, tuple[str, ...]]  #: fused layer -> its checkpoint shards, in order
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  #: ckpt gate, up, down names
    renames: tuple[tuple[str, str], ...] = ()  #: rename-mapper substrings applied to ignore entries
    never_quantized: tuple[str, ...] = ()  #: module-name regexes vLLM builds with ``quant_config=None``


_DENSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_QWEN_MOE = Architecture(packed=_DENSE, never_quantized=(r".*\.mlp\.gate$", r".*\.shared_expert_gate$"))
ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture(packed=_DENSE) for name in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")},
    "MixtralForCausalLM": Architecture(
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")}, experts=("w1", "w3", "w2"),
        renames=((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")),
        never_quantized=(r".*\.block_sparse_moe\.gate$",)),
    "Qwen2MoeForCausalLM": _QWEN_MOE,
    "Qwen3MoeForCausalLM": _QWEN_MOE,
    "BertModel": Architecture(packed={"qkv_proj": ("query", "key", "value")}),
}
# Modules vLLM builds as embeddings or ParallelLMHead, never as LinearBase: the FP8 Linear schemes skip them.
_NOT_LINEAR = re.compile(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|position_embeddings|"
                         r"token_type_embeddings|embed_positions|lm_head|embed_out)$")


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """The parameters vLLM creates for one FP8 Linear (or experts) scheme."""

    scale: str  #: ``weight_scale`` or ``weight_scale_inv``
    strategy: str  #: tensor, channel or block
    static_input: bool
    block: tuple[int, int] | None = None

    def params(self) -> tuple[str, ...]:
        return ("weight", self.scale, *(("input_scale",) if self.static_input else ()))

    def scale_shape(self, out_features: int, in_features: int) -> tuple[tuple[int, ...], ...]:
        """The weight-scale shapes the loader accepts for one checkpoint shard."""
        if self.strategy == "tensor":
            return (1,), ()
        if self.strategy == "channel":
            return (out_features, 1), (out_features,)
        rows, columns = self.block or (128, 128)
        return ((math.ceil(out_features / rows), math.ceil(in_features / columns)),)


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """The parts of ``quantization_config`` vLLM's load decisions depend on."""

    kind: str  #: compressed-tensors or fp8
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]  #: (targets, scheme) per config group
    ignore: tuple[str, ...]
    kv_cache: bool  #: the config declares KV-cache quantization


def audit_export(directory: Path) -> AuditResult:
    """Replay vLLM's loading rules on a serving export (headers and config only) and list what it would not use.

    Args:
        directory: a serving checkpoint: ``config.json`` with ``quantization_config``, safetensors shards and
            ``model.safetensors.index.json`` when sharded.

    Returns:
        The problems found; ``audited`` is False (with a note) for formats the audit has no rules for.

    Raises:
        ModelNotFoundError: a safetensors file is malformed.
        FileNotFoundError: ``config.json`` or a shard named by the index is missing.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    tensors = _read_headers(directory)
    raw = config.get("quantization_config") or {}
    name = "/".join(str(raw[key]) for key in ("quant_method", "format") if raw.get(key)) or "none"
    result = AuditResult(format=name, audited=False, tensors_checked=len(tensors))
    result.scales_checked = sum(1 for key in tensors if key.rpartition(".")[2] in SCALE_SUFFIXES)
    quant, reason = _parse_quant_config(raw, directory)
    if quant is None:
        result.notes.append(f"not audited: {reason}")
        return result
    architecture = (config.get("architectures") or ["?"])[0]
    arch = ARCHITECTURES.get(architecture)
    if arch is None:
        arch = ARCHITECTURES["LlamaForCausalLM"]
        result.notes.append(f"architecture {architecture!r} has no entry in the audit's table: Llama's fused "
                            "layers (qkv_proj, gate_up_proj) assumed")
    result.audited = True
    _Audit(tensors, quant, arch, result).run()
    return result


def _read_headers(directory: Path) -> dict[str, SourceTensor]:
    index = directory / INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        paths = [directory / file for file in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    tensors: dict[str, SourceTensor] = {}
    for path in paths:
        tensors.update(read_tensor_index(path)[0])
    return tensors


def _parse_quant_config(raw: dict[str, Any], directory: Path) -> tuple[QuantConfig | None, str]:
    """The config as vLLM reads it, or None and why the audit has no rules for it."""
    method = raw.get("quant_method")
    if (directory / "hf_quant_config.json").is_file() or str(method).startswith("modelopt"):
        return None, "ModelOpt checkpoints (hf_quant_config.json) have no rules in this audit yet"
    if method == "fp8":
        block = raw.get("weight_block_size")
        scheme = Scheme(scale="weight_scale_inv" if block else "weight_scale", strategy="block" if block else "tensor",
                        static_input=raw.get("activation_scheme") == "static", block=tuple(block) if block else None)
        ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
        return QuantConfig(kind="fp8", groups=((("Linear",), scheme),), ignore=tuple(ignore),
                           kv_cache=raw.get("kv_cache_scheme") is not None), ""
    if method != "compressed-tensors":
        return None, f"quant_method {method!r} has no rules in this audit (known: compressed-tensors FP8, fp8)"
    groups = []
    for group_name, group in (raw.get("config_groups") or {}).items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        group_format = group.get("format") or raw.get("format")
        if group_format != "float-quantized" or weights.get("type") != "float" or weights.get("num_bits") != 8:
            return None, (f"compressed-tensors group {group_name!r} is {group_format} {weights.get('type')}"
                          f"{weights.get('num_bits')}: only float-quantized FP8 has rules in this audit")
        strategy = weights.get("strategy")
        block = weights.get("block_structure")
        static = bool(inputs) and not inputs.get("dynamic")
        scheme = Scheme(scale="weight_scale", strategy=strategy, static_input=static,
                        block=tuple(block) if block else None)
        groups.append((tuple(group.get("targets") or ()), scheme))
    return QuantConfig(kind="compressed-tensors", groups=tuple(groups), ignore=tuple(raw.get("ignore") or ()),
                       kv_cache=raw.get("kv_cache_scheme") is not None), ""


# vLLM's cache-scale mappers, applied in this order to every name (base_config.py, then fp8.py's suffixes).
_KV_REGEX = (
    (re.compile(r"\.kv_scale$"), ".attn.k_scale"),
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
)
_FP8_KV_SUFFIX = ((".k_proj.output_scale", ".attn.k_scale"), (".v_proj.output_scale", ".attn.v_scale"),
                  (".q_proj.output_scale", ".attn.q_scale"),
                  (".self_attn.prob_output_scale", ".self_attn.attn.prob_scale"))


def _is_match(name: str, entry: str) -> bool:
    """compressed-tensors' ``_is_equal_or_regex_match``: ``re:`` entries by ``re.match``, others by equality."""
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


class _Audit:
    """One audit run: the checkpoint's modules grouped into the layers vLLM builds, then each rule in turn."""

    def __init__(self, tensors: dict[str, SourceTensor], quant: QuantConfig, arch: Architecture,
                 result: AuditResult) -> None:
        self.tensors, self.quant, self.arch, self.result = tensors, quant, arch, result
        self.member_of = {member: fused for fused, members in arch.packed.items() for member in members}
        self.ignore = tuple(self._rename(entry) for entry in quant.ignore)
        self.kv_keys = [key for key in tensors if self._is_kv(key)]
        self.handled = set(self.kv_keys)
        self.modules: dict[str, dict[str, SourceTensor]] = {}
        for key, tensor in tensors.items():
            if key not in self.handled:
                module, _, suffix = key.rpartition(".")
                self.modules.setdefault(module, {})[suffix] = tensor

    def problem(self, rule: Rule, name: str, message: str) -> None:
        self.result.problems.append(Problem(rule=rule, name=name, message=message))

    def run(self) -> None:
        layers, experts = self._layers()
        self._check_ignore_entries(layers, experts)
        for fused, members in layers.items():
            self._check_layer(fused, members)
        for prefix, matrices in experts.items():
            self._check_experts(prefix, matrices)
        self._check_kv_scales({fused.rpartition(".")[0] for fused in layers if fused.endswith(".qkv_proj")})
        for key in self.tensors:
            if key not in self.handled and "scale" in key.rpartition(".")[2]:
                self.problem(Rule.SCALE_DROPPED, key, f"{key} belongs to no layer vLLM quantizes (it builds "
                             f"{key.rpartition('.')[0]} without FP8 parameters): the loader rejects the name "
                             "('no module or parameter named'). Drop the tensor, or quantize that layer.")

    def _rename(self, entry: str) -> str:
        if entry.startswith("re:") or "." not in entry:
            return entry
        for old, new in self.arch.renames:
            entry = entry.replace(old, new, 1)
        return entry

    def _is_kv(self, key: str) -> bool:
        suffix = key.rpartition(".")[2]
        return suffix in KV_SUFFIXES or (self.quant.kind == "fp8" and key.endswith(
            tuple(old for old, _ in _FP8_KV_SUFFIX)))

    def _layers(self) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
        """vLLM Linear layers (fused name -> checkpoint modules) and experts (prefix -> ckpt matrix -> 'w13'/'w2')."""
        gate, up, _ = self.arch.experts
        w13 = {gate, up, *(old.strip(".") for old, new in self.arch.renames if new.strip(".") in (gate, up))}
        layers: dict[str, list[str]] = {}
        experts: dict[str, dict[str, str]] = {}
        for module, tensors in self.modules.items():
            weight = tensors.get("weight")
            if weight is None or len(weight.shape) != 2 or _NOT_LINEAR.search(module) \
                    or any(re.match(pattern, module) for pattern in self.arch.never_quantized):
                continue
            expert = _EXPERT.match(module)
            if expert:
                experts.setdefault(expert["prefix"], {})[module] = "w13" if expert["proj"] in w13 else "w2"
                continue
            parent, _, proj = module.rpartition(".")
            fused = f"{parent}.{self.member_of[proj]}" if proj in self.member_of else module
            layers.setdefault(fused, []).append(module)
        return layers, experts

    def _ignored(self, name: str) -> bool | None:
        """Whether vLLM skips layer ``name`` (None: its shards disagree, and vLLM raises)."""
        proj = name.rpartition(".")[2]
        if self.quant.kind == "fp8":
            if proj in self.arch.packed and name in self.ignore:
                return True
            if "experts" in name and proj not in self.arch.packed:
                return any(name in entry for entry in self.ignore if "experts" in entry)
            match = lambda shard: shard in self.ignore  # noqa: E731
        else:
            match = lambda shard: any(_is_match(shard, entry) for entry in self.ignore)  # noqa: E731
        if proj in self.arch.packed and name not in self.ignore:
            answers = {match(name.replace(proj, shard)) for shard in self.arch.packed[proj]}
            return answers.pop() if len(answers) == 1 else None
        return match(name)

    def _scheme_for(self, name: str) -> Scheme | None:
        """The config group vLLM gives layer ``name`` (class name ``*Linear``), ignoring the ignore list."""
        proj = name.rpartition(".")[2]
        for targets, scheme in self.quant.groups:
            # vLLM's second try matches the module's class name by substring; every layer here is a *Linear
            # (or the fused MoE layer, which compressed-tensors maps onto the Linear target).
            if any(_is_match(name, target) or (not target.startswith("re:") and target.lower() in "linear")
                   for target in targets):
                return scheme
            shards = self.arch.packed.get(proj, ())
            if shards and all(any(_is_match(name.replace(proj, shard), target) for target in targets)
                              for shard in shards):
                return scheme
        return None

    def _check_ignore_entries(self, layers: dict[str, list[str]], experts: dict[str, dict[str, str]]) -> None:
        names = [*self.modules, *layers, *experts]
        for original, entry in zip(self.quant.ignore, self.ignore, strict=True):
            if self.quant.kind == "fp8":
                found = entry in names or ("experts" in entry and any(prefix in entry for prefix in experts))
            else:
                found = any(_is_match(name, entry) for name in names)
            if not found:
                self.problem(Rule.IGNORED_MODULE_MISSING, original,
                             f"ignore entry {original!r} matches no module of the checkpoint (nor a fused name such "
                             "as ...qkv_proj): vLLM skips nothing for it, so the layer it was meant to keep in high "
                             "precision gets FP8 parameters. Fix the name (vLLM compares full module names, 're:' "
                             "entries with re.match) or drop the entry.")

    def _check_layer(self, fused: str, members: list[str]) -> None:
        quantized = {member: self.modules[member]["weight"].dtype == FP8 for member in members}
        if len(set(quantized.values())) > 1:
            fp8 = [member for member, is_fp8 in quantized.items() if is_fp8]
            self.problem(Rule.PARTLY_QUANTIZED_FUSED_GROUP, fused,
                         f"vLLM loads {', '.join(members)} into one fused layer {fused} of one scheme, but only "
                         f"{', '.join(fp8)} is FP8: the other shards would be cast or rejected. Quantize all of "
                         "them or none (and list the high-precision ones in the ignore list together).")
        ignored = self._ignored(fused)
        if ignored is None:
            self.problem(Rule.PARTLY_IGNORED_FUSED_GROUP, fused,
                         f"the ignore list names some but not all shards of {fused} ({', '.join(members)}): vLLM "
                         "raises 'requires all to use the same scheme' while building the model. List all or none.")
            self.handled.update(f"{member}.{suffix}" for member in members for suffix in self.modules[member])
            return
        scheme = None if ignored else self._scheme_for(fused)
        for member in members:
            self._check_member(member, fused, scheme, quantized[member], ignored, prefix="")

    def _check_member(self, member: str, layer: str, scheme: Scheme | None, is_fp8: bool, ignored: bool,
                      prefix: str) -> None:
        """One checkpoint module's weight against the parameters vLLM creates for ``layer`` (``prefix``: w13_/w2_)."""
        tensors = self.modules[member]
        if scheme is not None and not is_fp8:
            self.problem(Rule.UNQUANTIZED_NOT_IGNORED, member,
                         f"{member}.weight is {tensors['weight'].dtype} but no ignore entry covers it: vLLM builds "
                         f"{layer} with FP8 parameters and would cast the weight to FP8 with no scale (garbage "
                         f"output or a load error). Add {member!r} to the ignore list, or quantize it.")
        if scheme is None and is_fp8:
            why = "an ignore entry matches it" if ignored else "no config group targets it"
            self.problem(Rule.QUANTIZED_BUT_IGNORED, member,
                         f"{member}.weight is FP8 but {why}: vLLM builds {layer} in high precision and would read "
                         "the FP8 bytes as plain numbers without their scale. Remove it from the ignore list (or "
                         "add a target), or export it unquantized.")
        params = {"weight", "bias", *(scheme.params() if scheme else ())}
        for suffix in tensors:
            key = f"{member}.{suffix}"
            self.handled.add(key)
            if suffix not in params:
                kind = f"the {scheme.strategy} FP8 scheme" if scheme else "a high-precision layer"
                self.problem(Rule.SCALE_DROPPED, key,
                             f"{key} maps to {layer}.{prefix}{suffix}, which vLLM does not create for {kind}: the "
                             f"loader rejects it ('no module or parameter named'); were it skipped, the layer would "
                             f"run with scale 1.0. Write it as one of {sorted(prefix + p for p in params)}.")
        config_scheme = scheme or self._scheme_for(layer)
        if is_fp8 and config_scheme is not None:
            self._check_scales(member, config_scheme)

    def _check_scales(self, member: str, scheme: Scheme) -> None:
        tensors = self.modules[member]
        out_features, in_features = tensors["weight"].shape
        for name in scheme.params()[1:]:
            key = f"{member}.{name}"
            tensor = tensors.get(name)
            if tensor is None:
                self.problem(Rule.MISSING_SCALE, key,
                             f"{member}.weight is FP8 ({scheme.strategy}) but {key} is missing: vLLM leaves that "
                             "parameter uninitialized (or refuses to load). Write the scale.")
                continue
            shapes = scheme.scale_shape(out_features, in_features) if name == scheme.scale else ((1,), ())
            if tensor.dtype not in FLOAT_SCALES:
                self.problem(Rule.WRONG_SCALE_DTYPE, key, f"{key} is {tensor.dtype}; vLLM's scale parameters "
                             "are float32 and need a float scale (F32, BF16 or F16). Write it as F32.")
            elif tuple(tensor.shape) not in shapes:
                self.problem(Rule.WRONG_SCALE_SHAPE, key,
                             f"{key} has shape {list(tensor.shape)}, but the {scheme.strategy} scheme makes vLLM "
                             f"create {list(shapes[0])} for a [{out_features}, {in_features}] weight: the weight "
                             "loader fails on the size mismatch. Recompute the scale for this scheme.")

    def _check_experts(self, prefix: str, matrices: dict[str, str]) -> None:
        gate, up, down = self.arch.experts
        if self.quant.kind == "fp8":
            ignored: bool | None = self._ignored(prefix)
        else:
            answers = {self._ignored(f"{prefix}.0.{proj}") for proj in (gate, up, down)}
            ignored = answers.pop() if len(answers) == 1 else None
        if ignored is None:
            self.problem(Rule.PARTLY_IGNORED_FUSED_GROUP, prefix,
                         f"the ignore list covers some of {prefix}.0.{{{gate},{up},{down}}}: vLLM raises 'All MoE "
                         "projections need to have same quantization scheme'. Ignore the experts module whole.")
            return
        quantized = {matrix: self.modules[matrix]["weight"].dtype == FP8 for matrix in matrices}
        if len(set(quantized.values())) > 1:
            self.problem(Rule.PARTLY_QUANTIZED_FUSED_GROUP, prefix,
                         f"vLLM runs {prefix} as one fused MoE layer of one scheme, but only "
                         f"{sum(quantized.values())} of its {len(matrices)} expert matrices are FP8. Quantize all "
                         "experts or none.")
        scheme = None if ignored else self._scheme_for(prefix)
        for matrix, weight in matrices.items():
            self._check_member(matrix, prefix, scheme, quantized[matrix], bool(ignored), f"{weight}_")

    def _check_kv_scales(self, attention: set[str]) -> None:
        self.result.kv_scales_found = len(self.kv_keys)
        for key in self.kv_keys:
            target = key
            for pattern, replacement in _KV_REGEX:
                target = pattern.sub(replacement, target)
            if self.quant.kind == "fp8":
                for old, new in _FP8_KV_SUFFIX:
                    if target.endswith(old):
                        target = target[: -len(old)] + new
            parent, _, scale = target.rpartition(".")
            module, _, attn = parent.rpartition(".")
            if attn != "attn" or module not in attention or scale not in ("k_scale", "v_scale", "q_scale",
                                                                          "prob_scale"):
                self.problem(Rule.SCALE_DROPPED, key,
                             f"vLLM remaps {key} to {target}, which no attention layer has: the loader drops it "
                             "silently (a KV-cache scale suffix) and the KV cache runs at scale 1.0. Name it "
                             "'<layer>.self_attn.k_scale' / 'v_scale'.")
        if self.kv_keys and not self.quant.kv_cache:
            self.result.notes.append("KV-cache scales present but the config declares no kv_cache_scheme: vLLM "
                                     "loads them and uses them only when run with --kv-cache-dtype fp8")
