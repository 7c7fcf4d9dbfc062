"""Load audit of a serving export: would vLLM use every tensor, with the scheme the files claim?

:func:`audit_export` replays, on CPU and from the safetensors headers and ``config.json`` alone (no weight is
read; only the 4-byte global scales of fused groups are), the rules vLLM applies when it builds the model for a
quantization config and loads a checkpoint into it. Each broken rule is a :class:`Problem` with a :class:`Rule`
code, the tensor or module it concerns, what the engine would do and how to fix it.

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
  :data:`Rule.WRONG_SCALE_DTYPE`), FP8: ``create_fp8_scale_parameter`` / ``create_fp8_input_scale`` shapes (one
  per-tensor scale per shard, ``[out, 1]`` per channel, ``[ceil(out/bn), ceil(in/bk)]`` per block).

NVFP4, MXFP8 and ModelOpt rules were read from vllm-project/vllm's main branch as stored for this project, one
file version each (paths under ``vllm/model_executor/layers/quantization``; not necessarily v0.33.0's copy):

- compressed-tensors ``nvfp4-pack-quantized``: ``compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py``
  (``0094cb9b1d7bfe2054e733d2cad09b76cf319897``) and ``compressed_tensors_w4a16_nvfp4.py``
  (``17b6501a6ce929d83d4b5c1d408adf0ae4a610f8``): ``weight_packed`` U8 ``[out, in/2]``, ``weight_scale``
  ``GroupQuantScaleParameter`` float8_e4m3fn ``[out, in/16]``, ``weight_global_scale`` (and, W4A4 only,
  ``input_global_scale``) ``PerTensorScaleParameter`` float32, one per shard. ``process_weights_after_loading``
  keeps the ``max()`` over a fused layer's shards and only logs a warning when they differ; compressed-tensors'
  global scale is a divisor, so a shard whose scale is below the max dequantizes too small
  (:data:`Rule.FUSED_GLOBAL_SCALE_DIFFERS`). Experts: ``compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py``
  (``08f95fe5616661c4f8547a46ebdaa1ed22736edb``): ``w13_``/``w2_`` + the same names, ``w13_weight_global_scale``
  ``[E, 2]`` of which only ``[:, 0]`` (w1's) is used, with a warning when w3's differs.
- compressed-tensors ``mxfp8-quantized``: ``compressed_tensors/schemes/compressed_tensors_w8a8_mxfp8.py``
  (``109f2f21300015a1342c4b000205f5911eb66983``) and ``compressed_tensors_moe/compressed_tensors_moe_w8a8_mxfp8.py``
  (``2acef054699db27d8659024f3fb3d75e920ebe8b``): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale``
  uint8 (E8M0) ``[out, in/32]``; no input scale (dynamic MX activations).
- ModelOpt: ``modelopt.py`` (``00155cdecca722d98e34234c3d172725b7720b7d``, the version
  :mod:`converters.serving.modelopt` follows). ``from_config`` reads config.json's ``quantization_config``
  (``quant_algo``, ``ignore``, ``kv_cache_scheme``) or, without one, ``hf_quant_config.json`` (``quantization``:
  ``quant_algo``, ``exclude_modules``, ``kv_cache_quant_algo``, and for NVFP4 ``group_size`` too, all required:
  :data:`Rule.CONFIG_REJECTED`); ``model_loader/weight_utils.py`` ``get_quant_config`` prefers config.json's.
  ``is_layer_excluded``: ``is_layer_skipped`` (exact, fused shards), then an entry that is a substring of the layer
  name, then ``fnmatch``. ``ModelOptFp8LinearMethod``: ``weight`` F8_E4M3, ``weight_scale`` and ``input_scale``
  float32 per shard (differing weight scales are requantized to the max: no problem). ``ModelOptNvFp4LinearMethod``:
  ``weight`` U8 ``[out, in/2]``, ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` and
  ``input_scale`` float32 per shard, collapsed with ``max()`` and a warning (``weight_scale_2`` multiplies, so the
  other shards dequantize too large); ``ModelOptNvFp4FusedMoE`` keeps w1's ``w13_weight_scale_2``. KV-cache scales
  load through ``ModelOptKVCacheMethod`` under the base cache-scale mapper (``k_proj.k_scale`` ->
  ``attn.k_scale``).

Formats without rules here (ModelOpt algorithms other than FP8 and NVFP4, other compressed-tensors formats,
anything new) are not passed: the result says ``audited=False`` with a note naming the format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from converters.serving.audit.checks import Audit
from converters.serving.audit.compressed_tensors import parse_compressed_tensors, parse_fp8
from converters.serving.audit.modelopt import is_modelopt, parse_modelopt
from converters.serving.audit.names import ARCHITECTURES, KV_SUFFIXES, read_headers
from converters.serving.audit.result import AuditResult, Problem, Rule
from converters.serving.audit.schemes import QuantConfig

__all__ = ["AuditResult", "Problem", "Rule", "audit_export"]

logger = logging.getLogger(__name__)

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "output_scale", "weight_scale_2",
                  "weight_global_scale", "input_global_scale", *KV_SUFFIXES)


def audit_export(directory: Path) -> AuditResult:
    """Replay vLLM's loading rules on a serving export (headers and config only) and list what it would not use.

    Args:
        directory: a serving checkpoint: ``config.json`` (with ``quantization_config``, or ModelOpt's
            ``hf_quant_config.json`` beside it), safetensors shards and ``model.safetensors.index.json`` when sharded.

    Returns:
        The problems found; ``audited`` is False (with a note) for formats the audit has no rules for.

    Raises:
        ModelNotFoundError: a safetensors file is malformed.
        FileNotFoundError: ``config.json`` or a shard named by the index is missing.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    tensors = read_headers(directory)
    raw = config.get("quantization_config") or {}
    name = "/".join(str(raw[key]) for key in ("quant_method", "format") if raw.get(key)) or "none"
    problems: list[Problem] = []
    if is_modelopt(raw, directory):
        quant, reason, name, problems = parse_modelopt(raw, directory)
    else:
        quant, reason = _parse_quant_config(raw)
    result = AuditResult(format=name, audited=False, tensors_checked=len(tensors), problems=problems)
    result.scales_checked = sum(1 for key in tensors if key.rpartition(".")[2] in SCALE_SUFFIXES)
    if quant is None:
        result.notes.append(f"not audited: {reason}")
        return result
    if not raw:
        result.notes.append("no quantization_config in config.json: vLLM reads hf_quant_config.json only when run "
                            "with --quantization modelopt (or modelopt_fp4)")
    architecture = (config.get("architectures") or ["?"])[0]
    arch = ARCHITECTURES.get(architecture)
    if arch is None:
        arch = ARCHITECTURES["LlamaForCausalLM"]
        result.notes.append(f"architecture {architecture!r} has no entry in the audit's table: Llama's fused "
                            "layers (qkv_proj, gate_up_proj) assumed")
    result.audited = True
    # A tied head is not stored, yet vLLM builds it (lm_head shares embed_tokens' weight): an ignore entry naming
    # it matches that module.
    tied = bool(config.get("tie_word_embeddings")) and not any(key.startswith("lm_head.") for key in tensors)
    Audit(tensors, quant, arch, result, unstored_modules=("lm_head",) if tied else ()).run()
    return result


def _parse_quant_config(raw: dict[str, Any]) -> tuple[QuantConfig | None, str]:
    """The config as vLLM reads it, or None and why the audit has no rules for it."""
    method = raw.get("quant_method")
    if method == "fp8":
        return parse_fp8(raw), ""
    if method == "compressed-tensors":
        return parse_compressed_tensors(raw)
    return None, (f"quant_method {method!r} has no rules in this audit (known: compressed-tensors FP8, NVFP4 and "
                  "MXFP8, fp8, ModelOpt FP8 and NVFP4)")
