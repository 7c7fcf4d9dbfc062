"""``sync_serving``: the serving export of a training artifact (or of the checkpoint its training wrote), streamed.

A training artifact holds the source's weights and, in config.json's ``fp8`` block, the recipe and the Linears it
converted. ``sync`` writes only the serving checkpoint: each converted Linear's weight cast as its recipe's
training twin casts it (:mod:`converters.sync.twins`), every other tensor copied as bytes by byte range, one tensor
at a time, so memory is that of the largest weight and time is the copy's plus the casts'. The weights are read
from the artifact itself or, with ``weights``, from the safetensors a TE/torchao training run saved after loading
the artifact (same tensor names; TE's ``._extra_state`` entries are left out).

Which weights are cast: the artifact's ``converted_modules`` whose ``<module>.weight`` is stored as a 2-D floating
tensor, that the format's own shape rule accepts, and whose fused group (q/k/v, gate/up) is converted whole
(engines refuse a partly quantized group); every other Linear stays in high precision, named in the format's
ignore list with its reason. Expert weights of MoE models are not synced (they stay in high precision, reason
``experts_not_synced``). Everything is written into a staging directory renamed into place at the end.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from converters.artifact.layout import staging_dir_for
from converters.errors import ArtifactError, ConversionError, RequestError
from converters.model.checkpoint import weight_files
from converters.model.files import FileConfinement, read_model_text
from converters.model.safetensors_stream import ReadBuffers, read_tensor, read_tensor_index
from converters.modelfree.driver import serving_selection
from converters.modelfree.eligibility import ModelFreeOptions, TensorInfo, report_from_headers
from converters.modelfree.targets import model_free_target, scale_dtype_of
from converters.recipes import recipe_from_dict
from converters.rewrite import Compute, Copy, ShardWritten, finish_checkpoint
from converters.rewrite import write_shard as rewrite_shard
from converters.serving.writer import quantize_step
from converters.sync.twins import training_twin, twin_report

__all__ = ["SYNC_REPORT_NAME", "sync_serving"]

logger = logging.getLogger(__name__)

SYNC_REPORT_NAME = "sync_report.json"
_REPORT_VERSION = 1
_EXTRA_STATE = "._extra_state"  # TE modules' serialized FP8 metadata in a state dict: no engine reads it


def sync_serving(artifact: Path, out: Path, *, format_name: str | None = None, weights: Path | None = None
                 ) -> dict[str, Any]:
    """Write the serving export of ``artifact`` into ``out`` and return its report (also ``out/sync_report.json``).

    Args:
        artifact: an fp8forge training artifact directory (config.json with an ``fp8`` block).
        out: the export directory; it must not exist, its parent must.
        format_name: a serving format that needs no calibration; default: the recipe's training twin.
        weights: a directory of safetensors written by training after the artifact was loaded (its index or
            ``model.safetensors``); default: the artifact's own weight files.

    Raises:
        ArtifactError: ``artifact`` is not a training artifact. RequestError: no twin and no ``format_name``, a
            format needing calibration, or a bad ``out``. ConversionError: ``weights`` lacks a converted Linear's
            weight, or nothing would be cast. ModelNotFoundError: missing or malformed weight files.
            ModelConfigError: a weight to cast, or what casting it gave, holds NaN or an infinity. Nothing is left
            at ``out`` on any error.
    """
    started = time.perf_counter()
    artifact, out = Path(artifact), Path(out)
    source = Path(weights) if weights is not None else artifact
    block, recipe = _training_block(artifact)
    name = format_name or training_twin(recipe).format
    fmt = model_free_target(name)
    if getattr(fmt, "dequantize_only", False):
        raise RequestError("sync writes a quantized serving export; bf16 is not one", field="format")
    _check_out(out)
    config = _config(source if (source / "config.json").is_file() else artifact)
    files = weight_files(source)
    headers = {path.name: read_tensor_index(path)[0] for path in files}
    report = _decide(headers, config, block, fmt)
    _check_weights(report, block, headers, weights is not None)
    if not report["quantized"]:
        raise ConversionError(f"{name} would cast no weight of this artifact (see the reasons in the artifact's "
                              "fp8_report.json)", field="format")
    staging = staging_dir_for(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        written = [_write_shard(path, headers[path.name], staging, fmt, set(report["quantized"]),
                                getattr(torch, report["scale_dtype"])) for path in files]
        report.update({"artifact": str(artifact), "weights": str(source),
                       "serving": {name: {"training_twin": twin_report(recipe, name)}}})
        _finish(artifact, source, staging, config, fmt, report, written, started)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _training_block(artifact: Path) -> tuple[dict[str, Any], Any]:
    config_path = artifact / "config.json"
    if not config_path.is_file():
        raise ArtifactError(f"{artifact} has no config.json; point at an fp8forge training artifact directory")
    block = _config(artifact).get("fp8")
    if not isinstance(block, dict) or not isinstance(block.get("recipe"), dict) \
            or not isinstance(block.get("converted_modules"), list) \
            or not all(isinstance(module, str) for module in block["converted_modules"]):
        raise ArtifactError(f"{artifact} is not an fp8forge training artifact: config.json has no fp8 block with a "
                            "recipe and converted_modules (convert the model with fp8forge convert first)")
    return block, recipe_from_dict(block["recipe"])


def _config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads(read_model_text(directory / "config.json"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{directory / 'config.json'}: cannot read it as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ArtifactError(f"{directory / 'config.json'} is not a JSON object")
    return config


def _check_out(out: Path) -> None:
    if out.exists():
        raise RequestError(f"output directory {out} already exists; choose a new one", field="out")
    if not out.parent.is_dir():
        raise RequestError(f"the parent of {out} does not exist; create {out.parent} first", field="out")


def _decide(headers: dict[str, dict[str, Any]], config: dict[str, Any], block: dict[str, Any], fmt: Any
            ) -> dict[str, Any]:
    """The model-free report of the stored Linears as the decision table gives it for what training converted
    (``DecisionOptions.trained``), with what this export adds: converted Linears the files lack, and those it keeps
    in high precision although training ran them in FP8."""
    tensors = [TensorInfo(key=name, shard=shard, dtype=tensor.dtype, shape=tuple(tensor.shape))
               for shard, header in headers.items() for name, tensor in header.items()
               if not name.endswith(_EXTRA_STATE)]
    converted = set(block["converted_modules"])
    report = report_from_headers(tensors, config, ModelFreeOptions(skip_first_last=False), fmt, trained=converted)
    report["not_stored"] = sorted(converted - {layer["module"] for layer in report["layers"]})
    # FP8 in training, high precision in serving (a partly converted fused group): these layers' numbers differ
    report["differs_from_training"] = sorted(layer["module"] for layer in report["layers"]
                                             if layer["module"] in converted and not layer["eligible"])
    report["dropped"] = sorted(name for header in headers.values() for name in header if name.endswith(_EXTRA_STATE))
    report.update({"version": _REPORT_VERSION, "format": fmt.name, "scale_dtype": scale_dtype_of(config),
                   "shards": list(headers)})
    return report


def _check_weights(report: dict[str, Any], block: dict[str, Any], headers: dict[str, Any], separate: bool) -> None:
    """A training checkpoint must hold every converted Linear's weight the artifact stores (same names)."""
    if separate and report["not_stored"]:
        shown = ", ".join(report["not_stored"][:3])
        raise ConversionError(f"the weights directory holds no weight for {len(report['not_stored'])} Linear(s) the "
                              f"artifact converted ({shown}): pass the checkpoint written by training from this "
                              "artifact, with the model's own tensor names", field="weights")


