"""Serving exports: FP8 weights (and static input scales) from the job's own calibration, streamed shard by shard.

An inference engine loads a serving checkpoint as a whole directory: the source's weight files with the
quantized Linears' ``weight`` replaced by FP8 and their scales added beside it, under the checkpoint's own
tensor names, plus ``config.json`` with the format's ``quantization_config``. Every other tensor is copied
as bytes (:mod:`converters.model.safetensors_stream`), and only one weight is ever decoded at a time, so the
export's memory is that of the largest weight, whatever the model's size. Which weights are quantized, and with
which input scales, is the format's :class:`~converters.serving.selection.ServingSelection`.

Formats with a per-tensor weight scale that engines require equal across a fused group (NVFP4's global
scale) set ``needs_weight_amax``: before writing, :func:`set_weight_amax` reads each quantized weight once
(one tensor at a time) and records the group's largest ``|w|``, which ``quantize`` then receives as
``weight_amax``. Formats that need files beside config.json (ModelOpt's ``hf_quant_config.json``) define
``side_files``.

:func:`quantize_step` is the one rewrite step of a quantized weight for every writer of quantized shards (this
module's, requantize's, sync's and the mixed-precision checkpoints'); its conversion, :func:`quantize_weight`, runs in
strips of rows where the cast allows and checks what it gives finite. A weight calibration already quantized (GPTQ
rounding: the selection's ``rounded``) is written by :func:`rounded_step` from the tensors it stored instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from converters.casts.emulation import max_abs
from converters.errors import ConversionError
from converters.model.files import FileConfinement, is_plain_file_name
from converters.model.finite import check_converted
from converters.model.safetensors_stream import ReadBuffers, read_tensor, read_tensor_index
from converters.rewrite import Compute, Copy, cast_in_strips, finish_checkpoint, strip_rows
from converters.rewrite import write_shard as rewrite_shard
from converters.serving.nvfp4_gptq import ROUNDED_TENSORS
from converters.serving.selection import ServingFormat, ServingSelection
from converters.serving.written_sqnr import written_weight_sqnr

__all__ = [
    "layer_stats",
    "quantize_step",
    "quantize_weight",
    "rounded_step",
    "set_weight_amax",
    "write_serving_checkpoint",
    "write_serving_file",
]


def set_weight_amax(selection: ServingSelection, weight_files: list[Path]) -> None:
    """Each quantized Linear's and expert unit's weight amax, shared by its fused group (a streaming pre-pass).

    Reads one weight at a time (pread, not a mapped file), so memory stays that of the largest weight. The
    amax is exact in float32 (the largest magnitude of the stored values); an expert unit's gate and up
    matrices share one value, as do the members of each fused group.
    """
    path_of = {key: path for path, key in selection.quantized.items()} | selection.experts
    amax: dict[str, float] = {}
    buffers = ReadBuffers(kept=1)  # one weight at a time, each read into the memory of the one before
    for source in weight_files:
        tensors, _ = read_tensor_index(source)
        for name, tensor in tensors.items():
            if name in path_of:
                # exact in the weight's dtype: one pass, without fp32 and |w| copies (+ 0.0: -0.0 reads 0.0)
                value = float(max_abs(read_tensor(tensor, buffers)).float()) + 0.0
                amax[path_of[name]] = max(amax.get(path_of[name], 0.0), value)
    for members in selection.fused_groups:
        shared = max(amax[member] for member in members)
        amax.update({member: shared for member in members})
    selection.weight_amax = amax


def layer_stats(fmt: ServingFormat, weight: torch.Tensor, written: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One quantized weight's figures for the report: the format's own ``layer_stats(weight, tensors)`` where it
    has one, else the SQNR (dB) of the weight the ``written`` tensors (name -> tensor, in the format's order) hold,
    read from them without a second cast (:mod:`converters.serving.written_sqnr`), else nothing (a format without
    a ``weight_cast``, or a layout that module does not read)."""
    own = getattr(fmt, "layer_stats", None)
    if own is not None:
        return {key: round(value, 3) if isinstance(value, float) else value
                for key, value in own(weight, list(written.values())).items()}
    if getattr(fmt, "weight_cast", None) is None:
        return {}
    value = written_weight_sqnr(weight, written)
    return {"weight_sqnr_db": None if value is None else round(value, 2), "measured_on": "written_tensors"}


