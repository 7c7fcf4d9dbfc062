"""What an FP8 model does to one Linear, for the quality pass: its weight as cast, and its input's cast.

A :class:`LayerCast` is either emulated from a recipe (the weight cast on the fly with the recipe's spec,
:func:`recipe_layer_casts`) or read back from a serving export's files (the weight as the engine dequantizes
it, :func:`export_layer_casts`). The input is cast per call with the spec's own scale, or with a fixed scale:
TE delayed scaling's from the calibrated amax, an export's static ``input_scale``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.calibration.scaling import E4M3_MAX
from converters.calibration.sensitivity import recipe_casts
from converters.casts.emulation import (
    E2M1_MAX,
    CastSpec,
    ScaleRule,
    cast_spec,
    fake_quantize,
    fake_quantize_per_tensor,
    max_abs,
    per_tensor_fp8,
    per_tensor_scale,
    tensor_scale,
)
from converters.errors import ModelConfigError, ModelNotFoundError
from converters.model.checkpoint import weight_files
from converters.model.files import pinned_model_path
from converters.model.quantized import source_quantization
from converters.model.safetensors_stream import SourceTensor, dtype_name, read_tensor, read_tensor_index
from converters.quality.engine_load import fused_groups, requantizing_reader

__all__ = ["ExportFiles", "LayerCast", "recipe_layer_casts", "export_layer_casts", "cast_linear_weight",
           "casting_linears"]

_CAST_SLICE_ELEMENTS = 2 * 2**20  #: weight elements cast at a time (cast_linear_weight)
#: the safetensors dtypes ExportFiles reads by byte range (those read_tensor maps to a torch dtype)
_RANGE_DTYPES = frozenset(dtype_name(dtype) for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))


@dataclass(frozen=True, kw_only=True)
class LayerCast:
    """One Linear's FP8 forward: ``linear(cast(x), W_fp8) + bias``.

    Exactly one of ``weight`` (cast the source weight with this spec) and ``read_weight`` (the weight as written
    to an export, dequantized to the dtype it is called with; called once per pass, while its layer is loaded) is
    set. ``input`` None keeps the input in high precision (weight-only formats); ``input_scale`` is a fixed
    multiplier ``fp8_max / amax`` of a per-tensor input spec (None: each call scales from its own amax).
    """

    weight: CastSpec | None = None
    read_weight: Callable[[torch.dtype], torch.Tensor] | None = None
    input: CastSpec | None = None
    input_scale: float | None = None
    #: NVFP4 input: the fixed tensor amax its global scale comes from (an export's input global scale, as the
    #: engine applies it); None: each call's own amax
    input_amax: float | None = None
    weight_scale_margin: int | None = None  #: TE delayed scaling: the weight's scale is fp8_max * 2**-margin / amax

    def __post_init__(self) -> None:
        if (self.weight is None) == (self.read_weight is None):
            raise ValueError("a LayerCast takes exactly one of weight (a cast spec) and read_weight (written weights)")
        if self.input_scale is not None and (self.input is None or not self.input.per_tensor):
            raise ValueError("input_scale needs a per-tensor input spec")
        if self.input_amax is not None and (self.input is None or self.input.scale is not ScaleRule.NVFP4):
            raise ValueError("input_amax (a fixed NVFP4 global scale) needs an NVFP4 input spec")


def recipe_layer_casts(recipe: Any, paths: Iterable[str], amax: Mapping[str, Any] | None = None
                       ) -> dict[str, LayerCast]:
    """Each of ``paths`` cast as ``recipe`` casts it in training (its forward: weight and input).

    TE delayed scaling casts the input with the scale its amax history holds; the artifact's history is seeded
    from calibration, so the input scale comes from the largest calibrated input amax of the layer (``amax``:
    path -> :class:`converters.calibration.amax.LayerAmax`); without one the input scales per call.
    """
    casts = recipe_casts(recipe)
    # margin 0 scales as every other per-tensor cast does: None, so that equal casts compare equal
    margin = (casts.delayed.margin or None) if casts.delayed is not None else None
    out = {}
    for path in paths:
        scale = None
        if casts.delayed is not None and casts.input is not None and amax and path in amax:
            top = amax[path].forward[:, 0].max()
            scale = float(tensor_scale(top, E4M3_MAX * 2.0 ** -(margin or 0))) if float(top) > 0 else None
        out[path] = LayerCast(weight=casts.weight, input=casts.input, input_scale=scale, weight_scale_margin=margin)
    return out


class ExportFiles:
    """A serving export's tensors by name, read one at a time (each file opened per read: no handle kept).

    Each file's header is read and checked once, when the export is listed; a read then takes the tensor's byte
    range from the file (:func:`~converters.model.safetensors_stream.read_tensor`: ``pread`` into the tensor's own
    memory, no mapping left behind) instead of opening the file with ``safe_open``, which parses the whole header
    again at every open (an export's header lists every tensor of its shard, and the quality pass reads a few
    tensors per Linear of every layer). A tensor of a dtype that reader does not take, or a file whose header it
    refuses, is read with ``safe_open`` as before.

    One-number tensors (per-tensor weight and input scales) are kept once read: a fused group's scales are read
    for each of its members and again by each member's weight, and each read opens a file.
    """

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open  # deferred: torch-only importers of this module never read an export

        self.directory, self._open = directory, safe_open
        self.file_of: dict[str, Path] = {}
        self._ranges: dict[str, SourceTensor] = {}
        self._scalars: dict[str, torch.Tensor] = {}
        for file in weight_files(directory):
            try:
                tensors, _metadata = read_tensor_index(file)
            except ModelNotFoundError:  # a header (a dtype) the range reader does not take: safe_open lists it
                with pinned_model_path(file) as pinned, safe_open(pinned, framework="pt") as handle:
                    self.file_of.update(dict.fromkeys(handle.keys(), file))
                continue
            self.file_of.update(dict.fromkeys(tensors, file))
            self._ranges.update((name, tensor) for name, tensor in tensors.items() if tensor.dtype in _RANGE_DTYPES)

    def read(self, name: str) -> torch.Tensor:
        if name in self._scalars:
            return self._scalars[name]
        if name not in self.file_of:
            raise KeyError(name)
        if name in self._ranges:
            tensor = read_tensor(self._ranges[name])
        else:
            with pinned_model_path(self.file_of[name]) as pinned, self._open(pinned, framework="pt") as handle:
                tensor = handle.get_tensor(name)
        if tensor.numel() == 1:
            self._scalars[name] = tensor
        return tensor


def export_layer_casts(directory: Path, paths: Iterable[str], on_disk_name: Callable[[str], str | None],
                       *, input_cast: str | None, library: str = "te", pow2_scales: bool = False,
                       files: ExportFiles | None = None) -> dict[str, LayerCast]:
    """The Linears among ``paths`` that the export in ``directory`` stores quantized, with their weights read back.

    ``on_disk_name(module_path + ".weight")`` gives the source's key for a weight (exports keep the source's
    names). The weight is dequantized with :meth:`SourceQuantization.dequantize` (the references' arithmetic);
    a stored ``input_scale`` (static activation scheme) fixes the input's scale, else ``input_cast`` (a spec
    name, the format's dynamic input cast; None: weight-only) scales per call. ``files``: the export's tensors,
    already listed (None: listed here).
    Raises ModelConfigError when ``directory`` holds no quantized checkpoint fp8forge reads.
    """
    scheme = source_quantization(directory)
    if scheme is None:
        raise ModelConfigError(f"{directory} declares no quantization: not a serving export", field="model")
    files = files or ExportFiles(directory)
    file_of, read = files.file_of, files.read
    spec = cast_spec(input_cast, library=library, pow2_scales=pow2_scales) if input_cast else None

    keys = {path: on_disk_name(f"{path}.weight") or f"{path}.weight" for path in paths}
    keys = {path: key for path, key in keys.items() if scheme.is_quantized(key, file_of)}
    # what the engine holds for each fused group (vLLM's qkv_proj, gate_up_proj): one input scale, and for
    # per-tensor FP8 weights one weight scale, the shards' largest (converters.quality.engine_load)
    group_of = {path: group for group in fused_groups(keys) for path in group}
    out = {}
    for path, key in keys.items():
        shards = [keys[member].removesuffix("weight") for member in group_of.get(path, [path])]
        read_weight = lambda dtype, key=key: scheme.dequantize(key, read, dtype)  # noqa: E731 - one per Linear
        weight_scales = [f"{shard}weight_scale" for shard in shards]
        if len(shards) > 1 and all(name in file_of and read(name).numel() == 1 for name in weight_scales):
            scales = [float(read(name).float().reshape(())) for name in weight_scales]
            own = scales[shards.index(key.removesuffix("weight"))]
            read_weight = requantizing_reader(key, read, own, max(scales))
        input_scale = input_amax = None
        if spec is not None and spec.per_tensor:
            stored = _largest(read, file_of, [f"{shard}input_scale" for shard in shards])
            input_scale = 1.0 / stored if stored is not None else None
        elif spec is not None and spec.scale is ScaleRule.NVFP4:
            # compressed-tensors stores the encode multiplier 448 * 6 / amax, ModelOpt the amax / (448 * 6)
            encode = _largest(read, file_of, [f"{shard}input_global_scale" for shard in shards])
            decode = _largest(read, file_of, [f"{shard}input_scale" for shard in shards])
            if encode is not None:
                input_amax = E4M3_MAX * E2M1_MAX / encode
            elif decode is not None:
                input_amax = decode * E4M3_MAX * E2M1_MAX
        out[path] = LayerCast(read_weight=read_weight, input=spec, input_scale=input_scale, input_amax=input_amax)
    return out


def _largest(read: Callable[[str], torch.Tensor], names: Mapping[str, Any], keys: list[str]) -> float | None:
    """The largest of the stored one-number tensors ``keys`` (a fused group's shards), None when one is missing."""
    if not all(key in names for key in keys):
        return None
    return max(float(read(key).float().reshape(-1)[0]) for key in keys)


def cast_linear_weight(cast: LayerCast, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the FP8 GEMM multiplies, in ``dtype``: read back, or ``weight`` cast with the spec (in fp32, then
    rounded to ``dtype``)."""
    if cast.read_weight is not None:
        written = cast.read_weight(dtype)
        if written.shape != weight.shape:
            raise ValueError(f"the written weight is {tuple(written.shape)}, the model's {tuple(weight.shape)}")
        return written
    spec = cast.weight
    amax = max_abs(weight).float()
    scale = None
    if cast.weight_scale_margin is not None and spec.per_tensor:
        scale = tensor_scale(amax, E4M3_MAX * 2.0 ** -cast.weight_scale_margin)
    # Cast by slices of whole block rows, each upcast on its own, with the whole weight's amax (per-tensor and
    # NVFP4 global scales): the same values, with a cast's transient tensors a slice's size, not the weight's
    # (several times a gate projection's fp32 bytes at once otherwise).
    unit = spec.block[0] or 1
    rows = max(unit, _CAST_SLICE_ELEMENTS // max(weight.shape[1], 1) // unit * unit)
    out = torch.empty(weight.shape, dtype=dtype)
    per_tensor = per_tensor_fp8(spec) is not None
    if per_tensor and scale is None:
        scale = per_tensor_scale(spec, amax)
    for start in range(0, weight.shape[0], rows):
        part = weight[start:start + rows]
        if per_tensor:  # the same bits by a table of the 256 codes' values (fake_quantize_per_tensor)
            fake_quantize_per_tensor(part, spec, scale, dtype, out=out[start:start + rows])
        else:
            out[start:start + rows] = fake_quantize(part.float(), spec, scale=scale, tensor_amax=amax)
    return out


def _cast_input(x: torch.Tensor, spec: CastSpec, scale: float | None, amax: torch.Tensor | None = None,
                lengths: list[int] | None = None) -> torch.Tensor:
    """A call's input cast with ``spec`` (``scale``: a fixed per-tensor one; ``amax``: a fixed NVFP4 global amax;
    None: from the input itself) and dequantized, in the input's dtype (the dtype the layer computes in).

    ``lengths``: ``x`` is a batch of right-padded texts (``[texts, positions, features]``) with these many positions
    each; each text is cast on its own positions, as a call of that text alone casts it (a scale taken from the
    input's amax is the text's, never its neighbours' nor the padding's). The padding stays as it is: no text's
    position reads it."""
    if lengths is not None and x.dim() == 3 and lengths != [x.shape[1]] * x.shape[0]:
        out = x.clone()
        for row, length in enumerate(lengths):
            out[row, :length] = _cast_input(x[row, :length], spec, scale, amax)
        return out
    flat = x.reshape(-1, x.shape[-1])
    if per_tensor_fp8(spec) is None or flat.numel() == 0:
        return fake_quantize(flat, spec, scale=scale, tensor_amax=amax).reshape(x.shape).to(x.dtype)
    given = torch.tensor(scale, dtype=torch.float32) if scale is not None else \
        per_tensor_scale(spec, max_abs(flat).float())
    return fake_quantize_per_tensor(flat, spec, given, x.dtype).reshape(x.shape)


def input_amax(cast: LayerCast) -> torch.Tensor | None:
    """``cast.input_amax`` as the fp32 tensor ``fake_quantize`` takes (None: each call's own amax)."""
    return None if cast.input_amax is None else torch.tensor(cast.input_amax, dtype=torch.float32)


class _CastForward:
    """Replaces a Linear's ``forward`` (its hooks still run around it) with the FP8 one. ``in_place``: the cast
    weight is the module's own weight now (:class:`casting_linears`)."""

    def __init__(self, module: nn.Linear, cast: LayerCast, owner: casting_linears, *, in_place: bool = False) -> None:
        self.module, self.cast, self.owner = module, cast, owner
        self.weight = None
        if in_place:
            # the cast takes the original's place, in its dtype (the dtype of the calls): the layer holds one
            # weight per Linear, not two
            module.weight.data = cast_linear_weight(cast, module.weight.detach(), module.weight.dtype)
        else:
            # cast once per layer and variant, then kept in the dtype of the calls (not converted per call)
            self.weight = cast_linear_weight(cast, module.weight.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cast = self.cast
        if cast.input is not None:
            x = _cast_input(x, cast.input, cast.input_scale, input_amax(cast), self.owner.lengths)
        if self.weight is None:
            return nn.functional.linear(x, self.module.weight, self.module.bias)
        if self.weight.dtype != x.dtype:
            self.weight = self.weight.to(x.dtype)
        return nn.functional.linear(x, self.weight, self.module.bias)


class casting_linears:  # noqa: N801 - a context manager read as a phrase: ``with casting_linears(...)``
    """Inside the block, each ``{path: LayerCast}`` Linear of ``model`` runs its FP8 forward (None: unchanged).

    ``in_place``: each cast weight replaces the Linear's own weight, which is lost (the caller loads it again if
    it needs it), so that a layer holds one copy of its weights: the layer-sequential quality pass, which runs
    the source's stream through a layer before the FP8 ones. ``lengths`` (set between calls): the calls to come
    take batches of right-padded texts of these many positions each (see ``_cast_input``); None: every row of a
    call is one text's.
    """

    def __init__(self, model: nn.Module, casts: Mapping[str, LayerCast | None], *, in_place: bool = False) -> None:
        self.model, self.casts = model, {path: cast for path, cast in casts.items() if cast is not None}
        self.in_place = in_place
        self.lengths: list[int] | None = None

    def __enter__(self) -> casting_linears:
        for path, cast in self.casts.items():
            module = self.model.get_submodule(path)
            if not isinstance(module, nn.Linear):
                raise ValueError(f"{path} is a {type(module).__name__}, not a Linear: the quality pass casts Linears")
            module.forward = _CastForward(module, cast, self, in_place=self.in_place)
        return self

    def __exit__(self, *exc: Any) -> None:
        for path in self.casts:
            self.model.get_submodule(path).__dict__.pop("forward", None)
