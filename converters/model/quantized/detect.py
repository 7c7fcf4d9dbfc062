"""Which quantization a checkpoint directory declares: config.json's ``quantization_config`` and ModelOpt's
``hf_quant_config.json``, read as the engines read them (transformers 5.24, compressed-tensors 0.20.1, vLLM).

A config fp8forge cannot read is refused, naming what it declares and listing what is read, rather than
taken for an unquantized model: its weights would be loaded as raw codes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from converters.errors import ModelConfigError, ModelNotFoundError
from converters.model.files import INDEX_NAME, SINGLE_FILE_NAME, read_model_text
from converters.model.limits import read_index_file
from converters.model.quantized.source import Scheme, SourceQuantization
from converters.model.safetensors_stream import read_tensor_index

__all__ = ["HF_QUANT_CONFIG", "READABLE", "checkpoint_tensor_names", "describe_source_quantization",
           "source_quantization"]

#: ModelOpt's quantization file beside config.json
HF_QUANT_CONFIG = "hf_quant_config.json"
#: What is read, for error messages: quant_method -> formats / algorithms
READABLE = {
    "fp8": "weight_block_size [m, n] or none (per tensor), weight_scale_inv",
    "compressed-tensors": "formats float-quantized / naive-quantized (8-bit float: tensor, channel, group, block), "
                          "nvfp4-pack-quantized, mxfp8-quantized, mixed-precision of these",
    "modelopt": "quant_algo FP8, NVFP4",
}
_CT_KINDS = {"float-quantized": Scheme.CT_FP8, "naive-quantized": Scheme.CT_FP8,
             "nvfp4-pack-quantized": Scheme.CT_NVFP4, "mxfp8-quantized": Scheme.CT_MXFP8}
_MODELOPT = {"FP8": Scheme.MODELOPT_FP8, "NVFP4": Scheme.MODELOPT_NVFP4}


def _refuse(what: str) -> ModelConfigError:
    readable = "; ".join(f"{method}: {formats}" for method, formats in READABLE.items())
    return ModelConfigError(f"the checkpoint is quantized with {what} (its config.json's quantization_config, or "
                            f"{HF_QUANT_CONFIG} for ModelOpt, says so), which fp8forge cannot read: its weights would "
                            f"be read as raw codes; it reads {readable}. Convert from the high-precision checkpoint "
                            "instead", field="model")


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(read_model_text(path))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read {path.name}: {exc}", field="model") from exc
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path.name} is not a JSON object", field="model")
    return value


def source_quantization(directory: Path) -> SourceQuantization | None:
    """The quantization ``directory``'s checkpoint is stored in, or None for a high-precision checkpoint.

    Reads ``config.json``'s ``quantization_config`` (``compression_config``, its older compressed-tensors
    name) and, for ModelOpt, ``hf_quant_config.json`` (which wins over config.json's ``quant_method: "modelopt"``
    when both are there, and is read alone when config.json declares no quantization).

    Raises:
        ModelNotFoundError: config.json is missing or not JSON.
        ModelConfigError: (field ``model``) a quantization this module does not read (the message names it and
            lists what is read), or a malformed quantization config.
    """
    config = _json(Path(directory) / "config.json")
    quantization = config.get("quantization_config", config.get("compression_config"))
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelConfigError("config.json: quantization_config is not an object", field="model")
    method = (quantization or {}).get("quant_method")
    modelopt_file = Path(directory) / HF_QUANT_CONFIG
    if modelopt_file.is_file() and method in (None, "modelopt"):  # vLLM reads it for ModelOpt checkpoints only
        return _modelopt(_json(modelopt_file).get("quantization") or {}, source=HF_QUANT_CONFIG)
    if quantization is None:
        return None
    if method == "fp8":
        return _fine_grained_fp8(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    if method == "modelopt":
        return _modelopt(quantization.get("quantization") or quantization, source="config.json")
    raise _refuse(f"quant_method {method!r}")


def _fine_grained_fp8(config: dict[str, Any]) -> SourceQuantization:
    block = config.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2
                              or not all(isinstance(size, int) and size > 0 for size in block)):
        raise ModelConfigError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}",
                               field="model")
    details = {"activation_scheme": config.get("activation_scheme", "dynamic"),
               "scale_fmt": config.get("scale_fmt")}
    return SourceQuantization(scheme=Scheme.FP8_BLOCK if block else Scheme.FP8_TENSOR, quant_method="fp8",
                              block_size=tuple(block) if block else None,
                              not_converted=tuple(config.get("modules_to_not_convert") or ()), details=details)


def _compressed_tensors(config: dict[str, Any]) -> SourceQuantization:
    top_format = config.get("format")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status {status!r} (weights not compressed)")
    sparsity = config.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    if config.get("transform_config"):
        raise _refuse("compressed-tensors transforms (transform_config: rotated weights)")
    schemes, blocks, groups, described = set(), set(), set(), {}
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        group_format = group.get("format") or top_format
        scheme = _CT_KINDS.get(group_format)
        fits = weights.get("type") == "float" and weights.get("symmetric", True) and (
            weights.get("num_bits") == (4 if scheme is Scheme.CT_NVFP4 else 8))
        if scheme is None or not fits:
            raise _refuse(f"compressed-tensors format {group_format!r} ({weights.get('num_bits')}-bit "
                          f"{weights.get('type')}{'' if weights.get('symmetric', True) else ' asymmetric'} "
                          f"weights, config group {name!r})")
        schemes.add(scheme)
        if weights.get("block_structure"):
            blocks.add(tuple(weights["block_structure"]))
        if weights.get("group_size"):
            groups.add(weights["group_size"])
        inputs = group.get("input_activations") or {}
        described[name] = {"format": group_format, "targets": group.get("targets"),
                           "weights_strategy": weights.get("strategy"),
                           "input_activations": None if not inputs else
                           ("dynamic" if inputs.get("dynamic") else "static") + f" {inputs.get('strategy')}"}
    if not schemes:
        raise ModelConfigError("compressed-tensors quantization_config has no config_groups", field="model")
    if len(blocks) > 1:
        raise _refuse(f"compressed-tensors config groups with different block structures {sorted(blocks)}")
    return SourceQuantization(scheme=schemes.pop() if len(schemes) == 1 else Scheme.CT_MIXED,
                              quant_method="compressed-tensors", block_size=blocks.pop() if blocks else None,
                              group_size=groups.pop() if len(groups) == 1 else None,
                              not_converted=tuple(config.get("ignore") or ()),
                              details={"format": top_format, "config_groups": described,
                                       "kv_cache_scheme": config.get("kv_cache_scheme")})


def _modelopt(quantization: dict[str, Any], *, source: str) -> SourceQuantization:
    algo = quantization.get("quant_algo")
    if algo not in _MODELOPT:
        raise _refuse(f"ModelOpt quant_algo {algo!r} ({source})")
    group = quantization.get("group_size")
    if group is None and algo == "NVFP4":
        weights = next(iter((quantization.get("config_groups") or {}).values()), {}).get("weights") or {}
        group = weights.get("group_size", 16)
    kv_cache = quantization.get("kv_cache_quant_algo") or (quantization.get("kv_cache_scheme") and "FP8")
    return SourceQuantization(scheme=_MODELOPT[algo], quant_method="modelopt", group_size=group,
                              not_converted=tuple(quantization.get("exclude_modules") or quantization.get("ignore")
                                                  or ()),
                              details={"quant_algo": algo, "kv_cache_quant_algo": kv_cache, "config_file": source})


def checkpoint_tensor_names(directory: Path) -> list[str] | None:
    """The tensor names of ``directory``'s safetensors checkpoint (index, or the single file's header), or None
    when it holds no weights (an analysis of a hub model downloads only config.json)."""
    index = Path(directory) / INDEX_NAME
    if index.is_file():
        return list(read_index_file(index)["weight_map"])
    single = Path(directory) / SINGLE_FILE_NAME
    if single.is_file():
        return list(read_tensor_index(single)[0])
    return None


def describe_source_quantization(directory: Path) -> dict[str, Any] | None:
    """The analysis report's ``source_quantization`` block: :meth:`SourceQuantization.describe` with the
    checkpoint's tensor names when it has weights; None for a high-precision checkpoint. A quantization that
    is not read is reported (``scheme`` None, ``refused`` the reason) rather than raised: the analysis itself
    only needs config.json, and a conversion refuses such a source anyway.

    Raises:
        ModelNotFoundError: config.json is missing or not JSON.
    """
    try:
        quantization = source_quantization(directory)
    except ModelConfigError as exc:
        return {"scheme": None, "refused": exc.message}
    return None if quantization is None else quantization.describe(checkpoint_tensor_names(directory))