def _write_shard(path: Path, header: dict[str, Any], staging: Path, fmt: Any, convert: set[str],
                 scale_dtype: torch.dtype) -> ShardWritten:
    """One output shard: converted weights cast, ``_extra_state`` left out, every other tensor copied as bytes."""
    kept = {name: tensor for name, tensor in header.items() if not name.endswith(_EXTRA_STATE)}
    _, metadata = read_tensor_index(path)
    buffers = ReadBuffers()  # the shard's weights read into memory the ones before them no longer use
    # the serving export's own conversion (strips of rows, finiteness), without input scale or figures (sync's
    # formats take no calibration; the report holds no SQNR)
    steps: list[Copy | Compute] = [
        quantize_step(fmt, name, tensor, functools.partial(read_tensor, tensor, buffers), scale_dtype)
        if name in convert else Copy(name, tensor) for name, tensor in kept.items()]
    return rewrite_shard(staging / path.name, steps, metadata)


def _finish(artifact: Path, source: Path, staging: Path, config: dict[str, Any], fmt: Any, report: dict[str, Any],
            written: list[ShardWritten], started: float) -> None:
    """Index (where the source has one), config.json without the fp8 block and with the format's, side files (the
    model files from the artifact: a separate weights directory need hold only weights), the report, and the
    manifest (the shards as their writer hashed them)."""
    selection = serving_selection(report)
    side_files = getattr(fmt, "side_files", None)
    report["bytes_written"] = sum(shard.bytes for shard in written)
    report["kept"] = {layer["module"]: ",".join(layer["reasons"])
                      for layer in report["layers"] if not layer["eligible"]}
    del report["layers"]
    report["seconds"] = round(time.perf_counter() - started, 3)
    json_files = {**(side_files(selection) if side_files is not None else {}), SYNC_REPORT_NAME: report}
    finish_checkpoint(source, staging, written, quantization_config=fmt.quantization_config(selection),
                      confinement=FileConfinement(roots=(artifact.resolve(),)), json_files=json_files,
                      config={key: value for key, value in config.items() if key != "fp8"}, side_files_from=artifact,
                      manifest=True, shard_files=[shard.file_entry() for shard in written])
