"""compressed-tensors and ``fp8`` configs as vLLM reads them: each config group's scheme, ignore list, KV cache.

Scheme choice follows vLLM's ``compressed_tensors.py`` ``_get_scheme_from_parts``: ``float-quantized`` FP8
(``CompressedTensorsW8A8Fp8``), ``nvfp4-pack-quantized`` with FP4 ``tensor_group`` 16 weights
(``CompressedTensorsW4A4Fp4`` with FP4 inputs, ``CompressedTensorsW4A16Fp4`` without) and ``mxfp8-quantized``
with FP8 ``group`` 32 weights (``CompressedTensorsW8A8Mxfp8``). Anything else has no rules here.
"""

from __future__ import annotations

from typing import Any

from converters.serving.audit.schemes import QuantConfig, Scheme, fp8_scheme, mxfp8_scheme, nvfp4_scheme

__all__ = ["parse_compressed_tensors", "parse_fp8"]


def parse_fp8(raw: dict[str, Any]) -> QuantConfig:
    """``quant_method: fp8`` (``Fp8Config``): one scheme for every Linear, ``ignored_layers`` exact names."""
    block = raw.get("weight_block_size")
    scheme = fp8_scheme(strategy="block" if block else "tensor", static_input=raw.get("activation_scheme") == "static",
                        block=tuple(block) if block else None, scale="weight_scale_inv" if block else "weight_scale")
    ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    return QuantConfig(kind="fp8", groups=((("Linear",), scheme),), ignore=tuple(ignore),
                       kv_cache=raw.get("kv_cache_scheme") is not None)


def parse_compressed_tensors(raw: dict[str, Any]) -> tuple[QuantConfig | None, str]:
    """The config as vLLM reads it, or None and why the audit has no rules for one of its groups."""
    groups = []
    for group_name, group in (raw.get("config_groups") or {}).items():
        scheme = _group_scheme(group, group.get("format") or raw.get("format"))
        if scheme is None:
            weights = group.get("weights") or {}
            return None, (f"compressed-tensors group {group_name!r} is {group.get('format') or raw.get('format')} "
                          f"{weights.get('type')}{weights.get('num_bits')}: only float-quantized FP8, "
                          "nvfp4-pack-quantized and mxfp8-quantized have rules in this audit")
        groups.append((tuple(group.get("targets") or ()), scheme))
    return QuantConfig(kind="compressed-tensors", groups=tuple(groups), ignore=tuple(raw.get("ignore") or ()),
                       kv_cache=raw.get("kv_cache_scheme") is not None), ""


def _group_scheme(group: dict[str, Any], group_format: str | None) -> Scheme | None:
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if group_format == "float-quantized" and kind == "float" and bits == 8:
        block = weights.get("block_structure")
        return fp8_scheme(strategy=strategy, static_input=bool(inputs) and not inputs.get("dynamic"),
                          block=tuple(block) if block else None)
    if group_format == "nvfp4-pack-quantized" and (kind, bits, strategy, weights.get("group_size")) == (
            "float", 4, "tensor_group", 16):
        if inputs and (inputs.get("num_bits"), inputs.get("strategy"), inputs.get("dynamic")) != (
                4, "tensor_group", "local"):
            return None
        return nvfp4_scheme(activations=bool(inputs))
    if group_format == "mxfp8-quantized" and (kind, bits, strategy, weights.get("group_size")) == (
            "float", 8, "group", 32):
        return mxfp8_scheme()
    return None
