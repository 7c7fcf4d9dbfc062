"""A plan as the frameworks take it: the files of ``plan/`` beside the report.

* ``megatron_te_precision.yaml``: Megatron-Core's per-module TE precision file (``--te-precision-config-file``;
  ``megatron/core/quantization/quant_config.py`` ``configs`` + glob ``matchers``; ``TEQuantizationParams`` with a
  ``training_recipe`` of ``fp8_quantization_recipe`` "tensorwise" | "blockwise" | "mxfp8" or
  ``fp4_quantization_recipe`` "nvfp4", ``{}`` for BF16, ``megatron/core/extensions/transformer_engine.py``), module
  names mapped as Megatron-Bridge's Llama bridge maps them (``converters.artifact.training.megatron``).
* ``torchao_fqn_to_config.json``: torchao's ``FqnToConfig`` written by torchao's own ``config_to_dict`` (read back
  with ``torchao.core.config.config_from_dict``), one inference config per FP8/FP4 layer, None for BF16.
* ``torchtitan_filters.json``: the ``filter_fqns`` of torchtitan's Float8 converter (modules whose FQN contains an
  entry stay in high precision) and the ``fqns`` of its MXFP8 converter, in torchtitan's Llama 3 names.
* ``compressed_tensors_config.json``: a compressed-tensors ``mixed-precision`` ``quantization_config``, one config
  group per precision with its layers as ``targets``; ``hf_quant_config.json``: ModelOpt ``MIXED_PRECISION`` with
  ``quantized_layers``. Descriptions of a mixed serving export; a job writes the compressed-tensors checkpoint itself
  (:mod:`converters.plan.mixed_export`).
* ``README.md``: what each file is, and what each framework cannot express (Accelerate: no per-layer precision).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from converters._version import __version__
from converters.artifact.training.megatron import MEGATRON_NAMES
from converters.artifact.training.torchtitan import torchtitan_fqn
from converters.plan.candidates import BF16

__all__ = ["PLAN_DIR", "write_plan_files", "megatron_config", "torchao_config", "torchtitan_filters",
           "compressed_tensors_config", "modelopt_config", "ACCELERATE_NOTE"]

PLAN_DIR = "plan"
_MEGATRON_RECIPES = {"fp8-current": {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"},
                     "fp8-block": {"fp8_quantization_recipe": "blockwise", "fp8_format": "e4m3"},
                     "mxfp8": {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3"},
                     "nvfp4": {"fp4_quantization_recipe": "nvfp4"}}
ACCELERATE_NOTE = ("Accelerate cannot express a per-layer plan: its FP8 config (fp8_config in config.yaml, "
                   "TERecipeKwargs / AORecipeKwargs) builds one recipe for every Linear it converts (DelayedScaling "
                   "or MXFP8BlockScaling for TE), and its only layer selection, AORecipeKwargs.module_filter_func, is "
                   "a Python callable no config file holds; use torchao_fqn_to_config.json or the Megatron file")


def _choices(plan: Mapping[str, Any]) -> dict[str, str]:
    return {row["path"]: row["precision"] for row in plan["layers"]}


def megatron_config(plan: Mapping[str, Any], model_type: str | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The Megatron TE precision document, and notes (None with the reason when the names cannot be mapped)."""
    if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        return None, [f"no Megatron file: fp8forge maps Hugging Face names to Megatron's for Llama-family models, "
                      f"and this is a {model_type!r}"]
    modules: dict[str, set[str]] = {}
    notes = []
    for path, precision in _choices(plan).items():
        index, _, inner = path.partition("layers.")[2].partition(".")
        if not index.isdigit() or inner not in MEGATRON_NAMES:
            notes.append(f"{path} ({precision}) has no Megatron TE module fp8forge knows (lm_head is Megatron's "
                         "output_layer, not a TE module); not overridden")
            continue
        modules.setdefault(f"decoder.layers.{index}.{MEGATRON_NAMES[inner]}", set()).add(precision)
    configs = {"bf16": {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}}
    matchers = {}
    for number, (module, precisions) in enumerate(sorted(modules.items())):
        if len(precisions) > 1:  # a plan decides fused groups as one unit; a hand-edited plan may not
            raise ValueError(f"{module} fuses layers planned at {sorted(precisions)}: one GEMM takes one precision")
        precision = precisions.pop()
        if precision != BF16:
            configs[precision] = {"transformer_engine_config_type": "TEQuantizationParams",
                                  "training_recipe": {**_MEGATRON_RECIPES[precision],
                                                      "override_nonquantized_autocast": True}}
        matchers[f"m{number}_{precision.replace('-', '_')}"] = {"type": "glob", "enabled": True,
                                                               "pattern": f"*{module}", "config": precision}
    return {"configs": configs, "matchers": matchers}, notes


def torchao_config(plan: Mapping[str, Any]) -> Any:
    """torchao ``FqnToConfig``: each planned layer's inference config (None keeps it in high precision)."""
    from collections import OrderedDict

    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig, NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, FqnToConfig, PerBlock, PerTensor

    def make(precision: str) -> Any:
        if precision == "fp8-current":
            return Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())
        if precision == "fp8-block":
            return Float8DynamicActivationFloat8WeightConfig(granularity=[PerBlock([1, 128]), PerBlock([128, 128])])
        if precision == "mxfp8":
            return MXDynamicActivationMXWeightConfig()
        if precision == "nvfp4":
            return NVFP4DynamicActivationNVFP4WeightConfig()
        return None

    return FqnToConfig(fqn_to_config=OrderedDict((path, make(p)) for path, p in _choices(plan).items()))


