"""A plan's mixed-precision serving checkpoints: each planned layer's weights written as its precision, every other
tensor copied as bytes, in two layouts (:class:`MixedLayout`).

Each precision is written by the serving format of :mod:`converters.serving` that stores it in the layout
(``serving_of``), with that format's own casts and tensors, so a layer's tensors are byte for byte the ones that
format's single-precision export writes for it from the same calibration.

``compressed-tensors-mixed``: config.json's ``quantization_config`` is ``format: mixed-precision`` with one config
group per precision (the format's own group, its ``targets`` the planned layers' module names) and the bf16 Linears
in ``ignore``; compressed-tensors and transformers decompress each group by its own format.

* ``fp8-current`` -> ``compressed-tensors-fp8``: per-tensor weight scale, static per-tensor ``input_scale``;
* ``mxfp8`` -> ``mxfp8``: E4M3 weights in groups of 32 with E8M0 scales, dynamic MX activations;
* ``nvfp4`` -> ``nvfp4`` (W4A4): packed E2M1 weights, E4M3 block scales, global scales shared by a fused group.

``modelopt-mixed``: ModelOpt's ``MIXED_PRECISION`` (``hf_quant_config.json`` ``quantized_layers``, each layer's
``quant_algo``, as vLLM's ModelOpt mixed-precision reader takes it), ``fp8-current`` -> ``modelopt-fp8`` and
``nvfp4`` -> ``modelopt-nvfp4``; config.json carries one config group per algorithm.

A precision a layout has no writer for (block FP8 in both: fp8forge's block FP8 export is transformers' native
``fp8`` layout, one scheme per checkpoint; MXFP8 in ModelOpt's) leaves the plan without that layout
(:func:`not_expressible` names the layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from converters.errors import Fp8ForgeError
from converters.model.files import FileConfinement
from converters.model.safetensors_stream import ReadBuffers, read_tensor, read_tensor_index
from converters.plan.candidates import BF16
from converters.rewrite import Compute, Copy, ShardWritten, finish_checkpoint
from converters.rewrite import write_shard as rewrite_shard
from converters.serving.compressed_tensors import STATIC
from converters.serving.modelopt import HF_QUANT_CONFIG, MODELOPT_FP8, MODELOPT_NVFP4, MODELOPT_VERSION
from converters.serving.mxfp8 import MXFP8
from converters.serving.nvfp4 import GROUP, NVFP4
from converters.serving.selection import ServingFormat, ServingSelection
from converters.serving.writer import quantize_step, set_weight_amax

__all__ = ["MixedLayout", "COMPRESSED_TENSORS_MIXED", "MODELOPT_MIXED", "MIXED_LAYOUTS", "not_expressible",
           "write_mixed_checkpoint"]


@dataclass(frozen=True)
class MixedLayout:
    """A mixed-precision checkpoint layout: its folder name, the serving format that writes each precision, and its
    configs (``configs(per-precision ServingSelections, every Linear path) -> (quantization_config, side files)``)."""

    name: str
    serving_of: Mapping[str, ServingFormat]
    configs: Callable[[Mapping[str, ServingSelection], list[str]], tuple[dict[str, Any], dict[str, Any]]]


def _choices(plan: Mapping[str, Any]) -> dict[str, str]:
    return {row["path"]: row["precision"] for row in plan["layers"]}


def not_expressible(plan: Mapping[str, Any], layout: MixedLayout) -> dict[str, list[str]]:
    """Precision -> the plan's layers ``layout`` has no writer for; empty when every layer fits."""
    left: dict[str, list[str]] = {}
    for path, precision in _choices(plan).items():
        if precision != BF16 and precision not in layout.serving_of:
            left.setdefault(precision, []).append(path)
    return left


