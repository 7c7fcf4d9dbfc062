"""The parameters vLLM creates for each quantized Linear / experts scheme, and the config parts it decides by.

A :class:`Scheme` names the weight parameter and every scale with its layout and the dtypes its loader reads
correctly; ``shared`` lists the per-tensor scales vLLM collapses to one value per fused layer (checked for
agreement across shards). The factories below are the schemes of the formats this audit has rules for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FLOAT_SCALES", "FP8", "PACKED", "QuantConfig", "Scale", "Scheme", "fp8_scheme", "modelopt_scheme",
           "mxfp8_scheme", "nvfp4_scheme"]

FP8 = "F8_E4M3"
PACKED = "U8"  #: two E2M1 codes a byte (NVFP4 weights)
FLOAT_SCALES = ("F32", "BF16", "F16")
_TENSOR = ((1,), ())


@dataclass(frozen=True, kw_only=True)
class Scale:
    """One scale parameter: ``tensor`` (one per shard), ``channel`` (one per row) or ``block`` (rows x columns)."""

    name: str
    layout: str = "tensor"
    block: tuple[int, int] = (128, 128)  #: (rows, columns) a block scale covers; (1, n) for a group of n inputs
    dtypes: tuple[str, ...] = FLOAT_SCALES

    def shapes(self, out_features: int, in_features: int) -> tuple[tuple[int, ...], ...]:
        """The shapes the loader accepts for one checkpoint shard of an ``[out, in]`` weight (logical, unpacked)."""
        if self.layout == "tensor":
            return _TENSOR
        if self.layout == "channel":
            return (out_features, 1), (out_features,)
        rows, columns = self.block
        return ((math.ceil(out_features / rows), math.ceil(in_features / columns)),)


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """The parameters vLLM creates for one quantized Linear (or experts) scheme."""

    label: str  #: for messages: "per-tensor FP8", "NVFP4 W4A4", ...
    weight: str = "weight"  #: the quantized weight's checkpoint name
    scales: tuple[Scale, ...]
    shared: tuple[str, ...] = ()  #: per-tensor scales vLLM keeps one of per fused Linear (max over shards)
    shared_experts: tuple[str, ...] = ()  #: per-tensor scales vLLM keeps one of per expert's w1/w3 (w1's)

    def params(self) -> tuple[str, ...]:
        return (self.weight, *(scale.name for scale in self.scales))


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """The parts of the quantization config vLLM's load decisions depend on."""

    kind: str  #: compressed-tensors, fp8 or modelopt (how ignore entries match)
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]  #: (targets, scheme) per config group
    ignore: tuple[str, ...]
    kv_cache: bool  #: the config declares KV-cache quantization


def fp8_scheme(*, strategy: str, static_input: bool, block: tuple[int, int] | None = None,
               scale: str = "weight_scale") -> Scheme:
    """FP8 E4M3 weights with a ``tensor``, ``channel`` or ``block`` weight scale (and a static input scale)."""
    weight_scale = Scale(name=scale, layout=strategy, block=block or (128, 128))
    inputs = (Scale(name="input_scale"),) if static_input else ()
    return Scheme(label=f"{strategy} FP8", scales=(weight_scale, *inputs))


def nvfp4_scheme(*, activations: bool) -> Scheme:
    """compressed-tensors ``nvfp4-pack-quantized``: W4A4 (``CompressedTensorsW4A4Fp4``) or W4A16."""
    inputs = (Scale(name="input_global_scale"),) if activations else ()
    shared = ("weight_global_scale", *(("input_global_scale",) if activations else ()))
    return Scheme(label=f"NVFP4 {'W4A4' if activations else 'W4A16'}", weight="weight_packed",
                  scales=(Scale(name="weight_scale", layout="block", block=(1, 16), dtypes=(FP8,)),
                          Scale(name="weight_global_scale"), *inputs),
                  shared=shared, shared_experts=("weight_global_scale",))


def mxfp8_scheme() -> Scheme:
    """compressed-tensors ``mxfp8-quantized`` (``CompressedTensorsW8A8Mxfp8``): E8M0 exponents per 32 inputs."""
    return Scheme(label="MXFP8", scales=(Scale(name="weight_scale", layout="block", block=(1, 32),
                                               dtypes=(PACKED,)),))


def modelopt_scheme(quant_algo: str) -> Scheme:
    """ModelOpt ``FP8`` (``ModelOptFp8LinearMethod``) or ``NVFP4`` (``ModelOptNvFp4LinearMethod``)."""
    if quant_algo == "FP8":
        # FP8 shards with different weight scales are requantized to the largest (requantize_with_max_scale): no
        # shared rule.
        return Scheme(label="ModelOpt FP8", scales=(Scale(name="weight_scale"), Scale(name="input_scale")))
    return Scheme(label="ModelOpt NVFP4",
                  scales=(Scale(name="weight_scale", layout="block", block=(1, 16), dtypes=(FP8,)),
                          Scale(name="weight_scale_2"), Scale(name="input_scale")),
                  shared=("weight_scale_2", "input_scale"), shared_experts=("weight_scale_2",))