def torchtitan_filters(plan: Mapping[str, Any]) -> dict[str, Any]:
    """Filter lists for torchtitan's converters, in its Llama 3 FQNs."""
    choices = _choices(plan)
    names = {path: torchtitan_fqn(path) for path in choices}
    return {
        "float8": {"filter_fqns": sorted(n for p, n in names.items() if n and choices[p] != "fp8-current"),
                   "converts": sorted(n for p, n in names.items() if n and choices[p] == "fp8-current"),
                   "note": "torchtitan's Float8LinearConverter runs rowwise scaling (tensorwise only emulated): its "
                           "layers get per-row scales, not the per-tensor current scaling the plan measured"},
        "mx": {"fqns": sorted(n for p, n in names.items() if n and choices[p] == "mxfp8")},
        "not_expressible": {p: sorted(path for path, c in choices.items() if c == p) for p in ("fp8-block", "nvfp4")
                            if p in choices.values()},
        "unmapped": sorted(path for path, name in names.items() if name is None),
    }


def compressed_tensors_config(plan: Mapping[str, Any]) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` (``mixed-precision``): one group per precision."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    schemes = {
        "fp8-current": ("float-quantized", {"weights": {**fp8, "strategy": "tensor", "dynamic": False},
                                            "input_activations": {**fp8, "strategy": "tensor", "dynamic": True}}),
        "fp8-block": ("float-quantized", {"weights": {**fp8, "strategy": "block", "block_structure": [128, 128],
                                                      "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "group", "group_size": 128,
                                                                "dynamic": True}}),
        "mxfp8": ("mxfp8-quantized", {"weights": {**fp8, "strategy": "group", "group_size": 32, "dynamic": False,
                                                  "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"},
                                      "input_activations": {**fp8, "strategy": "group", "group_size": 32,
                                                            "dynamic": True, "scale_dtype": "torch.uint8",
                                                            "zp_dtype": "torch.uint8"}}),
        "nvfp4": ("nvfp4-pack-quantized", {
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                        "group_size": 16, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
            "input_activations": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                                  "group_size": 16, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}}),
    }
    choices = _choices(plan)
    groups = {}
    for precision, (fmt, args) in schemes.items():
        targets = [path for path, chosen in choices.items() if chosen == precision]
        if targets:
            groups[f"group_{len(groups)}"] = {"targets": targets, "format": fmt, **args}
    return {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
            "config_groups": groups, "ignore": sorted(p for p, c in choices.items() if c == BF16)}


def modelopt_config(plan: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """ModelOpt ``hf_quant_config.json`` with ``quant_algo: MIXED_PRECISION`` and ``quantized_layers``."""
    layers, left = {}, []
    for path, precision in _choices(plan).items():
        if precision == "fp8-current":
            layers[path] = {"quant_algo": "FP8"}
        elif precision == "nvfp4":
            layers[path] = {"quant_algo": "NVFP4", "group_size": 16}
        elif precision != BF16:
            left.append(path)
    notes = [f"ModelOpt's mixed precision names FP8 (per tensor) and NVFP4 layers; {', '.join(left)} (block FP8 / "
             "MXFP8) are not expressible and are left out (high precision to a reader)"] if left else []
    return {"producer": {"name": "fp8forge", "version": __version__},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                             "quantized_layers": layers,
                             "exclude_modules": sorted(p for p, c in _choices(plan).items() if c == BF16)}}, notes


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)  # a reader never sees half a file


def write_plan_files(plan: Mapping[str, Any], directory: Path, model_type: str | None) -> tuple[list[str], dict]:
    """Write the files into ``directory/plan``; returns their names (relative to ``directory``) and what each
    framework could not express (for the report)."""
    from torchao.core.config import config_to_dict

    folder = directory / PLAN_DIR
    folder.mkdir(exist_ok=True)
    notes: dict[str, Any] = {"accelerate": ACCELERATE_NOTE}
    files = {}
    megatron, notes["megatron"] = megatron_config(plan, model_type)
    if megatron is not None:
        files["megatron_te_precision.yaml"] = yaml.safe_dump(megatron, sort_keys=False)
    files["torchao_fqn_to_config.json"] = json.dumps(config_to_dict(torchao_config(plan)), indent=1)
    titan = torchtitan_filters(plan)
    notes["torchtitan"] = {"float8": titan["float8"]["note"], "not_expressible": titan["not_expressible"],
                           "unmapped": titan["unmapped"]}
    files["torchtitan_filters.json"] = json.dumps(titan, indent=1)
    files["compressed_tensors_config.json"] = json.dumps(compressed_tensors_config(plan), indent=1)
    modelopt, notes["modelopt"] = modelopt_config(plan)
    files["hf_quant_config.json"] = json.dumps(modelopt, indent=1)
    files["README.md"] = _readme(notes, sorted(files))
    for name, text in files.items():
        _write(folder / name, text)
    return [f"{PLAN_DIR}/{name}" for name in sorted(files)], notes


def _readme(notes: Mapping[str, Any], names: list[str]) -> str:
    lines = ["# The precision plan, as the frameworks take it", "",
             "Written by fp8forge from report.json's `plan` block (docs/plan.md).", ""]
    lines += [f"- `{name}`" for name in names if name != "README.md"]
    lines += ["", "## What a framework cannot express", "", f"- Accelerate: {notes['accelerate']}"]
    lines += [f"- Megatron: {note}" for note in notes["megatron"]]
    lines += [f"- torchtitan: {notes['torchtitan']['float8']}"]
    lines += [f"- torchtitan: no converter for {p}: {', '.join(paths)}"
              for p, paths in notes["torchtitan"]["not_expressible"].items()]
    lines += [f"- ModelOpt: {note}" for note in notes["modelopt"]]
    return "\n".join(lines) + "\n"