def _serving_selections(plan: Mapping[str, Any], layout: MixedLayout, on_disk_name: Callable[[str], str | None]
                        ) -> dict[str, ServingSelection]:
    """One ServingSelection per low precision: its layers' on-disk weight keys and its fused groups (a plan unit)."""
    members: dict[str, list[str]] = {}
    for row in plan["layers"]:
        members.setdefault(row["unit"], []).append(row["path"])
    selections: dict[str, ServingSelection] = {}
    for path, precision in _choices(plan).items():
        if precision == BF16:
            continue
        key = on_disk_name(f"{path}.weight")
        if key is None:
            raise Fp8ForgeError(f"the plan quantizes {path} as {precision}, but the checkpoint stores no "
                                f"{path}.weight under one name; plan it in bf16 (exclude it)", field="plan")
        fmt = layout.serving_of[precision]
        selection = selections.setdefault(precision, ServingSelection(format=fmt.name,
                                                                      static_inputs=fmt.needs_calibration))
        selection.quantized[path] = key
    for selection in selections.values():
        selection.fused_groups = [group for group in members.values()
                                  if len(group) > 1 and all(path in selection.quantized for path in group)]
    return selections


def _compressed_tensors_configs(selections: Mapping[str, ServingSelection], linear_paths: list[str]
                                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """compressed-tensors ``mixed-precision``: each precision's format's own config group, targeting its layers."""
    groups = {}
    for precision, selection in selections.items():
        config = COMPRESSED_TENSORS_MIXED.serving_of[precision].quantization_config(selection)
        group = config["config_groups"]["group_0"]
        groups[f"group_{len(groups)}"] = {**group, "targets": sorted(selection.quantized)}
    quantized = {path for selection in selections.values() for path in selection.quantized}
    return {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
            "config_groups": groups, "ignore": [path for path in linear_paths if path not in quantized],
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}}, {}


def _modelopt_configs(selections: Mapping[str, ServingSelection], linear_paths: list[str]
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """ModelOpt ``MIXED_PRECISION``: ``quantized_layers`` in hf_quant_config.json; a config group per algorithm."""
    algo = {"fp8-current": {"quant_algo": "FP8"}, "nvfp4": {"quant_algo": "NVFP4", "group_size": GROUP}}
    layers = {path: dict(algo[precision]) for precision, selection in selections.items()
              for path in selection.quantized}
    exclude = sorted(path for path in linear_paths if path not in layers)
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    groups = {}
    for precision, selection in selections.items():
        args: dict[str, Any] = {"dynamic": False, "num_bits": 4 if precision == "nvfp4" else 8, "type": "float"}
        if precision == "nvfp4":
            args["group_size"] = GROUP
        groups[f"group_{len(groups)}"] = {"input_activations": dict(args), "weights": dict(args),
                                          "targets": sorted(selection.quantized)}
    side = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                                   "quantized_layers": layers, "exclude_modules": exclude}}
    return {"config_groups": groups, "ignore": exclude, "quant_algo": "MIXED_PRECISION", "producer": producer,
            "quant_method": "modelopt"}, {HF_QUANT_CONFIG: side}


COMPRESSED_TENSORS_MIXED = MixedLayout(name="compressed-tensors-mixed",
                                       serving_of={"fp8-current": STATIC, "mxfp8": MXFP8, "nvfp4": NVFP4},
                                       configs=_compressed_tensors_configs)
MODELOPT_MIXED = MixedLayout(name="modelopt-mixed", serving_of={"fp8-current": MODELOPT_FP8, "nvfp4": MODELOPT_NVFP4},
                             configs=_modelopt_configs)
MIXED_LAYOUTS = (COMPRESSED_TENSORS_MIXED, MODELOPT_MIXED)


def _input_amax(selections: Mapping[str, ServingSelection], input_amax: Mapping[str, float]) -> None:
    for precision, selection in selections.items():
        if not selection.static_inputs:
            continue
        missing = [path for path in selection.quantized if path not in input_amax]
        if missing:
            raise Fp8ForgeError(f"{precision} layers store a static input scale from the calibrated input amax, and "
                                f"none was given for {', '.join(missing[:3])}: pass the calibration's input amax "
                                "of every planned layer (a fused group's largest)", field="plan")
        selection.input_amax = {path: float(input_amax[path]) for path in selection.quantized}


