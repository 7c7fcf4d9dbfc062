"""The serving exports of a job: selected in analyze (and again when min_sqnr_db drops layers), written in export
from the calibration the job already ran, each with its KV-cache scales where asked, and each audited against the
engine's loading rules before the job may succeed.

Once calibration has set a format's scales, its export needs nothing but its selection (what it quantizes, with
those scales: :class:`~converters.serving.selection.ServingSelection`) and the source's files, so it can also be
written one weight file at a time by any machine: :func:`serving_shard_tasks` turns each selection into plain-data
``serving_write`` tasks (its wire form, :func:`selection_to_wire`, in every payload under the key ``plan``, the
name tasks queued by earlier releases carry), which :func:`run_serving_write` runs (``write_serving_checkpoint``'s
file), and the run that queued them writes the index, config and side files from their results
(:func:`finish_serving_export`). The bytes are those of the one-process export.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

import torch

from converters.calibration.gptq_rounding import ROUNDED_DIR, GptqRounding
from converters.calibration.sensitivity import low_sqnr
from converters.calibration.sequential import LAYER_SEQUENTIAL
from converters.calibration.sqnr_meter import RecipeCasts, SqnrMeter
from converters.casts.emulation import cast_spec
from converters.errors import ConversionError, RequestError
from converters.model.checkpoint import weight_files
from converters.model.files import FileConfinement
from converters.model.sources import confinement_for, model_dtype
from converters.pipeline.state import Run
from converters.recipes import NVFP4WeightRounding
from converters.rewrite import finish_checkpoint
from converters.serving import serving_format
from converters.serving.audit import audit_export
from converters.serving.kv_scales import attach_kv_scales
from converters.serving.loads_in import loads_in_warnings
from converters.serving.selection import ServingSelection, expert_disk_keys, select_serving, set_input_amax
from converters.serving.writer import set_weight_amax, write_serving_checkpoint, write_serving_file

__all__ = ["SERVING_LABEL", "ServingShardRunner", "finish_serving_export", "job_format", "run_serving_write",
           "select_serving_formats", "selection_from_wire", "selection_to_wire", "serving_casts", "serving_rounding",
           "serving_shard_tasks", "serving_sqnr", "set_serving_scales", "write_serving_exports",
           "write_serving_shard"]

#: the SQNR meter's label for a serving format's casts: this prefix and the format's name
SERVING_LABEL = "serving:"


def select_serving_formats(run: Run, report: dict[str, Any]) -> dict[str, ServingSelection]:
    """What each requested serving format quantizes; a format with nothing to quantize is bad input."""
    selections: dict[str, ServingSelection] = {}
    if not run.request.serving_formats:
        return selections
    expert_keys = expert_disk_keys(run.resolved.checkpoint.mapping, run.resolved.checkpoint.target_of, report)
    for index, name in enumerate(run.request.serving_formats):
        selection = select_serving(serving_format(name), report, run.resolved.checkpoint.on_disk_name, expert_keys)
        if not selection.quantized and not selection.experts:
            raise ConversionError(
                f"serving format {name} would quantize no layer (fused groups must be eligible as a whole; see the "
                "analysis): adjust include/exclude or skip_first_last, or drop the format",
                field=f"serving_formats[{index}]")
        for warning in loads_in_warnings(name):  # a consumer that would misread the export (the README's table)
            run.warn(warning)
        selections[name] = selection
    return selections


def serving_casts(run: Run) -> list[RecipeCasts]:
    """What each requested serving format does to a Linear's weight and input, for the SQNR meter of calibration
    (a format's ``weight_cast`` and ``input_cast``: spec names of converters.casts.emulation).

    The casts follow the job's library's fp32 scale arithmetic (at most an ulp from the format's own), so a
    format whose casts are the job recipe's (compressed-tensors FP8 after torchao tensorwise) is measured once.
    """
    library = "torchao" if run.recipe.backend.value == "ao" else "te"
    casts = []
    for name in run.request.serving_formats:
        fmt = serving_format(name)
        pow2 = getattr(fmt, "pow2_scales", False)
        input_cast = getattr(fmt, "input_cast", None)
        notes = ("a static input scale comes from the amax over every calibration step: emulated with each step's "
                 "own amax",) if fmt.needs_calibration and input_cast is not None else ()
        casts.append(RecipeCasts(label=f"{SERVING_LABEL}{name}", recipe={"serving_format": name},
                                 weight=cast_spec(fmt.weight_cast, library=library, pow2_scales=pow2),
                                 input=cast_spec(input_cast, library=library, pow2_scales=pow2) if input_cast else None,
                                 not_emulated=notes))
    return casts


def serving_sqnr(run: Run, meter: SqnrMeter | None) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each serving format's SQNR per measured layer, from the calibration's meter (empty when it was off)."""
    if meter is None:
        return {}
    return {name: {path: meter.result(path, f"{SERVING_LABEL}{name}") for path in meter.paths()}
            for name in run.request.serving_formats}


def serving_rounding(run: Run, meter: SqnrMeter | None = None, label: str = "") -> GptqRounding | None:
    """The calibration walk's GPTQ rounding of the NVFP4 exports, where the recipe asks ``nvfp4_weight_rounding:
    gptq`` and the job writes one (None otherwise; a warning when no NVFP4 export would use it). With
    ``min_sqnr_db``, the SQNR ``meter``'s figure under ``label`` tells it which Linears will stay in high precision.

    In a distributed or resumable job the ranks combine their Hessians and the resume record keeps the rounded
    streams and weights (:mod:`converters.calibration.gptq_rounding`).

    Raises:
        RequestError: GPTQ asked of a job that cannot run it (whole-model calibration).
    """
    if run.recipe.nvfp4_weight_rounding is not NVFP4WeightRounding.GPTQ:
        return None
    exports = [(job_format(name, run.recipe), selection) for name, selection in run.serving.items()
               if getattr(serving_format(name), "rounding_family", None)]
    if not exports:
        run.warn("nvfp4_weight_rounding gptq applies to the NVFP4 serving exports (nvfp4, nvfp4-a16, modelopt-nvfp4), "
                 "and the request asks for none: nothing is rounded by GPTQ")
        return None
    field = "recipe.nvfp4_weight_rounding"
    if run.resolved.mode != LAYER_SEQUENTIAL:
        raise RequestError(f"nvfp4_weight_rounding gptq rounds each decoder layer during the layer-sequential "
                           f"calibration, and this job calibrates the whole model ({run.resolved.mode_reason}): use "
                           "nvfp4_weight_rounding nearest for this model", field=field)
    directory = run.staging / ROUNDED_DIR if run.staging is not None else None  # None: a rank that writes no export
    threshold = run.request.min_sqnr_db
    stays = None if meter is None or threshold is None else \
        (lambda path: low_sqnr(meter.result(path, label)["output"], threshold))
    return GptqRounding(exports, directory, model_dtype(run.resolved.config),
                        block_scales=run.recipe.nvfp4_weight_scales.value, ranked=run.distributed is not None,
                        stays_high_precision=stays)


class ServingShardRunner(Protocol):
    """Runs a serving export's ``serving_write`` tasks (:func:`serving_shard_tasks`) somewhere other than in this
    loop, e.g. spread over a service's workers; the run writes each format's index, config and side files itself."""

    def wanted(self, weight_files: int) -> bool:
        """Whether an export of ``weight_files`` files should run as tasks (else it is written here, as usual)."""
        ...

    def run(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run ``tasks``, each written under the run's staging directory; returns their results in their order.
        Raises what the run should fail with (a task's bad input, a cancel)."""
        ...


def write_serving_exports(run: Run, staging: Path, shards: ServingShardRunner | None = None) -> list[str]:
    """Each requested serving checkpoint in ``serving/<name>/``, from the calibration this job already ran; with
    ``shards`` (when it wants them), each weight file is a task it runs; the bytes are the same either way."""
    try:
        if run.serving and shards is not None and shards.wanted(len(serving_sources(run, staging))):
            return _write_serving_exports_as_tasks(run, staging, shards)
        written = []
        for name, selection in run.serving.items():
            set_serving_scales(run, name, selection)
            directory = staging / "serving" / name
            source = run.resolved.directory
            files = serving_sources(run, staging)
            files = write_serving_checkpoint(job_format(name, run.recipe), selection, source, files, directory,
                                             model_dtype(run.resolved.config), confinement_for(run.sources),
                                             check_stop=run.check_stop, emulated_stats=False,
                                             rounded_dir=staging / ROUNDED_DIR)
            _add_measured_sqnr(selection, run.calibration.serving_sqnr.get(name, {}))
            _audit(run, name, selection, directory)
            written += [f"serving/{name}/{file}" for file in files]
        return written
    finally:  # calibration's rounded weights are written into the exports now: they are no artifact file
        shutil.rmtree(staging / ROUNDED_DIR, ignore_errors=True)


def _write_serving_exports_as_tasks(run: Run, staging: Path, shards: ServingShardRunner) -> list[str]:
    """The weight files by ``shards``; each format's index, config and side files here, then its audit."""
    writes = serving_shard_tasks(run, staging)
    results = shards.run(writes)
    written = []
    for name, selection in run.serving.items():
        directory = staging / "serving" / name
        own = [result for task, result in zip(writes, results, strict=True)
               if task["payload"]["plan"]["format"] == name]
        files = finish_serving_export(selection, run.resolved.directory, own, directory,
                                      confinement_for(run.sources), weight_scales=run.recipe.nvfp4_weight_scales.value)
        _add_measured_sqnr(selection, run.calibration.serving_sqnr.get(name, {}))
        _audit(run, name, selection, directory)
        written += [f"serving/{name}/{file}" for file in files]
    return written


def job_format(name: str, recipe: Any) -> Any:
    """The serving format ``name`` as the job's recipe asks for it (see :func:`_format_with_scales`)."""
    return _format_with_scales(name, recipe.nvfp4_weight_scales.value)


def _format_with_scales(name: str, weight_scales: str) -> Any:
    """The serving format ``name`` with NVFP4's block scales chosen by ``weight_scales`` (the recipe's
    ``nvfp4_weight_scales``, converters.serving.nvfp4); every other format as registered. A shard task carries the
    value, not the recipe."""
    fmt = serving_format(name)
    with_scale_search = getattr(fmt, "with_scale_search", None)
    return with_scale_search(weight_scales) if with_scale_search is not None else fmt


def set_serving_scales(run: Run, name: str, selection: ServingSelection) -> None:
    """Set the selection's scales from the job's calibration: input amax (shared per fused group), KV-cache scales."""
    starved = set_input_amax(selection, run.report, run.calibration.amax)
    if starved:
        run.warn(f"{name}: expert GEMM(s) {', '.join(starved)} received no calibration token; their input_scale "
                 "is the largest of the same GEMM's other experts in that layer")
    _attach_kv_cache(run, name, selection)
    family = getattr(serving_format(name), "rounding_family", None)  # the codes calibration rounded for it
    if family is not None:
        keys = {*selection.quantized.values(), *selection.experts}
        rounded = run.calibration.rounded_weights.get(family, {})
        selection.rounded = {key: file for key, file in rounded.items() if key in keys}


def serving_sources(run: Run, staging: Path) -> list[Path]:
    """The weight files a serving export is written from: the source's, or for a quantized source the artifact's
    dequantized copies in ``staging``."""
    files = weight_files(run.resolved.directory)
    if run.resolved.checkpoint.stored is not None:
        files = [staging / path.name for path in files]
    return files


# -- one weight file at a time, from plain data (tasks any machine may run) -----------------------------------
def selection_to_wire(selection: ServingSelection) -> dict[str, Any]:
    """The selection as JSON-ready data; :func:`selection_from_wire` rebuilds it exactly (tensors as dtype, shape,
    values). The keys are the dataclass's field names, as stored in tasks: renaming a field breaks queued tasks."""
    data = {item.name: getattr(selection, item.name) for item in fields(selection) if item.name != "extra_tensors"}
    data["extra_tensors"] = {name: {"after": anchor, "dtype": str(value.dtype).removeprefix("torch."),
                                    "shape": list(value.shape), "values": value.flatten().tolist()}
                             for name, (anchor, value) in selection.extra_tensors.items()}
    return data


def selection_from_wire(data: dict[str, Any]) -> ServingSelection:
    extra = {name: (entry["after"], torch.tensor(entry["values"], dtype=getattr(torch, entry["dtype"]))
                    .reshape(entry["shape"])) for name, entry in data["extra_tensors"].items()}
    return ServingSelection(**{**data, "extra_tensors": extra})


def serving_shard_tasks(run: Run, staging: Path) -> list[dict[str, Any]]:
    """Each requested format's weight files as plain-data tasks, once calibration has run: one ``serving_write``
    per weight file. Prepares ``run.serving``'s selections from the calibration (as
    :func:`write_serving_exports` does); a format that needs the weight amax gets it here, over every file (fused
    groups may span files). Paths are not stored: the machine that runs a task names its source and output
    (``staging``: where this run's dequantized copies of a quantized source are, to read their names)."""
    tasks: list[dict[str, Any]] = []
    files = serving_sources(run, staging)
    dtype = str(model_dtype(run.resolved.config)).removeprefix("torch.")
    for name, selection in run.serving.items():
        set_serving_scales(run, name, selection)
        if getattr(serving_format(name), "needs_weight_amax", False):
            set_weight_amax(selection, files)
        wire = selection_to_wire(selection)
        # the artifact's copies, not the files the task's machine resolves: the dequantized weights of a quantized
        # source, or the smoothed model's (nvfp4_smoothing: the run's source is a copy in its staging directory)
        from_artifact = run.resolved.checkpoint.stored is not None or bool(run.calibration.smoothing.get("applied"))
        scales = run.recipe.nvfp4_weight_scales.value  # the recipe's NVFP4 block-scale method (job_format)
        tasks += [{"kind": "serving_write", "shard": path.name,
                   "payload": {"plan": wire, "scale_dtype": dtype, "from_artifact": from_artifact,
                               "weight_scales": scales}} for path in files]
    return tasks


def run_serving_write(shard: str, payload: dict[str, Any], source_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Run one ``serving_write`` task of :func:`serving_shard_tasks` on this machine, writing under
    ``out_dir/serving/<format>/`` (``out_dir``: the artifact's directory). Returns its result as plain data."""
    if not out_dir.is_dir():  # made by the run that queued the task; written elsewhere, nobody would read it
        raise ConversionError(f"serving task for {shard}: the run's output directory is not on this machine; "
                              "run the serving export's tasks where its directory is (a shared disk)")
    selection = selection_from_wire(payload["plan"])
    source = (out_dir if payload["from_artifact"] else source_dir) / shard
    scale_dtype = getattr(torch, payload["scale_dtype"])
    return write_serving_shard(selection, source, out_dir / "serving" / selection.format, scale_dtype,
                               weight_scales=payload.get("weight_scales", "rtn"), rounded_dir=out_dir / ROUNDED_DIR)


def write_serving_shard(selection: ServingSelection, source: Path, directory: Path, scale_dtype: torch.dtype, *,
                        check_stop: Callable[[], None] | None = None, weight_scales: str = "rtn",
                        rounded_dir: Path | None = None) -> dict[str, Any]:
    """Write ``source``'s file of the selection's export into ``directory`` (byte for byte
    ``write_serving_checkpoint``'s file, the weight amax taken from the selection); returns the file's tensors, their
    bytes and each quantized weight's figures (the format's own ``layer_stats`` where it has one: the SQNR comes from
    calibration). ``rounded_dir``: where calibration left the weights it rounded (the selection's ``rounded``)."""
    fmt = _format_with_scales(selection.format, weight_scales)
    return write_serving_file(fmt, selection, source, directory, scale_dtype,
                              check_stop=check_stop, emulated_stats=False, rounded_dir=rounded_dir)


def finish_serving_export(selection: ServingSelection, source_dir: Path, shards: list[dict[str, Any]],
                          directory: Path, confinement: FileConfinement, *, weight_scales: str = "rtn") -> list[str]:
    """Index, config and side files of an export whose weight files :func:`write_serving_shard` wrote (``shards``:
    their results, in the source's file order); the shards' figures go into the selection. Returns every file
    name."""
    for shard in shards:
        selection.layer_stats.update(shard["layer_stats"])
    fmt = _format_with_scales(selection.format, weight_scales)
    side_files = getattr(fmt, "side_files", None)
    return [shard["file"] for shard in shards] + finish_checkpoint(
        source_dir, directory, shards, quantization_config=fmt.quantization_config(selection),
        confinement=confinement, json_files=side_files(selection) if side_files is not None else None)


def _add_measured_sqnr(selection: ServingSelection, measured: dict[str, dict[str, float | None]]) -> None:
    """Each quantized Linear's and expert unit's SQNR under the format, measured during calibration. The meter casts
    by nearest rounding: a weight GPTQ rounded gets the figure as ``nearest_sqnr_db``, not as its own."""
    rounded = {path for path, key in selection.quantized.items() if key in selection.rounded}
    rounded |= {unit for key, unit in selection.experts.items() if key in selection.rounded}
    for path in [*selection.quantized, *selection.expert_units]:
        if path in measured:
            key = "nearest_sqnr_db" if path in rounded else "sqnr_db"
            selection.layer_stats.setdefault(path, {})[key] = measured[path]


def _audit(run: Run, name: str, selection: ServingSelection, directory: Path) -> None:
    """Replay the engine's loading rules on the written export (:mod:`converters.serving.audit`).

    A problem fails the job, naming every tensor the engine would drop or misread: such an export would fail to
    load or run at the wrong scale. A format the audit has no rules for is said in the report and a warning.

    Raises:
        ConversionError: the audit found problems (field ``serving_formats``).
    """
    result = audit_export(directory)
    selection.load_audit = result.to_dict()
    if not result.audited:
        run.warn(f"{name}: the load audit has no rules for this format ({'; '.join(result.notes)})")
        return
    if result.problems:
        shown = "; ".join(f"{problem.rule.value}: {problem.name}: {problem.message}" for problem in result.problems[:5])
        more = f" (and {len(result.problems) - 5} more)" if len(result.problems) > 5 else ""
        raise ConversionError(f"serving format {name}: the export would not load as written in vLLM: {shown}{more}",
                              field="serving_formats")


def _attach_kv_cache(run: Run, name: str, selection: ServingSelection) -> None:
    """With ``kv_cache``: each attention layer's k_scale/v_scale into the selection of a format that writes them."""
    if not run.request.kv_cache or selection.kv_cache:
        return
    fmt = serving_format(name)
    if not getattr(fmt, "supports_kv_cache", False):
        run.warn(f"{name} carries no KV-cache scales (kv_cache applies to the formats that declare them)")
        return
    selection.kv_cache_report = attach_kv_scales(selection, run.calibration.kv_amax,
                                                 run.resolved.checkpoint.target_of, model_dtype(run.resolved.config),
                                                 convention=fmt.kv_scale_convention)
