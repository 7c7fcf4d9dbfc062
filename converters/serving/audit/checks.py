"""One audit run: the checkpoint's modules grouped into the layers vLLM builds, then each rule in turn."""

from __future__ import annotations

import re

import torch

from converters.model.safetensors_stream import SourceTensor, read_tensor
from converters.serving.audit.modelopt import excluded
from converters.serving.audit.names import (
    EXPERT,
    FP8_KV_SUFFIX,
    KV_REGEX,
    KV_SUFFIXES,
    NOT_LINEAR,
    Architecture,
    is_match,
)
from converters.serving.audit.result import AuditResult, Problem, Rule
from converters.serving.audit.schemes import FP8, PACKED, QuantConfig, Scheme

__all__ = ["Audit"]

_QUANTIZED = (FP8, PACKED)
_WEIGHTS = ("weight_packed", "weight")


class Audit:
    """Checks one export against one quantization config; problems go into ``result``."""

    def __init__(self, tensors: dict[str, SourceTensor], quant: QuantConfig, arch: Architecture,
                 result: AuditResult, *, unstored_modules: tuple[str, ...] = ()) -> None:
        self.tensors, self.quant, self.arch, self.result = tensors, quant, arch, result
        self.unstored_modules = unstored_modules  #: modules vLLM builds that the checkpoint stores no tensor of
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
                             f"{key.rpartition('.')[0]} without quantized parameters): the loader rejects the name "
                             "('no module or parameter named'). Drop the tensor, or quantize that layer.")

    def _weight(self, module: str) -> SourceTensor | None:
        tensors = self.modules[module]
        return next((tensors[name] for name in _WEIGHTS if name in tensors), None)

    def _is_quantized(self, module: str) -> bool:
        weight = self._weight(module)
        return weight is not None and weight.dtype in _QUANTIZED

    def _rename(self, entry: str) -> str:
        if entry.startswith("re:") or "." not in entry:
            return entry
        for old, new in self.arch.renames:
            entry = entry.replace(old, new, 1)
        return entry

    def _is_kv(self, key: str) -> bool:
        suffix = key.rpartition(".")[2]
        return suffix in KV_SUFFIXES or (self.quant.kind == "fp8" and key.endswith(
            tuple(old for old, _ in FP8_KV_SUFFIX)))

    def _layers(self) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
        """vLLM Linear layers (fused name -> checkpoint modules) and experts (prefix -> ckpt matrix -> 'w13'/'w2')."""
        gate, up, _ = self.arch.experts
        w13 = {gate, up, *(old.strip(".") for old, new in self.arch.renames if new.strip(".") in (gate, up))}
        layers: dict[str, list[str]] = {}
        experts: dict[str, dict[str, str]] = {}
        for module in self.modules:
            weight = self._weight(module)
            if weight is None or len(weight.shape) != 2 or NOT_LINEAR.search(module) \
                    or any(re.match(pattern, module) for pattern in self.arch.never_quantized):
                continue
            expert = EXPERT.match(module)
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
        if self.quant.kind in ("fp8", "modelopt"):
            # quant_utils.is_layer_skipped; ModelOpt's is_layer_excluded then adds substrings and wildcards
            wide = self.quant.kind == "modelopt" and any(excluded(name, entry) for entry in self.ignore)
            if proj in self.arch.packed and name in self.ignore:
                return True
            if "experts" in name and proj not in self.arch.packed:
                return wide or any(name in entry for entry in self.ignore if "experts" in entry)
            match = lambda shard: shard in self.ignore  # noqa: E731
        else:
            wide = False
            match = lambda shard: any(is_match(shard, entry) for entry in self.ignore)  # noqa: E731
        if proj in self.arch.packed and name not in self.ignore:
            answers = {match(name.replace(proj, shard)) for shard in self.arch.packed[proj]}
            return (answers.pop() or wide) if len(answers) == 1 else None
        return match(name) or wide

    def _scheme_for(self, name: str) -> Scheme | None:
        """The config group vLLM gives layer ``name`` (class name ``*Linear``), ignoring the ignore list."""
        proj = name.rpartition(".")[2]
        for targets, scheme in self.quant.groups:
            # vLLM's second try matches the module's class name by substring; every layer here is a *Linear
            # (or the fused MoE layer, which compressed-tensors maps onto the Linear target).
            if any(is_match(name, target) or (not target.startswith("re:") and target.lower() in "linear")
                   for target in targets):
                return scheme
            shards = self.arch.packed.get(proj, ())
            if shards and all(any(is_match(name.replace(proj, shard), target) for target in targets)
                              for shard in shards):
                return scheme
        return None

    def _check_ignore_entries(self, layers: dict[str, list[str]], experts: dict[str, dict[str, str]]) -> None:
        names = [*self.modules, *layers, *experts, *self.unstored_modules]
        for original, entry in zip(self.quant.ignore, self.ignore, strict=True):
            if self.quant.kind == "compressed-tensors":
                found = any(is_match(name, entry) for name in names)
            else:
                found = entry in names or ("experts" in entry and any(prefix in entry for prefix in experts))
                if self.quant.kind == "modelopt":
                    found = found or any(excluded(name, entry) for name in names)
            if not found:
                how = {"compressed-tensors": "full module names, 're:' entries with re.match",
                       "fp8": "full module names", "modelopt": "full names, substrings and fnmatch wildcards"}
                self.problem(Rule.IGNORED_MODULE_MISSING, original,
                             f"ignore entry {original!r} matches no module of the checkpoint (nor a fused name such "
                             "as ...qkv_proj): vLLM skips nothing for it, so the layer it was meant to keep in high "
                             f"precision gets quantized parameters. Fix the name (vLLM compares "
                             f"{how[self.quant.kind]}) or drop the entry.")

    def _check_layer(self, fused: str, members: list[str]) -> None:
        quantized = {member: self._is_quantized(member) for member in members}
        if len(set(quantized.values())) > 1:
            low = [member for member, is_low in quantized.items() if is_low]
            self.problem(Rule.PARTLY_QUANTIZED_FUSED_GROUP, fused,
                         f"vLLM loads {', '.join(members)} into one fused layer {fused} of one scheme, but only "
                         f"{', '.join(low)} is quantized: the other shards would be cast or rejected. Quantize all "
                         "of them or none (and list the high-precision ones in the ignore list together).")
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
        if scheme is not None and all(quantized.values()):
            self._check_shared(fused, members, scheme.shared, fused, "the largest")

    def _check_member(self, member: str, layer: str, scheme: Scheme | None, is_quantized: bool, ignored: bool,
                      prefix: str) -> None:
        """One checkpoint module's weight against the parameters vLLM creates for ``layer`` (``prefix``: w13_/w2_)."""
        tensors = self.modules[member]
        weight = self._weight(member)
        assert weight is not None  # _layers keeps only modules with a weight
        if scheme is not None and not is_quantized:
            self.problem(Rule.UNQUANTIZED_NOT_IGNORED, member,
                         f"{member}.weight is {weight.dtype} but no ignore entry covers it: vLLM builds {layer} with "
                         f"{scheme.label} parameters and would cast the weight with no scale (garbage output or a "
                         f"load error). Add {member!r} to the ignore list, or quantize it.")
        if scheme is None and is_quantized:
            why = "an ignore entry matches it" if ignored else "no config group targets it"
            self.problem(Rule.QUANTIZED_BUT_IGNORED, member,
                         f"{member}'s weight is {weight.dtype} (quantized) but {why}: vLLM builds {layer} in high "
                         "precision and would read the quantized bytes as plain numbers without their scale. Remove "
                         "it from the ignore list (or add a target), or export it unquantized.")
        params = {"weight", "bias", *(scheme.params() if scheme else ())}
        for suffix in tensors:
            key = f"{member}.{suffix}"
            self.handled.add(key)
            if suffix not in params:
                kind = f"the {scheme.label} scheme" if scheme else "a high-precision layer"
                self.problem(Rule.SCALE_DROPPED, key,
                             f"{key} maps to {layer}.{prefix}{suffix}, which vLLM does not create for {kind}: the "
                             f"loader rejects it ('no module or parameter named'); were it skipped, the layer would "
                             f"run with scale 1.0. Write it as one of {sorted(prefix + p for p in params)}.")
        config_scheme = scheme or self._scheme_for(layer)
        if is_quantized and config_scheme is not None:
            self._check_scales(member, config_scheme)

    def _check_scales(self, member: str, scheme: Scheme) -> None:
        tensors = self.modules[member]
        weight = self._weight(member)
        assert weight is not None
        out_features, in_features = weight.shape
        in_features *= 2 if weight.dtype == PACKED else 1  # two E2M1 codes a byte
        for scale in scheme.scales:
            key = f"{member}.{scale.name}"
            tensor = tensors.get(scale.name)
            if tensor is None:
                self.problem(Rule.MISSING_SCALE, key,
                             f"{member} is quantized ({scheme.label}) but {key} is missing: vLLM leaves that "
                             "parameter uninitialized (or refuses to load). Write the scale.")
                continue
            shapes = scale.shapes(out_features, in_features)
            if tensor.dtype not in scale.dtypes:
                self.problem(Rule.WRONG_SCALE_DTYPE, key,
                             f"{key} is {tensor.dtype}, but the {scheme.label} scheme creates it as "
                             f"{' / '.join(scale.dtypes)}: the loader's copy_ converts the values instead of taking "
                             f"the bytes (an E4M3 or E8M0 scale then means something else). Write it as "
                             f"{scale.dtypes[0]}.")
            elif tuple(tensor.shape) not in shapes:
                self.problem(Rule.WRONG_SCALE_SHAPE, key,
                             f"{key} has shape {list(tensor.shape)}, but the {scheme.label} scheme makes vLLM create "
                             f"{list(shapes[0])} for a [{out_features}, {in_features}] weight: the weight loader "
                             "fails on the size mismatch. Recompute the scale for this scheme.")

    def _check_shared(self, layer: str, members: list[str], names: tuple[str, ...], param: str, kept: str) -> None:
        """Per-tensor scales that vLLM collapses to one value per fused layer must agree across its shards."""
        for name in names:
            sources = [self.modules[member][name] for member in members if name in self.modules[member]]
            if len(sources) < 2 or any(source.nbytes > 64 for source in sources):
                continue  # a missing or odd-shaped scale is reported by _check_scales
            values = [read_tensor(source).float().reshape(-1) for source in sources]
            if all(torch.equal(values[0], value) for value in values[1:]):
                continue
            shown = ", ".join(f"{member.rpartition('.')[2]}={value[0].item():.6g}"
                              for member, value in zip(members, values, strict=False))
            self.problem(Rule.FUSED_GLOBAL_SCALE_DIFFERS, f"{param}.{name}",
                         f"the shards of {layer} carry different {name} ({shown}): vLLM keeps one value for the "
                         f"fused parameter ({kept}), only warning that the global scales 'are different for parallel "
                         "layers', so every other shard dequantizes off by the ratio of the two. Quantize the group "
                         "with one global scale, from its largest |w| (and one input amax).")

    def _check_experts(self, prefix: str, matrices: dict[str, str]) -> None:
        gate, up, down = self.arch.experts
        if self.quant.kind == "compressed-tensors":
            answers = {self._ignored(f"{prefix}.0.{proj}") for proj in (gate, up, down)}
            ignored = answers.pop() if len(answers) == 1 else None
        else:
            ignored = self._ignored(prefix)
        if ignored is None:
            self.problem(Rule.PARTLY_IGNORED_FUSED_GROUP, prefix,
                         f"the ignore list covers some of {prefix}.0.{{{gate},{up},{down}}}: vLLM raises 'All MoE "
                         "projections need to have same quantization scheme'. Ignore the experts module whole.")
            return
        quantized = {matrix: self._is_quantized(matrix) for matrix in matrices}
        if len(set(quantized.values())) > 1:
            self.problem(Rule.PARTLY_QUANTIZED_FUSED_GROUP, prefix,
                         f"vLLM runs {prefix} as one fused MoE layer of one scheme, but only "
                         f"{sum(quantized.values())} of its {len(matrices)} expert matrices are quantized. Quantize "
                         "all experts or none.")
        scheme = None if ignored else self._scheme_for(prefix)
        for matrix, weight in matrices.items():
            self._check_member(matrix, prefix, scheme, quantized[matrix], bool(ignored), f"{weight}_")
        if scheme is None or not scheme.shared_experts or not all(quantized.values()):
            return
        units: dict[str, list[str]] = {}
        for matrix, weight in matrices.items():
            if weight == "w13":
                units.setdefault(EXPERT.match(matrix)["expert"], []).append(matrix)
        for expert, members in units.items():
            self._check_shared(f"{prefix}.{expert} (w1/w3)", sorted(members), scheme.shared_experts,
                               f"{prefix}.w13[{expert}]", "w1's, the first shard")

    def _check_kv_scales(self, attention: set[str]) -> None:
        self.result.kv_scales_found = len(self.kv_keys)
        cache_scales: dict[str, set[str]] = {}
        for key in self.kv_keys:
            target = key
            for pattern, replacement in KV_REGEX:
                target = pattern.sub(replacement, target)
            if self.quant.kind == "fp8":
                for old, new in FP8_KV_SUFFIX:
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
            elif scale in ("k_scale", "v_scale"):
                cache_scales.setdefault(module, set()).add(scale)
        for module, found in sorted(cache_scales.items()):
            if len(found) == 1:
                (have,) = found
                lacking = "v_scale" if have == "k_scale" else "k_scale"
                # vLLM's BaseKVCacheMethod.process_weights_after_loading copies the one scale it got to the other
                self.problem(Rule.MISSING_SCALE, module,
                             f"{module} has a KV-cache {have} but no {lacking}: vLLM loads it and runs both keys and "
                             f"values on {have}, silently. Write both scales for every attention layer, or neither.")
        if self.kv_keys and not self.quant.kv_cache:
            self.result.notes.append("KV-cache scales present but the config declares no KV-cache quantization "
                                     "(kv_cache_scheme / kv_cache_quant_algo): vLLM loads them and uses them only when "
                                     "run with --kv-cache-dtype fp8")
