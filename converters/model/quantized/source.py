"""What a quantized checkpoint stores per weight, and how to read one weight back in high precision.

A :class:`SourceQuantization` is built from the checkpoint's config (:func:`~converters.model.quantized.detect.
source_quantization`); which weights are quantized is read from the tensors themselves: a weight is quantized
when its stored tensor and its scales are there (the config's ignore lists say the same for a well-formed
checkpoint, and they are reported by :meth:`SourceQuantization.describe`).

Per scheme (``<p>`` is the module path, ``<p>.weight`` the logical weight key):

=========================  =================================  ===============================================
scheme                     stored weight                      scales (and other tensors of the weight)
=========================  =================================  ===============================================
fp8-block, fp8-tensor      ``<p>.weight`` F8_E4M3             ``<p>.weight_scale_inv`` F32 (block grid or one),
                                                              ``<p>.activation_scale`` (static activations)
compressed-tensors-fp8     ``<p>.weight`` F8_E4M3             ``<p>.weight_scale`` (tensor/channel/group/block),
                                                              ``<p>.input_scale``
compressed-tensors-nvfp4   ``<p>.weight_packed`` U8 [o, i/2]  ``<p>.weight_scale`` F8_E4M3 [o, i/16],
                                                              ``<p>.weight_global_scale``, ``<p>.input_global_scale``
compressed-tensors-mxfp8   ``<p>.weight`` F8_E4M3             ``<p>.weight_scale`` U8 E8M0 [o, i/32]
modelopt-fp8               ``<p>.weight`` F8_E4M3             ``<p>.weight_scale`` F32, ``<p>.input_scale``
modelopt-nvfp4             ``<p>.weight`` U8 [o, i/2]         ``<p>.weight_scale`` F8_E4M3 [o, i/16],
                                                              ``<p>.weight_scale_2`` F32, ``<p>.input_scale``
=========================  =================================  ===============================================
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from converters.errors import ModelConfigError
from converters.model.finite import all_finite
from converters.model.quantized.arithmetic import (
    dequantize_fp8,
    dequantize_nvfp4,
    nvfp4_scale_error,
    scale_shape_error,
)

__all__ = ["Scheme", "SourceQuantization"]

_FP8 = (torch.float8_e4m3fn,)
_PACKED = (torch.uint8, torch.int8)


class Scheme(str, enum.Enum):
    """The quantized checkpoint layouts fp8forge reads."""

    #: transformers FineGrainedFP8 (``quant_method: "fp8"``, ``weight_block_size``): DeepSeek-V3, Qwen3-FP8
    FP8_BLOCK = "fp8-block"
    #: ``quant_method: "fp8"`` without ``weight_block_size``: one ``weight_scale_inv`` per weight
    FP8_TENSOR = "fp8-tensor"
    #: compressed-tensors ``float-quantized`` (or ``naive-quantized``) FP8: per tensor, channel, group or block
    CT_FP8 = "compressed-tensors-fp8"
    #: compressed-tensors ``nvfp4-pack-quantized``
    CT_NVFP4 = "compressed-tensors-nvfp4"
    #: compressed-tensors ``mxfp8-quantized``
    CT_MXFP8 = "compressed-tensors-mxfp8"
    #: compressed-tensors ``mixed-precision``: config groups of several of the three formats above
    CT_MIXED = "compressed-tensors-mixed"
    #: NVIDIA ModelOpt ``quant_algo: "FP8"``
    MODELOPT_FP8 = "modelopt-fp8"
    #: NVIDIA ModelOpt ``quant_algo: "NVFP4"``
    MODELOPT_NVFP4 = "modelopt-nvfp4"


_COMPRESSED_TENSORS = {Scheme.CT_FP8, Scheme.CT_NVFP4, Scheme.CT_MXFP8, Scheme.CT_MIXED}
#: the tensors of each scheme beside the stored weight, as suffixes of the module path
_COMPANIONS: dict[Scheme, tuple[str, ...]] = {
    Scheme.FP8_BLOCK: ("weight_scale_inv", "activation_scale"),
    Scheme.FP8_TENSOR: ("weight_scale_inv", "activation_scale"),
    Scheme.CT_FP8: ("weight_scale", "input_scale"),
    Scheme.CT_NVFP4: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    Scheme.CT_MXFP8: ("weight_scale",),
    Scheme.CT_MIXED: ("weight_packed", "weight_scale", "weight_global_scale", "input_scale", "input_global_scale"),
    Scheme.MODELOPT_FP8: ("weight_scale", "input_scale"),
    Scheme.MODELOPT_NVFP4: ("weight_scale", "weight_scale_2", "input_scale"),
}
_KV_CACHE_SCALES = (".k_scale", ".v_scale", ".q_scale")


@dataclass(frozen=True, kw_only=True)
class SourceQuantization:
    """The quantization of a checkpoint fp8forge reads from (see the module docstring for each scheme's tensors).

    ``block_size``: the FP8 block (rows, cols) of ``fp8-block`` and of compressed-tensors' block strategy;
    ``group_size``: the NVFP4/MXFP8 group along the input dim; ``not_converted``: the config's list of modules
    kept in high precision (``modules_to_not_convert``, ``ignore``, ``exclude_modules``), as written;
    ``details``: what else the config says (activation scheme, strategies, KV cache), for the report.
    """

    scheme: Scheme
    quant_method: str
    block_size: tuple[int, int] | None = None
    group_size: int | None = None
    not_converted: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", Scheme(self.scheme))
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ValueError(f"block_size: two positive ints expected, got {self.block_size!r}")

    @property
    def packed(self) -> bool:
        """Whether the stored weight holds two FP4 codes a byte (the logical input dim is twice the stored one)."""
        return self.scheme in (Scheme.CT_NVFP4, Scheme.MODELOPT_NVFP4)

    def describe(self, tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
        """The report's ``source_quantization`` block; with the checkpoint's tensor names, also which Linear
        weights are stored quantized and which are not (``quantized_modules``, ``unquantized_modules``)."""
        described: dict[str, Any] = {"scheme": self.scheme.value, "quant_method": self.quant_method,
                                     "block_size": list(self.block_size) if self.block_size else None,
                                     "group_size": self.group_size, "not_converted": list(self.not_converted),
                                     **self.details}
        if tensor_names is not None:
            names = set(tensor_names)
            quantized = self.quantized_weights(names)
            described["quantized_modules"] = [key.removesuffix(".weight") for key in quantized]
            kept = sorted(name for name in names if name.endswith(".weight") and name not in set(quantized)
                          and name.removesuffix(".weight") + ".weight_packed" not in names)
            described["unquantized_weights"] = kept
            described["kv_cache_scales"] = self.kv_cache_keys(names)
        return described

    def _required(self, weight_key: str, tensor_names: Collection[str]) -> list[str]:
        """The stored tensors without which ``weight_key`` is not quantized (its stored weight and main scale)."""
        prefix = _prefix(weight_key)
        if self.scheme in (Scheme.FP8_BLOCK, Scheme.FP8_TENSOR):
            return [weight_key, f"{weight_key}_scale_inv"]
        if self.scheme is Scheme.CT_MIXED and f"{prefix}weight_packed" in tensor_names:
            return [f"{prefix}weight_packed", f"{prefix}weight_scale", f"{prefix}weight_global_scale"]
        stored = f"{prefix}weight_packed" if self.scheme is Scheme.CT_NVFP4 else weight_key
        required = [stored, f"{prefix}weight_scale"]
        if self.scheme is Scheme.CT_NVFP4:
            required.append(f"{prefix}weight_global_scale")
        elif self.scheme is Scheme.MODELOPT_NVFP4:
            required.append(f"{prefix}weight_scale_2")
        return required

    def is_quantized(self, weight_key: str, tensor_names: Collection[str]) -> bool:
        """Whether ``weight_key`` (``<module>.weight``) is stored quantized: its stored weight and scales are in
        ``tensor_names`` (the names of the whole checkpoint, or of the shard that holds it)."""
        if not weight_key.endswith("weight"):
            return False
        return all(name in tensor_names for name in self._required(weight_key, tensor_names))

    def quantized_weights(self, tensor_names: Collection[str]) -> list[str]:
        """The logical weight keys (``<module>.weight``) stored quantized, sorted: for NVFP4 in compressed-tensors
        the key ``<module>.weight`` itself is not among the tensors (``weight_packed`` is)."""
        names = tensor_names if isinstance(tensor_names, (set, frozenset, Mapping)) else set(tensor_names)
        suffix = ".weight_scale_inv" if self.scheme in (Scheme.FP8_BLOCK, Scheme.FP8_TENSOR) else ".weight_scale"
        keys = (f"{name.removesuffix(suffix)}.weight" for name in names if name.endswith(suffix))
        return sorted(key for key in keys if self.is_quantized(key, names))

    def companion_keys(self, weight_key: str) -> list[str]:
        """The stored tensors that belong to the quantized ``weight_key`` besides ``weight_key`` itself: its
        scales (and ``weight_packed``, which stands for ``weight`` in compressed-tensors NVFP4). Some are optional
        (``input_scale`` of a dynamic scheme): filter the list by the checkpoint's tensor names."""
        prefix = _prefix(weight_key)
        return [f"{prefix}{suffix}" for suffix in _COMPANIONS[self.scheme]]

    def kv_cache_keys(self, tensor_names: Iterable[str]) -> list[str]:
        """The KV-cache scales among ``tensor_names`` (``k_scale``/``v_scale``/``q_scale`` of attention modules or
        ModelOpt's ``k_proj.k_scale``): tensors a high-precision model does not have."""
        return sorted(name for name in tensor_names if name.endswith(_KV_CACHE_SCALES))

    def logical_shape(self, weight_key: str, tensors: Mapping[str, Any]) -> tuple[int, ...]:
        """The high-precision shape of ``weight_key``; ``tensors`` maps stored names to anything with ``shape``
        (tensors, ``SourceTensor``). NVFP4 ``[out, in/2]`` -> ``[out, in]``."""
        packed = f"{_prefix(weight_key)}weight_packed"
        if self.scheme is Scheme.CT_NVFP4 or self.scheme is Scheme.CT_MIXED and packed in tensors:
            shape = tuple(tensors[packed].shape)
        else:
            shape = tuple(tensors[weight_key].shape)
        return (*shape[:-1], shape[-1] * 2) if self.packed or packed in tensors else shape

    def check_scale_shapes(self, weight_key: str, tensors: Mapping[str, Any]) -> None:
        """Refuse scales whose shape does not fit the quantized ``weight_key`` (from headers alone: ``tensors`` maps
        stored names to anything with ``shape``), before anything is read or written.

        Raises:
            ModelConfigError: (field ``model``) naming the scale, its shape and the shapes that would fit.
        """
        prefix = _prefix(weight_key)
        packed = f"{prefix}weight_packed"
        if self.scheme in (Scheme.CT_NVFP4, Scheme.MODELOPT_NVFP4) or self.scheme is Scheme.CT_MIXED \
                and packed in tensors:
            modelopt = self.scheme is Scheme.MODELOPT_NVFP4
            second = f"{prefix}weight_scale_2" if modelopt else f"{prefix}weight_global_scale"
            scale = f"{prefix}weight_scale"
            error = nvfp4_scale_error(tuple(tensors[weight_key if modelopt else packed].shape),
                                      tuple(tensors[scale].shape), math.prod(tensors[second].shape))
        else:
            fp8_scheme = self.scheme in (Scheme.FP8_BLOCK, Scheme.FP8_TENSOR)
            scale = f"{weight_key}_scale_inv" if fp8_scheme else f"{prefix}weight_scale"
            error = scale_shape_error(tuple(tensors[scale].shape), tuple(tensors[weight_key].shape), self.block_size)
        if error is not None:
            raise ModelConfigError(f"{scale} ({self.scheme.value}) does not fit {weight_key}: {error}. The checkpoint "
                                   f"is damaged or not in the layout its config declares: re-export or re-download "
                                   f"it", field="model")

    def dequantize(self, weight_key: str, read: Callable[[str], torch.Tensor],
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``weight_key`` in ``dtype``, from its stored weight and scales, each got with ``read(name)``.

        Arithmetic (see :mod:`converters.model.quantized.arithmetic`), the reference each matches bit for bit:

        - fp8-block/-tensor: ``fp8.float() * weight_scale_inv`` broadcast per ``block_size`` block (a partial
          last block row/column takes its block's scale), in fp32, then rounded to ``dtype`` (nearest even); the
          fp32 product is itself rounded when the fp32 scale has more than 20 significant bits, as in
          transformers 5.24 ``Fp8Dequantize._dequantize_one`` (and DeepSeek-V3's ``weight_dequant``).
        - compressed-tensors FP8 (any strategy): ``fp8.float() * weight_scale`` in fp32, then ``dtype``:
          ``decompress`` of compressed-tensors 0.20.1, which multiplies in the scale's dtype; the same bits when
          ``dtype`` is the scale's dtype (its output dtype) or the scale is fp32. A bf16 scale times an E4M3 code
          is exact in fp32, so the one rounding is to ``dtype``.
        - compressed-tensors MXFP8: ``fp8.float() * 2**(weight_scale - 127)`` (exact), then ``dtype``.
        - compressed-tensors NVFP4: ``e2m1 * fp32(weight_scale(e4m3) / weight_global_scale)``, then ``dtype``:
          ``NVFP4PackedCompressor.decompress`` (which returns bf16).
        - modelopt-fp8: ``fp8.float() * weight_scale`` in fp32, then ``dtype`` (the fp32 scale as vLLM's GEMM
          applies it). ModelOpt's own ``FP8QTensor.dequantize(dtype)`` is ``w.to(dtype) * scale.to(dtype)``: the
          same bits for fp32; for bf16 it rounds the scale first, and the two are one bf16 ulp apart on about a
          quarter of the elements (tested on the tiny Llama's export: never more than one ulp).
        - modelopt-nvfp4: ``e2m1 * fp32(weight_scale(e4m3) * weight_scale_2)``, then ``dtype``: ModelOpt's
          ``NVFP4QTensor.dequantize``.

        The result is never the weight the writer quantized from: quantization dropped information.

        Every scale read must be finite, and so must the weight it gives: a NaN or infinite scale, a NaN code or
        a scale so large that code x scale overflows ``dtype`` is refused here, the one place a source's scales
        are read, rather than published as a layer of NaN.

        Raises:
            ModelConfigError: (field ``model``) ``weight_key`` is not quantized in this layout, a stored tensor has
                the wrong dtype or a shape its scale does not fit, or a scale or the result is not finite.
        """
        try:
            weight = self._dequantize(weight_key, _finite_scales(read, weight_key), dtype)
        except (ValueError, KeyError) as exc:
            raise ModelConfigError(f"cannot dequantize {weight_key} ({self.scheme.value}): {exc}",
                                   field="model") from exc
        if not all_finite(weight):
            raise ModelConfigError(
                f"cannot dequantize {weight_key} ({self.scheme.value}): its codes times its scales give NaN or "
                f"infinite values in {str(dtype).removeprefix('torch.')} (a NaN code, or a scale so large that a "
                f"code times it passes {torch.finfo(dtype).max:.4g}). The checkpoint is damaged: re-export it from "
                f"its high-precision original or re-download it", field="model")
        return weight

    def _dequantize(self, weight_key: str, read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The arithmetic of :meth:`dequantize` on the tensors ``read`` gives, their shapes checked first (so that
        an error names the scale that does not fit)."""
        prefix = _prefix(weight_key)
        if self.scheme in (Scheme.FP8_BLOCK, Scheme.FP8_TENSOR):
            names = (weight_key, f"{weight_key}_scale_inv")
            tensors = {names[0]: _expect(read, names[0], _FP8), names[1]: read(names[1])}
        elif self.scheme is Scheme.MODELOPT_NVFP4:
            names = (weight_key, f"{prefix}weight_scale", f"{prefix}weight_scale_2")
            tensors = {names[0]: _expect(read, names[0], _PACKED), names[1]: _expect(read, names[1], _FP8),
                       names[2]: read(names[2])}
        else:
            packed = _read_packed(read, prefix, required=self.scheme is Scheme.CT_NVFP4) \
                if self.scheme in (Scheme.CT_NVFP4, Scheme.CT_MIXED) else None
            if packed is not None:
                names = (f"{prefix}weight_packed", f"{prefix}weight_scale", f"{prefix}weight_global_scale")
                tensors = {names[0]: packed, names[1]: _expect(read, names[1], _FP8), names[2]: read(names[2])}
            else:
                names = (weight_key, f"{prefix}weight_scale")
                tensors = {names[0]: _expect(read, names[0], _FP8), names[1]: read(names[1])}
        self.check_scale_shapes(weight_key, tensors)
        values = [tensors[name] for name in names]
        if len(values) == 2:
            return dequantize_fp8(*values, dtype, self.block_size)
        return dequantize_nvfp4(*values, dtype, divide=self.scheme is not Scheme.MODELOPT_NVFP4)


def _prefix(weight_key: str) -> str:
    return weight_key.removesuffix("weight")


#: the byte of an E8M0 scale (MX formats' uint8 ``weight_scale``) that stands for NaN
_E8M0_NAN = 0xFF


def _finite_scales(read: Callable[[str], torch.Tensor], weight_key: str) -> Callable[[str], torch.Tensor]:
    """``read``, refusing any scale of ``weight_key`` (whatever it reads but the stored codes) that holds NaN or an
    infinity: scales are small next to their weight, so the check costs little."""
    stored = (weight_key, f"{_prefix(weight_key)}weight_packed")

    def checked(name: str) -> torch.Tensor:
        tensor = read(name)
        if name in stored:
            return tensor
        bad = bool((tensor == _E8M0_NAN).any()) if tensor.dtype == torch.uint8 else not all_finite(tensor)
        if bad:
            raise ValueError(f"its scale {name} holds NaN or infinite values (a scale must be a finite number). The "
                             f"checkpoint is damaged: re-export it from its high-precision original or re-download it")
        return tensor

    return checked


def _read_packed(read: Callable[[str], torch.Tensor], prefix: str, *, required: bool) -> torch.Tensor | None:
    """``<prefix>weight_packed``; None when it is not stored and not ``required`` (a mixed-precision
    checkpoint's FP8 module)."""
    try:
        return _expect(read, f"{prefix}weight_packed", _PACKED)
    except KeyError:
        if required:
            raise
        return None


def _expect(read: Callable[[str], torch.Tensor], name: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    tensor = read(name)
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} is {tensor.dtype}, expected {' or '.join(str(dtype) for dtype in dtypes)}")
    return tensor
