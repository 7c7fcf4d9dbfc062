"""``convert_model_free``: a checkpoint converted shard by shard from its files and config.json alone.

Phases, each a function of plain data (:mod:`converters.modelfree.tasks`), so a job queue can later run the shard
tasks on many workers: inventory (map: each shard's header) -> decide
(:func:`~converters.modelfree.eligibility.report_from_headers`, global, headers only) -> weight amax (map, formats
with ``needs_weight_amax``) -> shared amax (reduce: a fused group's members may lie in different shards) -> write
(map: one output shard per task) -> finish (index, config, side files, report, manifest). Everything is written
into a staging directory renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.artifact.layout import staging_dir_for
from converters.errors import ConversionError, Fp8ForgeError, RequestError
from converters.model.checkpoint import weight_files
from converters.model.files import FileConfinement, check_model_directory
from converters.model.limits import read_config_json
from converters.modelfree.eligibility import ModelFreeOptions, report_from_headers
from converters.modelfree.source import SourceView, source_view
from converters.modelfree.targets import model_free_target, scale_dtype_of
from converters.modelfree.tasks import (
    AmaxResult,
    AmaxTask,
    WriteResult,
    WriteTask,
    check_device,
    inventory_shard,
    planned_shard_bytes,
    reduce_weight_amax,
    shard_weight_amax,
    write_shard,
)
from converters.pipeline.progress import Unit
from converters.pipeline.state import NullSink, ProgressSink, Stage
from converters.rewrite import REMOVE, finish_checkpoint
from converters.serving.selection import ServingSelection

__all__ = ["REPORT_NAME", "check_plan", "convert_model_free", "finish", "plan_model_free", "serving_selection",
           "shard_tasks", "with_weight_amax"]

logger = logging.getLogger(__name__)

REPORT_NAME = "requantize_report.json"
REPORT_VERSION = 1


def plan_model_free(source_dir: Path, target: str, options: ModelFreeOptions, *, workers: int = 1
                    ) -> dict[str, Any]:
    """The report of what a model-free conversion of ``source_dir`` to ``target`` converts (reads headers only).

    Raises:
        RequestError: unknown target, or one that needs calibration. PatternError: an include matching nothing.
        ModelNotFoundError: a missing or malformed weight file or index. ModelConfigError: a source quantized in a
            layout fp8forge does not read.
    """
    with _pool(workers) as pool:
        return _plan(Path(source_dir), target, options, pool)[0]


def _plan(source_dir: Path, target: str, options: ModelFreeOptions, pool: Executor | None
          ) -> tuple[dict[str, Any], SourceView]:
    fmt = model_free_target(target)
    config = read_config_json(source_dir / "config.json")
    scale_dtype = scale_dtype_of(config)
    shards = [path.name for path in weight_files(source_dir)]
    inventories = _map(inventory_shard, [(str(source_dir), shard) for shard in shards], pool, star=True)
    view = source_view(source_dir, dict(zip(shards, inventories, strict=True)), getattr(torch, scale_dtype))
    if getattr(fmt, "dequantize_only", False):
        layers = [{"key": info.key, "module": info.key.removesuffix(".weight"), "shard": info.shard, "kind": "linear",
                   "eligible": True, "reasons": []} for info in view.tensors if info.key in view.stored]
        report = {"options": options.to_dict(), "layers": layers, "other": [], "fused_groups": [],
                  "quantized": {key: key for key in view.stored}}
    else:
        report = report_from_headers(view.tensors, config, options, fmt)
    report.update({"version": REPORT_VERSION, "format": fmt.name, "scale_dtype": scale_dtype, "shards": shards,
                   "model_type": config.get("model_type"), "source_quantization": view.scheme,
                   "dequantized": sorted(view.stored), "dropped": sorted(view.drop)})
    return report, view


def convert_model_free(source_dir: Path, out_dir: Path, format_name: str, *, include: Iterable[str] = (),
                       exclude: Iterable[str] = (), skip_first_last: bool = True, measure: bool = True,
                       workers: int = 1, confinement: FileConfinement | None = None,
                       sink: ProgressSink | None = None, device: str = "cpu") -> dict[str, Any]:
    """Convert ``source_dir`` (safetensors + config.json) to ``format_name`` in ``out_dir``, shard by shard.

    ``measure`` False leaves each converted weight's SQNR out of the report (a pass over every weight and its codes
    after the cast; the bytes written are the same). ``workers`` > 1 runs the shard tasks in that many processes;
    the bytes written do not depend on it. Side files (tokenizer, generation config) are read only inside
    ``confinement`` (default: ``source_dir``). Returns the report (also written to
    ``out_dir/requantize_report.json``). ``sink`` sees the stages and progress a
    requantize job's events show: analyze (the plan), convert (tasks done, shards and bytes written), export.
    ``device`` casts the converted weights there ("cuda": reads, writes and hashing stay on the host; the bytes do
    not depend on it).

    Raises:
        Fp8ForgeError: ``out_dir`` exists or its parent does not, bad options or target (see
            :func:`plan_model_free`), nothing to convert. Any error leaves no ``out_dir`` behind.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists():
        raise Fp8ForgeError(f"output directory {out_dir} already exists; choose a new one", field="out")
    if not out_dir.parent.is_dir():
        raise Fp8ForgeError(f"the parent of {out_dir} does not exist; create {out_dir.parent} first", field="out")
    if not isinstance(workers, int) or workers < 1:
        raise RequestError(f"workers must be a positive integer, got {workers!r}", field="workers")
    device = check_device(device)
    options = ModelFreeOptions(include=tuple(include), exclude=tuple(exclude), skip_first_last=skip_first_last,
                               measure=measure)
    sink = sink or NullSink()
    with _pool(workers, source_dir, confinement) as pool:
        sink.stage(Stage.ANALYZE.value)
        sink.progress(0, 1, Unit.TASK)
        report, view = _plan(source_dir, format_name, options, pool)
        check_plan(report, view)
        staging = staging_dir_for(out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            amax_tasks, write_tasks = shard_tasks(source_dir, staging, report, view, device=device)
            progress = _ShardProgress(sink, amax_tasks, write_tasks)
            sink.progress(1, 1, Unit.TASK, **progress.counts())  # the plan done: the shards and bytes to write
            results = _write_shards(report, amax_tasks, write_tasks, pool, progress)
            sink.stage(Stage.EXPORT.value)
            sink.progress(0, 1, Unit.TASK, **progress.counts())
            finish(source_dir, staging, report, results,
                    confinement or FileConfinement(roots=(source_dir.resolve(),)))
            sink.progress(1, 1, Unit.TASK, **progress.counts())
            os.replace(staging, out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return report


def check_plan(report: dict[str, Any], view: SourceView) -> None:
    """Refuse a plan that converts nothing.

    Raises:
        ConversionError: bf16 of a source that stores nothing quantized, or a target that quantizes no weight.
    """
    if getattr(model_free_target(report["format"]), "dequantize_only", False) and not view.stored:
        raise ConversionError("the source stores no quantized weight: there is nothing to dequantize to bf16",
                              field="to")
    if not report["quantized"]:
        raise ConversionError(f"{report['format']} would quantize no weight of this checkpoint (see the reasons with "
                              "fp8forge analyze): adjust include/exclude or skip_first_last", field="to")


def shard_tasks(source_dir: Path, staging: Path, report: dict[str, Any], view: SourceView, *, device: str = "cpu"
                ) -> tuple[list[AmaxTask], list[WriteTask]]:
    """The weight amax tasks (none unless the format needs them) and the write tasks, one per shard, casting on
    ``device``.

    The write tasks' ``weight_amax`` is empty: :func:`with_weight_amax` fills it from the reduced amax; their
    ``planned_bytes`` are read from the shards' headers.
    """
    fmt = model_free_target(report["format"])
    by_shard: dict[str, list[str]] = {shard: [] for shard in report["shards"]}
    shard_of = {layer["key"]: layer["shard"] for layer in report["layers"]}
    for key in report["quantized"]:
        by_shard[shard_of[key]].append(key)
    amax_tasks = []
    if getattr(fmt, "needs_weight_amax", False):
        amax_tasks = [AmaxTask(source_dir=str(source_dir), shard=shard, keys=keys, scale_dtype=report["scale_dtype"],
                               **view.task_fields(keys)) for shard, keys in by_shard.items() if keys]
    dequantized: dict[str, list[str]] = {shard: [] for shard in report["shards"]}
    for key, stored in view.stored.items():
        dequantized[view.location[stored]].append(key)
    write_tasks = [WriteTask(source_dir=str(source_dir), shard=shard, out_dir=str(staging), target=fmt.name,
                             scale_dtype=report["scale_dtype"], convert=keys,
                             drop=sorted(name for name, where in view.drop.items() if where == shard),
                             measure=report["options"].get("measure", True), device=device,
                             **view.task_fields(dequantized[shard])) for shard, keys in by_shard.items()]
    return amax_tasks, [dataclasses.replace(task, planned_bytes=planned_shard_bytes(task)) for task in write_tasks]


def with_weight_amax(task: WriteTask, amax: dict[str, float]) -> WriteTask:
    """``task`` with the (reduced) weight amax of the weights it converts."""
    return dataclasses.replace(task, weight_amax={key: amax[key] for key in task.convert if key in amax})


def _write_shards(report: dict[str, Any], amax_tasks: list[AmaxTask], write_tasks: list[WriteTask],
                  pool: Executor | None, progress: _ShardProgress) -> list[WriteResult]:
    """Map the weight amax (where the format needs it), reduce it over fused groups, then map the writes; the
    convert stage, its progress reported as each task ends."""
    progress.sink.stage(Stage.CONVERT.value)
    progress.report()
    amax = {}
    if amax_tasks:
        amax = reduce_weight_amax(_map(shard_weight_amax, amax_tasks, pool, on_done=progress.report),
                                  report["quantized"])
    return _map(write_shard, [with_weight_amax(task, amax) for task in write_tasks], pool, on_done=progress.report)


class _ShardProgress:
    """The convert stage's count, as a requantize job's events give it (``service.store.tasks``): tasks done of
    the stage's tasks (weight amax and shard writes), shards written and their tensor bytes."""

    def __init__(self, sink: ProgressSink, amax_tasks: list[AmaxTask], write_tasks: list[WriteTask]) -> None:
        self.sink, self.done, self.total = sink, 0, len(amax_tasks) + len(write_tasks)
        self.shards_done, self.shards_total = 0, len(write_tasks)
        self.bytes_done, self.bytes_total = 0, sum(task.planned_bytes for task in write_tasks)

    def report(self, result: AmaxResult | WriteResult | None = None) -> None:
        """After ``result`` (a task's; None: before the first)."""
        if result is not None:
            self.done += 1
        if isinstance(result, WriteResult):
            self.shards_done, self.bytes_done = self.shards_done + 1, self.bytes_done + result.bytes
        self.sink.progress(self.done, self.total, Unit.TASK, **self.counts())

    def counts(self) -> dict[str, int]:
        return {"shards_done": self.shards_done, "shards_total": self.shards_total, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total}


@contextlib.contextmanager
def _pool(workers: int, source_dir: Path | None = None, confinement: FileConfinement | None = None
          ) -> Iterator[Executor | None]:
    """``workers`` spawned processes (CUDA-safe, nothing inherited) for every phase of one job; None for one.
    Given a ``confinement``, each checks ``source_dir`` against it first, so that its reads keep to it
    (``converters.model.files.open_model_file``)."""
    if workers == 1:
        yield None
        return
    check = None if confinement is None or source_dir is None else functools.partial(
        check_model_directory, source_dir, confinement, shown=source_dir.name)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=check) as pool:
        yield pool


def _map(function: Callable[..., Any], tasks: list[Any], pool: Executor | None, *, star: bool = False,
         on_done: Callable[[Any], None] | None = None) -> list[Any]:
    """``function`` over ``tasks``, results in task order: in this process, or in ``pool``; ``on_done(result)`` as
    each task ends (in the order they end)."""
    on_done = on_done or (lambda result: None)
    if pool is None or len(tasks) < 2:
        results = []
        for task in tasks:
            results.append(function(*task) if star else function(task))
            on_done(results[-1])
        return results
    futures = [pool.submit(function, *task) if star else pool.submit(function, task) for task in tasks]
    for future in as_completed(futures):
        on_done(future.result())
    return [future.result() for future in futures]


def serving_selection(report: dict[str, Any]) -> ServingSelection:
    """The :class:`ServingSelection` a serving format's ``quantization_config`` reads, from a model-free report."""
    selection = ServingSelection(format=report["format"])
    quantized = set(report["quantized"])
    experts_kept: dict[str, str] = {}
    for layer in report["layers"]:
        module = layer["module"]
        if layer["kind"] == "expert":
            if layer["key"] in quantized:
                selection.experts[layer["key"]] = report["quantized"][layer["key"]]
            else:
                prefix = module.rpartition(".")[0].rpartition(".")[0]
                experts_kept[prefix] = prefix
        elif Reason.ROUTER_GATE.value in layer["reasons"]:
            selection.router_gates.append(module)
        elif Reason.NOT_LINEAR.value not in layer["reasons"]:
            selection.linear_paths.append(module)
            if layer["key"] in quantized:
                selection.quantized[module] = layer["key"]
        if not layer["eligible"]:
            selection.skipped[module] = ",".join(layer["reasons"])
    selection.unquantized_experts = experts_kept
    selection.fused_groups = [group["members"] for group in report["fused_groups"]
                         if all(f"{member}.weight" in quantized for member in group["members"])]
    return selection


def finish(source_dir: Path, staging: Path, report: dict[str, Any], results: list[WriteResult],
           confinement: FileConfinement, *, shard_files: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Index, config.json with the format's quantization_config, side files, the report, and the manifest.

    ``shard_files``: the output shards' manifest entries (name, bytes, sha256) as their writers computed them; a
    shard not in ``staging`` (it was written on another machine and sent to the object store) is listed from its
    entry, one that is there is not hashed again. Returns the manifest's entries.
    """
    fmt = model_free_target(report["format"])
    selection = serving_selection(report)
    quantization_config = fmt.quantization_config(selection)
    side_files = getattr(fmt, "side_files", None)
    json_files = dict(side_files(selection)) if side_files is not None else {}
    kept: dict[str, dict[str, str]] = {}
    for layer in report["layers"]:
        if not layer["eligible"]:
            kept.setdefault(layer["shard"], {})[layer["key"]] = ",".join(layer["reasons"])
    report["per_shard"] = {result.shard: {"converted": result.converted, "kept": kept.get(result.shard, {}),
                                          "bytes": result.bytes} for result in results}
    report["layer_stats"] = {name: stats for result in results for name, stats in result.layer_stats.items()}
    json_files[REPORT_NAME] = report
    hashed = [result.file for result in results if result.file]
    return finish_checkpoint(source_dir, staging, results, confinement=confinement, json_files=json_files,
                             quantization_config=REMOVE if quantization_config is None else quantization_config,
                             manifest=True, shard_files=[*hashed, *shard_files])

