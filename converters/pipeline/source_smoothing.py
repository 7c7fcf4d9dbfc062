"""The recipe's ``nvfp4_smoothing``: the job's source smoothed once, before calibration, and the job then run on it.

A layer walk over the calibration batches (:class:`~converters.calibration.smoothing_walk.SmoothingWalk`) chooses
and folds each decoder layer's smoothing scales and writes the changed tensors (norm weights and Linear weights)
one file per layer. The checkpoint-rewrite engine then writes a copy of the source into the job's staging
directory (:data:`SMOOTHED_SOURCE_DIR`) in which those tensors replace the source's and every other tensor passes
through as bytes, and the run's source becomes that copy: calibration, GPTQ, every export, the training artifact's
weights, the quality pass and the audit read it. The smoothed model computes the source's function to the dtype's
rounding (each fold is checked on the layer's output), so nothing downstream needs to know; the report's
``nvfp4_smoothing`` block says what was smoothed, kept or skipped and why. The copy is removed once the artifact's
files are written, before it is published. On the ranks of a data-parallel job each rank walks its share of the
steps, the ranks score each mapping's candidates between them on every rank's rows, rank 0 folds and writes the
copy, and all ranks calibrate on it (docs/distributed.md).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from safetensors import safe_open

from converters.analysis.eligibility import eligible_paths
from converters.calibration.sequential import LAYER_SEQUENTIAL, SequentialUnsupported, calibrate_layer_by_layer
from converters.calibration.smoothing_walk import SmoothingWalk
from converters.errors import RequestError
from converters.model.checkpoint import Checkpoint, weight_files
from converters.model.safetensors_stream import read_tensor_index
from converters.model.sources import confinement_for
from converters.pipeline.progress import SMOOTHING_STEPS, Unit
from converters.pipeline.state import Run
from converters.pipeline.weight_copy import start_weight_copy
from converters.recipes.base import NVFP4Smoothing
from converters.rewrite import REMOVE, Compute, Copy, finish_checkpoint, write_shard
from converters.serving import serving_format

__all__ = ["SMOOTHED_SOURCE_DIR", "remove_smoothed_source", "smooth_source", "smooths_source"]

SMOOTHED_SOURCE_DIR = ".smoothed-source"  #: the smoothed copy of the source, in the job's staging directory
_LAYERS_DIR = ".smoothing-layers"  #: the walk's per-layer files of changed tensors, until the copy is written
_FIELD = "recipe.nvfp4_smoothing"


def smooths_source(recipe: Any) -> bool:
    """Whether ``recipe`` asks for a smoothed source: the job's weight copy then starts here, from the source the job
    converts, instead of after resolve (:func:`smooth_source`)."""
    return recipe.nvfp4_smoothing is not NVFP4Smoothing.NONE


def smooth_source(run: Run, batches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Smooth the run's source where the recipe asks it and the job writes an NVFP4 W4A4 export; the report block
    (None: not asked). The run's source is the smoothed copy afterwards, and the artifact's weight copy (a conversion's:
    one with a staging directory) runs from it.

    Raises:
        RequestError: smoothing asked of a job that cannot run it (whole-model calibration, a source stored
            quantized).
        Fp8ForgeError: on every rank of a data-parallel job, when one cannot read rank 0's smoothed copy.
    """
    if not smooths_source(run.recipe):
        return None
    method = run.recipe.nvfp4_smoothing
    w4a4 = [name for name in run.serving if _is_w4a4(name)]
    if not w4a4:
        return _not_applied(run, "nvfp4_smoothing awq applies to the NVFP4 W4A4 serving exports (nvfp4, "
                                 "modelopt-nvfp4), and the request asks for none: the source is converted as it is")
    _check_job(run)
    ranks = run.distributed.info if run.distributed is not None and run.distributed.info.world_size > 1 else None
    leader = ranks is None or ranks.leader
    if run.staging is None and leader:  # a calibrated analysis: nothing is written, so nothing is smoothed
        return _not_applied(run, "nvfp4_smoothing awq runs in conversion jobs: this analysis measured the source as "
                                 "it is, not the smoothed model a job would convert")
    others = [name for name in run.serving if name not in w4a4]
    if leader:
        run.warn("nvfp4_smoothing awq: the job converts the smoothed model (the same function to the dtype's "
                 "rounding), so the training artifact" + (f" and the {', '.join(others)} export(s)" if others else "")
                 + " hold its weights too")
    layers = run.staging / _LAYERS_DIR if leader else None
    walk = SmoothingWalk(eligible=set(eligible_paths(run.report)), directory=layers,
                         dtype=run.resolved.checkpoint.dtype,
                         share=run.distributed.smoothing_share() if ranks is not None else None)
    started = time.perf_counter()
    try:
        calibrate_layer_by_layer(run.resolved.meta_model, run.resolved.stack, run.resolved.checkpoint, batches, [],
                                 on_layer=lambda done, total: run.sink.progress(done, total, Unit.LAYER,
                                                                                step=SMOOTHING_STEPS[0]),
                                 should_stop=run.sink.should_stop, after_layer=walk,
                                 boundary=run.distributed.step_share(run.resolved.stack.path) if ranks else None)
    except SequentialUnsupported as exc:
        raise RequestError(f"nvfp4_smoothing awq runs in the layer-sequential walk, which stopped: {exc}; use "
                           "nvfp4_smoothing none for this model", field=_FIELD) from exc
    searched = time.perf_counter()
    directory = None  # the smoothed copy; None: no mapping was worth smoothing, and the source is the smoothed model
    if walk.changed:
        directory = run.staging / SMOOTHED_SOURCE_DIR
        run.sink.progress(0, 1, Unit.STEP, step=SMOOTHING_STEPS[1])
        _write_smoothed_copy(run, walk, directory)
        shutil.rmtree(layers, ignore_errors=True)
    if ranks is not None:  # the ranks calibrate on rank 0's copy (a restart searches again: the same rows, scales)
        directory = run.distributed.leaders_directory(directory, what="the smoothed copy of the source",
                                                      instead="use nvfp4_smoothing none")
    if directory is not None:
        _use_as_source(run, directory)
    if not leader:  # the report is rank 0's
        return {"method": method.value, "applied": True}
    start_weight_copy(run)
    seconds = {"search": round(searched - started, 3), "copy": round(time.perf_counter() - searched, 3)}
    results = [record["result"].partition(":")[0] for record in walk.records]
    return {"method": method.value, "applied": True, "exports": w4a4,
            "mappings": {result: results.count(result) for result in ("smoothed", "kept", "skipped")},
            "changed_tensors": len(walk.changed), "seconds": seconds, "layers": walk.records,
            "definition": "per mapping (what feeds a Linear group, the group), AWQ's ratio search over the "
                          "calibration inputs; error: the group's summed squared W4A4 output error on a sample of "
                          "them without smoothing, smoothed_error: with the chosen scales; output_change: how much "
                          "the fold moved the layer's output on a calibration step (relative RMS); seconds: the "
                          "search's layer walk and the smoothed copy's write"}