def write_mixed_checkpoint(layout: MixedLayout, plan: Mapping[str, Any], source_dir: Path, weight_files: list[Path],
                           directory: Path, scale_dtype: torch.dtype, confinement: FileConfinement, *,
                           on_disk_name: Callable[[str], str | None], input_amax: Mapping[str, float],
                           check_stop: Callable[[], None] | None = None) -> list[str]:
    """Write the plan's mixed-precision checkpoint of the source in ``layout`` into ``directory``.

    ``plan`` is a plan block (:func:`converters.plan.planner.make_plan`; its ``layers`` rows with ``path``, ``unit``
    and ``precision``); ``input_amax`` maps each planned Linear to its calibrated input amax (shared within a fused
    group), read by the formats with static input scales. One weight is decoded at a time.

    Returns the file names written (relative to ``directory``). Raises Fp8ForgeError (field ``plan``) for a layer
    the layout has no writer for, a planned weight the checkpoint does not store under one name, or a missing
    input amax; ModelConfigError (field ``model``) for a planned weight, or what quantizing it gave, holding NaN or
    an infinity (:func:`~converters.serving.writer.quantize_weight`).
    """
    left = not_expressible(plan, layout)
    if left:
        named = "; ".join(f"{precision}: {', '.join(paths)}" for precision, paths in left.items())
        raise Fp8ForgeError(f"a {layout.name} checkpoint holds only {', '.join(layout.serving_of)} layers, not "
                            f"{named}: plan for a GPU without those formats, or use their single-format serving "
                            "exports", field="plan")
    selections = _serving_selections(plan, layout, on_disk_name)
    _input_amax(selections, input_amax)
    for precision, selection in selections.items():
        if getattr(layout.serving_of[precision], "needs_weight_amax", False):
            set_weight_amax(selection, weight_files)  # NVFP4's global scale, one per fused group
    directory.mkdir(parents=True, exist_ok=True)
    shards = _write_weights(layout, selections, weight_files, directory, scale_dtype, check_stop)
    quantization_config, side_files = layout.configs(selections, [row["path"] for row in plan["layers"]])
    return [shard.name for shard in shards] + finish_checkpoint(
        source_dir, directory, shards, quantization_config=quantization_config, confinement=confinement,
        json_files=side_files)


def _write_weights(layout: MixedLayout, selections: Mapping[str, ServingSelection], weight_files: list[Path],
                   directory: Path, scale_dtype: torch.dtype, check_stop: Callable[[], None] | None
                   ) -> list[ShardWritten]:
    """Each weight file again: planned weights replaced by their format's tensors, the rest copied as bytes."""
    format_of = {key: (layout.serving_of[precision], selection, path) for precision, selection in selections.items()
                 for path, key in selection.quantized.items()}
    shards = []
    for source in weight_files:
        tensors, metadata = read_tensor_index(source)
        buffers = ReadBuffers()  # the file's weights read into memory the ones before them no longer use
        steps: list[Copy | Compute] = []
        for name, tensor in tensors.items():
            if name not in format_of:
                steps.append(Copy(name, tensor))  # bf16 Linears and every other tensor: the source's bytes
                continue
            fmt, selection, path = format_of[name]
            options = {"weight_amax": selection.weight_amax[path]} if getattr(fmt, "needs_weight_amax", False) else {}
            # the serving export's own conversion (strips, finiteness), so a layer's bytes are its single export's
            steps.append(quantize_step(fmt, name, tensor, functools.partial(read_tensor, tensor, buffers),
                                       scale_dtype, input_amax=selection.input_amax.get(path), options=options))
        shards.append(rewrite_shard(directory / source.name, steps, metadata, check_stop=check_stop))
    return shards

