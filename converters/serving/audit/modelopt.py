"""ModelOpt configs as vLLM reads them (``ModelOptQuantConfigBase.from_config``), and its exclude matching.

vLLM's ``get_quant_config`` (``model_loader/weight_utils.py``) takes config.json's ``quantization_config`` when
there is one (``quant_algo``, ``ignore``, ``kv_cache_scheme``); only without it does it read
``hf_quant_config.json`` (``quantization.quant_algo``, ``exclude_modules``, ``kv_cache_quant_algo``), where NVFP4
requires ``group_size``, ``kv_cache_quant_algo`` and ``exclude_modules`` to be present (``_from_config``).
``is_layer_excluded``: ``is_layer_skipped`` (exact names, fused shards that must agree), then any entry that is a
substring of the layer name, then ``fnmatch`` wildcards.
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from converters.serving.audit.result import Problem, Rule
from converters.serving.audit.schemes import QuantConfig, modelopt_scheme

__all__ = ["HF_QUANT_CONFIG", "excluded", "is_modelopt", "parse_modelopt"]

HF_QUANT_CONFIG = "hf_quant_config.json"
_NVFP4_REQUIRED = ("group_size", "kv_cache_quant_algo", "exclude_modules")


def is_modelopt(raw: dict[str, Any], directory: Path) -> bool:
    """config.json names ModelOpt, or has no quantization config and ``hf_quant_config.json`` is there."""
    return str(raw.get("quant_method", "")).lower().startswith("modelopt") or (
        not raw and (directory / HF_QUANT_CONFIG).is_file())


def excluded(name: str, entry: str) -> bool:
    """Whether one exclude entry covers layer ``name`` beyond an exact match: substring, then fnmatch wildcard."""
    return entry in name or fnmatch(name, entry)


def parse_modelopt(raw: dict[str, Any], directory: Path) -> tuple[QuantConfig | None, str, str, list[Problem]]:
    """(config, why not audited, format name, problems vLLM raises on while reading the config)."""
    if raw:
        algo, exclude = raw.get("quant_algo"), raw.get("ignore", [])
        scheme = raw.get("kv_cache_scheme")
        kv_cache = isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
        source = "config.json quantization_config"
        quantization: dict[str, Any] = {}
    else:
        quantization = json.loads((directory / HF_QUANT_CONFIG).read_text(encoding="utf-8")).get("quantization")
        if not isinstance(quantization, dict):
            return None, f"{HF_QUANT_CONFIG} has no 'quantization' object", "modelopt", [Problem(
                rule=Rule.CONFIG_REJECTED, name=HF_QUANT_CONFIG, message=f"{HF_QUANT_CONFIG} has no 'quantization' "
                "dictionary: vLLM raises 'Expected 'quantization' to be a dictionary'. Write ModelOpt's layout.")]
        algo, exclude = quantization.get("quant_algo"), quantization.get("exclude_modules", [])
        kv_cache = quantization.get("kv_cache_quant_algo") is not None
        source = HF_QUANT_CONFIG
    algo = str(algo or "").upper()
    name = f"modelopt/{algo or '?'}"
    problems = []
    if "NVFP4" in algo and quantization:
        missing = [field for field in _NVFP4_REQUIRED if field not in quantization]
        if missing:
            problems.append(Problem(rule=Rule.CONFIG_REJECTED, name=HF_QUANT_CONFIG, message=(
                f"{HF_QUANT_CONFIG} lacks {missing}: vLLM raises 'NVFP4 quantization requires the following fields "
                f"in hf_quant_config.json' before loading anything. Write them (null for no KV-cache quantization).")))
    if not isinstance(exclude, list):
        problems.append(Problem(rule=Rule.CONFIG_REJECTED, name=source, message=(
            f"the exclude list in {source} is a {type(exclude).__name__}: vLLM raises 'exclude_modules must be a "
            "list'. Write a JSON list of module names and wildcards.")))
        exclude = []
    if algo not in ("FP8", "NVFP4"):
        return None, f"ModelOpt quant_algo {algo!r} has no rules in this audit (known: FP8, NVFP4)", name, problems
    config = QuantConfig(kind="modelopt", groups=((("Linear",), modelopt_scheme(algo)),),
                         ignore=tuple(str(entry) for entry in exclude), kv_cache=kv_cache)
    return config, "", name, problems