def remove_smoothed_source(staging: Path) -> None:
    """Take the smoothed copy out of the staging directory (it is no artifact file)."""
    shutil.rmtree(staging / SMOOTHED_SOURCE_DIR, ignore_errors=True)
    shutil.rmtree(staging / _LAYERS_DIR, ignore_errors=True)


def _not_applied(run: Run, reason: str) -> dict[str, Any]:
    run.warn(reason)
    start_weight_copy(run)
    return {"method": run.recipe.nvfp4_smoothing.value, "applied": False, "reason": reason}


def _is_w4a4(name: str) -> bool:
    fmt = serving_format(name)
    return bool(getattr(fmt, "rounding_family", None)) and bool(getattr(fmt, "needs_calibration", False))


def _check_job(run: Run) -> None:
    if run.resolved.mode != LAYER_SEQUENTIAL:
        raise RequestError(f"nvfp4_smoothing awq searches each decoder layer during a layer-sequential walk, and "
                           f"this job calibrates the whole model ({run.resolved.mode_reason}): use nvfp4_smoothing "
                           "none for this model", field=_FIELD)
    if run.resolved.checkpoint.stored is not None:
        raise RequestError("nvfp4_smoothing awq smooths a high-precision source, and this one is stored quantized "
                           f"({run.resolved.checkpoint.stored.quantization.describe()}): convert its high-precision "
                           "original, or use nvfp4_smoothing none", field=_FIELD)


def _write_smoothed_copy(run: Run, walk: SmoothingWalk, directory: Path) -> None:
    """The source's weight files rewritten into ``directory``: the walk's tensors in place of the source's (same
    names, dtypes and shapes), every other tensor copied as bytes; then config, index and tokenizer files."""
    directory.mkdir()
    checkpoint = run.resolved.checkpoint
    #: on-disk name -> (the walk's file, the tensor's model name in it)
    changed = {checkpoint.on_disk_name(name) or name: (file, name) for name, file in walk.changed.items()}
    shards = []
    for path in weight_files(run.resolved.directory):
        tensors, metadata = read_tensor_index(path)
        steps = [Compute(outputs={name: tensor}, read=lambda name=name: _read_changed(*changed[name]),
                         convert=lambda value: ([value], None))  # written in the checkpoint's dtype
                 if name in changed else Copy(name, tensor) for name, tensor in tensors.items()]
        shards.append(write_shard(directory / path.name, steps, metadata, check_stop=run.check_stop))
    finish_checkpoint(run.resolved.directory, directory, shards, quantization_config=REMOVE,
                      confinement=confinement_for(run.sources))


def _read_changed(file: Path, model_name: str) -> Any:
    """The walk's tensor ``model_name`` from its layer's ``file``."""
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(model_name)


def _use_as_source(run: Run, directory: Path) -> None:
    """Point the run at the smoothed copy: its files and a checkpoint over them."""
    resolved = run.resolved
    checkpoint = Checkpoint(directory, resolved.meta_model, dtype=resolved.checkpoint.dtype, device=resolved.device)
    run.use_derived_source(replace(resolved, directory=directory, checkpoint=checkpoint,
                                   tied_weights=dict(checkpoint.tied)),
                           replace(run.sources, job_directories=(*run.sources.job_directories, directory)))