def write_serving_checkpoint(fmt: ServingFormat, selection: ServingSelection, source_dir: Path,
                             weight_files: list[Path], directory: Path, scale_dtype: torch.dtype,
                             confinement: FileConfinement,
                             check_stop: Callable[[], None] | None = None, *, emulated_stats: bool = True,
                             rounded_dir: Path | None = None) -> list[str]:
    """Write ``fmt``'s checkpoint of the source into ``directory``: weight files, index, config, side files.

    Each quantized weight's figures go into ``selection.layer_stats`` (:func:`layer_stats`); ``emulated_stats``
    False leaves out the weight SQNR of the written tensors (a pass over each weight's codes) where the caller has
    the figure already, from its calibration's meter, or was asked not to measure; a format's own ``layer_stats``
    stays.

    Side files are copied without reading outside ``confinement``. ``rounded_dir``: where the files of the
    selection's ``rounded`` weights are.

    Returns the file names written (relative to ``directory``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if getattr(fmt, "needs_weight_amax", False):
        set_weight_amax(selection, weight_files)
    shards = []
    for source in weight_files:
        shards.append(write_serving_file(fmt, selection, source, directory, scale_dtype, check_stop=check_stop,
                                         emulated_stats=emulated_stats, rounded_dir=rounded_dir))
        selection.layer_stats.update(shards[-1]["layer_stats"])
    side_files = getattr(fmt, "side_files", None)
    return [source.name for source in weight_files] + finish_checkpoint(
        source_dir, directory, shards, quantization_config=fmt.quantization_config(selection),
        confinement=confinement, json_files=side_files(selection) if side_files is not None else None)


def write_serving_file(fmt: ServingFormat, selection: ServingSelection, source: Path, directory: Path,
                       scale_dtype: torch.dtype, *, check_stop: Callable[[], None] | None = None,
                       emulated_stats: bool = True, rounded_dir: Path | None = None) -> dict[str, Any]:
    """Write ``source``'s weight file of ``fmt``'s checkpoint into ``directory`` (the weight amax, where the format
    needs it, taken from the selection: it spans every file). One file needs nothing of the others, so a serving
    export may be written a file at a time by any process.

    Returns the file's name, its tensor names, their bytes and each quantized weight's figures
    (:func:`layer_stats`; ``emulated_stats`` as in :func:`write_serving_checkpoint`), as plain data.
    """
    needs_weight_amax = getattr(fmt, "needs_weight_amax", False)
    path_of = {key: path for path, key in selection.quantized.items()} | selection.experts
    added_after: dict[str, dict[str, torch.Tensor]] = {}
    for name, (anchor, value) in selection.extra_tensors.items():
        added_after.setdefault(anchor, {})[name] = value
    tensors, metadata = read_tensor_index(source)
    buffers = ReadBuffers()  # the file's weights read into memory the ones before them no longer use
    steps: list[Copy | Compute] = []
    for name, tensor in tensors.items():
        if name not in path_of:
            steps.append(Copy(name, tensor))
        else:
            # Read with pread, not a mapped file: the pages of a whole shard would otherwise stay resident.
            amax = {"weight_amax": selection.weight_amax[path_of[name]]} if needs_weight_amax else {}
            label = name.removesuffix(".weight") if name in selection.experts else path_of[name]
            stats = emulated_stats or getattr(fmt, "layer_stats", None) is not None
            read = functools.partial(read_tensor, tensor, buffers)
            input_amax = selection.input_amax.get(path_of[name])
            if name in selection.rounded:
                steps.append(rounded_step(fmt, name, tensor, read, scale_dtype,
                                          _rounded_file(name, selection.rounded[name], rounded_dir),
                                          input_amax=input_amax, label=label))
            else:
                steps.append(quantize_step(fmt, name, tensor, read, scale_dtype, input_amax=input_amax,
                                           options=amax, label=label if stats else None))
        for added, value in added_after.get(name, {}).items():
            steps.append(Compute(outputs={added: value}, read=lambda: None,
                                 convert=lambda _, value=value: ([value], None)))
    directory.mkdir(parents=True, exist_ok=True)
    written = rewrite_shard(directory / source.name, steps, metadata, check_stop=check_stop)
    return {"file": source.name, "tensors": written.tensors, "bytes": written.bytes,
            "layer_stats": dict(note for note in written.notes if note is not None)}


def quantize_step(fmt: ServingFormat, name: str, weight: Any, read: Callable[[], torch.Tensor],
                  scale_dtype: torch.dtype, *, input_amax: float | None = None, options: dict[str, float] | None = None,
                  label: str | None = None, check_weight: bool = True) -> Compute:
    """The rewrite step that replaces the weight ``name`` (``weight``: anything with its high-precision ``shape``)
    by ``fmt``'s tensors: ``read()`` gives the weight, :func:`quantize_weight` converts it (arguments as there;
    ``options`` None: the format takes none)."""
    outputs = fmt.planned_tensors(name, weight, scale_dtype)
    return Compute(outputs=outputs, read=read,
                   convert=functools.partial(quantize_weight, fmt, name, outputs, input_amax, scale_dtype,
                                             options or {}, label, check_weight=check_weight))


def _rounded_file(name: str, file: str, rounded_dir: Path | None) -> Path:
    """The file in ``rounded_dir`` holding ``name``'s rounded tensors: a plain file name there (a task's payload
    names it), never a path elsewhere."""
    if rounded_dir is None:
        raise ConversionError(f"{name} was rounded by calibration, and no rounded-weights directory says where it is")
    if not is_plain_file_name(file):
        raise ConversionError(f"{name}: the rounded-weights file {file!r} is not a file name in the run's "
                              "rounded-weights directory; the task's payload is not this run's")
    return rounded_dir / file


def rounded_step(fmt: Any, name: str, weight: Any, read: Callable[[], torch.Tensor], scale_dtype: torch.dtype,
                 spill: Path, *, input_amax: float | None, label: str) -> Compute:
    """The rewrite step that replaces the weight ``name`` by the tensors calibration rounded it to, stored in
    ``spill`` (:data:`~converters.serving.nvfp4_gptq.ROUNDED_TENSORS`), through the format's ``with_rounded``; its
    note: the format's ``rounded_stats``. The weight is read to check it and to measure what was written."""
    outputs = fmt.planned_tensors(name, weight, scale_dtype)

    def convert(source: torch.Tensor) -> tuple[list[torch.Tensor], tuple[str, dict[str, Any]]]:
        with safe_open(spill, "pt") as stored:
            rounded = [stored.get_tensor(f"{name}:{part}") for part in ROUNDED_TENSORS]
        replacement = fmt.with_rounded(rounded, input_amax, scale_dtype)
        check_converted(name, source, dict(zip(outputs, replacement, strict=True)), fmt.name)
        stats = fmt.rounded_stats(source.to(scale_dtype), replacement)
        return replacement, (label, {key: round(value, 3) if isinstance(value, float) else value
                                     for key, value in stats.items()})

    return Compute(outputs=outputs, read=read, convert=convert)


