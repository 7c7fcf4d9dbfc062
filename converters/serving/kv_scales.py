"""FP8 KV-cache scales in a serving checkpoint, from the amax the job's calibration recorded.

Names: ``<attention module's on-disk prefix>.k_scale`` and ``.v_scale`` (``model.layers.0.self_attn.k_scale``),
the names compressed-tensors gives the parameters it registers on the attention module
(``initialize_attn_qparams``, 0.20.1) and so the names llm-compressor saves. vLLM maps them onto its
``Attention`` layer (``maybe_remap_kv_scale_name``: ``.k_scale`` -> ``.attn.k_scale``,
``vllm/model_executor/model_loader/weight_utils.py`` @ 0a1ee72ed53f07ca8e57e5e82fdbd89734b39026); SGLang's
loaders use the same remapping.

Values: ``amax / 448`` per tensor, shape ``[1]``, in the model's dtype, computed in that dtype (a zero scale
becomes the dtype's eps): compressed-tensors' ``strategy: "tensor"`` arithmetic, as for the weight and input scales
of :mod:`converters.serving.compressed_tensors`. Per KV head (compressed-tensors' ``attn_head``, shape
``[kv_heads, 1, 1]``) is not written: vLLM's ``BaseKVCacheMethod`` refuses any scale that is not one number
("Only support per-tensor scaling factor for fp8 KV cache"), so such a checkpoint would not load there. The
per-head amax is in the report, for a reader who wants to see how uneven the heads are.

Each pair is written right after the last tensor of its attention module in that tensor's file
(``ServingPlan.extra_tensors``), so the index stays consistent whatever the sharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from converters.calibration.kv_cache import KvAmax
from converters.calibration.scaling import E4M3_MAX
from converters.errors import ConversionError
from converters.serving.plan import ServingPlan

__all__ = ["KV_CACHE_FP8", "kv_scale", "attach_kv_scales"]

KV_CACHE_FP8 = "fp8"


def kv_scale(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """``[amax / 448]`` computed in ``dtype``; a zero scale becomes ``dtype``'s eps (compressed-tensors' rule)."""
    scale = torch.tensor([amax], dtype=dtype) / E4M3_MAX
    return torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)


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


def attach_kv_scales(plan: ServingPlan, amax: Mapping[str, KvAmax], target_of: Mapping[str, str],
                     dtype: torch.dtype) -> dict[str, Any]:
    """Add every attention layer's ``k_scale``/``v_scale`` to ``plan.extra_tensors`` and set ``plan.kv_cache``.

    ``amax`` is :meth:`KvCacheRecorder.results` (attention module path -> amax); ``dtype`` the model's.
    Returns the report block: the scheme, and per on-disk attention prefix its module path, the key and value
    amax (per tensor and per KV head) and the scales written. Raises ConversionError (see :func:`_disk_prefix`).
    """
    layers: dict[str, Any] = {}
    for path, layer in amax.items():
        prefix, anchor = _disk_prefix(path, target_of)
        k_scale, v_scale = kv_scale(layer.key_amax, dtype), kv_scale(layer.value_amax, dtype)
        plan.extra_tensors[f"{prefix}.k_scale"] = (anchor, k_scale)
        plan.extra_tensors[f"{prefix}.v_scale"] = (anchor, v_scale)
        layers[prefix] = {"module": path, "k_amax": layer.key_amax, "v_amax": layer.value_amax,
                          "k_scale": float(k_scale), "v_scale": float(v_scale),
                          "k_amax_per_head": layer.key.tolist(), "v_amax_per_head": layer.value.tolist()}
    plan.kv_cache = KV_CACHE_FP8
    return {"dtype": "float8_e4m3fn", "strategy": "tensor", "scale_dtype": str(dtype).removeprefix("torch."),
            "layers": layers}