def quantize_weight(fmt: ServingFormat, name: str, outputs: dict[str, Any], input_amax: float | None,
                    scale_dtype: torch.dtype, options: dict[str, float], label: str | None, weight: torch.Tensor, *,
                    check_weight: bool = True) -> tuple[list[torch.Tensor], tuple[str, dict[str, Any]] | None]:
    """``weight`` (``name``) quantized to ``fmt`` as the tensors ``outputs`` plans, in strips of rows where its cast
    allows (:mod:`converters.rewrite.strips`), checked finite; with it a note: its figures under ``label``
    (:func:`layer_stats`; None: no figures). The convert of :func:`quantize_step`'s rewrite step.

    ``options``: the format's keyword arguments (``weight_amax``). ``check_weight`` False: the weight was checked
    finite where it was read (:func:`~converters.model.finite.check_converted`).

    Raises:
        ModelConfigError: the weight or what it gave holds NaN or an infinity.
    """
    cast = functools.partial(_cast, fmt, input_amax, scale_dtype, options)
    step = strip_rows(fmt, weight)
    replacement = cast(weight) if step is None else cast_in_strips(cast, weight, step, outputs)
    written = dict(zip(outputs, replacement, strict=True))
    check_converted(name, weight, written, fmt.name, check_weight=check_weight)
    if label is None:
        return replacement, None
    return replacement, (label, layer_stats(fmt, weight, written))


def _cast(fmt: ServingFormat, input_amax: float | None, scale_dtype: torch.dtype, options: dict[str, float],
          weight: torch.Tensor) -> list[torch.Tensor]:
    return fmt.quantize(weight, input_amax, scale_dtype, **options)
