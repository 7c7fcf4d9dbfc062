"""The pipeline stages before export. Each takes the run state, reports progress, and returns its record; the
driver stores it in the run (``STAGE_FUNCTIONS`` names the field). The stages that write the artifact (export,
quality, plan) are :mod:`converters.pipeline.artifact_stages`."""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any

import torch

from converters.analysis.comparison import recipes_converting
from converters.analysis.eligibility import (
    AnalysisOptions,
    analyze_model,
    check_include_patterns,
    check_report_rule,
    eligible_expert_units,
    eligible_paths,
)
from converters.backends import backend_for
from converters.backends.base import ConversionTargets, Converted
from converters.calibration.amax import measuring_sqnr, record_amax, te_scaling_state
from converters.calibration.batches import calibration_batches
from converters.calibration.kv_cache import recording_kv_amax
from converters.calibration.result import NO_TE_CHECK, CalibrationResult
from converters.calibration.scaling import E4M3_MAX
from converters.calibration.sensitivity import SQNR_DEFINITION, meter_for, report_sqnr
from converters.calibration.sequential import (
    LAYER_SEQUENTIAL,
    WHOLE_MODEL,
    SequentialStats,
    SequentialUnsupported,
    calibrate_layer_by_layer,
    choose_mode,
)
from converters.errors import CalibrationDataError, RequestError
from converters.model.checkpoint import Checkpoint, load_dequantized_model
from converters.model.experts import parse_unit_path
from converters.model.sources import (
    build_meta_model,
    load_config,
    load_model,
    load_tokenizer,
    model_dtype,
    resolve_model_dir,
)
from converters.pipeline.progress import LOAD_STEP, RESOLVE_STEPS, Unit
from converters.pipeline.serving_export import (
    select_serving_formats,
    serving_casts,
    serving_rounding,
    serving_sqnr,
)
from converters.pipeline.source_smoothing import smooth_source
from converters.pipeline.state import ResolvedModel, Run, Stage
from converters.plan.candidates import plan_compare_recipes
from converters.quality.held_out import calibration_part
from converters.recipes.presets import RECIPE_NAMES
from converters.recipes.registry import recipe_from_dict

__all__ = ["STAGE_FUNCTIONS", "start", "resolve", "analyze", "convert", "calibrate", "model_inputs"]


def start(run: Run) -> None:
    """Parse the recipe once and choose its backend once; a GPU that cannot run the recipe fails the job now,
    before any model is read."""
    run.recipe = run.request.parsed_recipe()
    for message in run.recipe.warnings():
        run.warn(message)
    run.backend = backend_for(run.recipe)
    for message in run.backend.preflight(run.recipe):
        run.warn(message)

def resolve(run: Run) -> ResolvedModel:
    """Find the model's files, read its config and choose the mode.

    The model is built on the meta device and its checkpoint indexed (headers only). Only the whole-model
    mode loads weights here, onto the GPU if there is one (``run.model``); the layer-sequential mode loads them
    layer by layer during calibration.
    """
    total = len(RESOLVE_STEPS)
    def step(done: int) -> None:
        run.sink.progress(done, total, Unit.STEP, step=RESOLVE_STEPS[done])

    step(0)
    directory = resolve_model_dir(run.request.model, run.sources, with_weights=True)
    step(1)
    config = load_config(directory, run.sources)
    max_positions = getattr(_text_config(config), "max_position_embeddings", None)
    if max_positions and run.request.calibration.seq_len > max_positions:
        raise CalibrationDataError(
            f"calibration.seq_len {run.request.calibration.seq_len} exceeds the model's "
            f"max_position_embeddings {max_positions}",
            field="calibration.seq_len",
        )
    step(2)
    meta_model = build_meta_model(config, run.sources)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step(3)
    checkpoint = Checkpoint(directory, meta_model, dtype=model_dtype(config), device=device)
    stack, mode, reason = choose_mode(meta_model, config, backward=run.request.calibration.backward,
                                          te_extra_state=run.request.te_extra_state)
    resolved = ResolvedModel(directory=directory, config=config, meta_model=meta_model, checkpoint=checkpoint,
                             stack=stack, tied_weights=dict(checkpoint.tied), mode=mode, mode_reason=reason,
                             device=device)
    if mode == WHOLE_MODEL:
        total += 1
        run.sink.progress(total - 1, total, Unit.STEP, step=LOAD_STEP)
        _load_whole_model(run, resolved)
    run.sink.progress(total, total, Unit.STEP)
    return resolved


def _load_whole_model(run: Run, resolved: ResolvedModel) -> None:
    if resolved.checkpoint.stored is not None:  # a quantized source: each weight dequantized as it loads
        run.model = load_dequantized_model(resolved.directory, resolved.config, run.sources,
                                           model_dtype(resolved.config))
    else:
        run.model = load_model(resolved.directory, run.sources)
    run.model.to(resolved.device)


def analyze(run: Run) -> dict[str, Any]:
    """The eligibility report on the meta device; it alone decides what is converted."""
    options = AnalysisOptions(
        recipe=run.recipe,  # its own shape rule: 16, or 32 for MXFP8, 128 for block scaling and NVFP4
        include=run.request.include,
        exclude=run.request.exclude,
        skip_first_last=run.request.skip_first_last,
        convert_router_gates=run.request.convert_router_gates,
    )
    report = analyze_model(run.resolved.meta_model, options)
    model_type = getattr(run.resolved.config, "model_type", None)
    report["model"] = {"reference": run.request.model, "model_type": model_type}
    check_include_patterns(report)
    check_report_rule(report, run.recipe)
    if report["totals"]["eligible_layers"] + report["totals"]["expert_units"] == 0:
        _nothing_eligible(run, report)
    _warn_partly_fp8_groups(run, report)
    run.serving = select_serving_formats(run, report)
    run.sink.progress(1, 1)
    return report


def _nothing_eligible(run: Run, report: dict[str, Any]) -> None:
    """Refuse a job that would convert nothing, naming the rule that left each layer out (bad input: the model,
    the recipe or the patterns do not fit together).

    Raises:
        RequestError: ``recipe`` when the recipe's shape rule left some layer out, else ``include/exclude``.
    """
    rule = run.recipe.shape_rule()
    reasons = sorted({reason for layer in report["layers"] for reason in layer["reasons"]})
    shape = rule.reason in reasons
    fix = "adjust include/exclude, skip_first_last or convert_router_gates"
    if shape:  # name only recipes whose own rule this model's dims meet: never the one in use
        named = {name: recipe_from_dict(data) for name, data in RECIPE_NAMES.items()}
        found = recipes_converting(report["layers"], run.recipe, named)
        by_count: dict[int, list[str]] = {}
        for name, count in found.items():
            by_count.setdefault(count, []).append(name)
        choices = "; ".join(f"{', '.join(names)} would convert {count} layer{'s' * (count > 1)}"
                            for count, names in sorted(by_count.items(), reverse=True))
        example = json.dumps(RECIPE_NAMES[next(iter(found))]) if found else ""
        fix = (f"the recipe ({run.recipe.library_class}) needs {rule.describe()}, "
               + (f"which no layer meets; choose a recipe whose rule this model's dims meet: {choices} (a name "
                  f"stands for its recipe at defaults, e.g. {example})" if found else
                  "and no recipe fp8forge knows has a rule this model's dims meet: convert another model"))
    raise RequestError(f"no layer is eligible for FP8 (reasons: {', '.join(reasons) or 'none'}; see `fp8forge "
                       f"analyze`): nothing to convert; {fix}", field="recipe" if shape else "include/exclude")


def _warn_partly_fp8_groups(run: Run, report: dict[str, Any], after: str = "", touching: set[str] | None = None
                            ) -> None:
    """Say what a group that is only partly FP8 means, where it means something. An experts GEMM runs as one
    grouped GEMM everywhere (TE's GroupedLinear, the engines), so the whole group stays in high precision in every
    artifact. A fused q/k/v or gate/up group is one GEMM only in a serving export, which keeps it in high precision
    whole; TE and torchao artifacts convert each such Linear on its own, so for them it means nothing."""
    expert_units = {layer["path"] for layer in report["layers"] if "expert" in layer}
    for group in report["fused_groups"]:
        if not group["partly_eligible"] or (touching is not None and not touching & set(group["members"])):
            continue
        left = sorted(set(group["members"]) - set(group["eligible_members"]))
        if group["members"][0] in expert_units:
            run.warn(f"experts GEMM {group['name']} is only partly FP8{after} ({', '.join(left)} not eligible): it "
                     "runs as one grouped GEMM, so the artifact keeps the whole group in high precision")
        elif run.request.serving_formats:
            run.warn(f"fused group {group['name']} is only partly FP8{after} ({', '.join(left)} not eligible): the "
                     "serving exports keep the whole group in high precision, since engines run it as one GEMM "
                     "(their report's skipped list says so); the training artifact converts its eligible members")


def convert(run: Run) -> Converted:
    """Swap the eligible layers and seed their state (TE modules only where CUDA and TE are present).

    In layer-sequential mode the torchao swap runs on the meta-device model: it checks that every eligible
    layer converts, without holding the weights (the artifact replays the swap on load).
    """
    eligible = eligible_paths(run.report)
    if run.request.min_sqnr_db is not None and not eligible and not eligible_expert_units(run.report):
        raise RequestError(f"every eligible layer's output SQNR is below min_sqnr_db {run.request.min_sqnr_db:g} dB "
                           "(see the report's sensitivity block): nothing is left to convert; lower min_sqnr_db",
                           field="min_sqnr_db")
    run.weights_on_disk = _renamed_weights(run, eligible)
    model = run.model if run.model is not None else run.resolved.meta_model
    run.targets = ConversionTargets(recipe=run.recipe, model=model, whole_model=run.model is not None,
                                    eligible=tuple(eligible), report=run.report,
                                    te_extra_state=run.request.te_extra_state)
    conversion = run.backend.convert(run.targets, run.calibration)
    for message in conversion.warnings:
        run.warn(message)
    run.sink.progress(1, 1)
    return conversion


def _renamed_weights(run: Run, eligible: list[str]) -> dict[str, str]:
    """Converted layers whose weight the checkpoint stores under another name: module path -> on-disk key."""
    renamed = {}
    for path in eligible:
        on_disk = run.resolved.checkpoint.on_disk_name(f"{path}.weight")
        if on_disk is not None and on_disk != f"{path}.weight":
            renamed[path] = on_disk
    return renamed


def calibrate(run: Run) -> CalibrationResult:
    """Record amax per eligible layer over the calibration batches and derive the scaling state.

    This runs on the high-precision model, before the swap: the amax seeds describe the tensors FP8
    will have to represent (TE's own calibration mode also runs in high precision), and on a CPU an
    emulated FP8 matmul costs twenty times a bf16 one. Layer by layer where the mode allows it; a model
    that turns out not to fit that shape falls back to the whole model, and the report says why.
    """
    batches, source = _calibration_batches(run)
    smoothing = smooth_source(run, batches)  # nvfp4_smoothing: from here on the run's source is the smoothed copy
    paths = eligible_paths(run.report) + eligible_expert_units(run.report)
    amax, te_check, forward = None, dict(NO_TE_CHECK), SequentialStats()
    compared = plan_compare_recipes(run.request.plan, run.request.compare_recipes)  # a plan reads its candidates' SQNR
    meter, label = meter_for(run.recipe, compared, serving_casts(run)) if run.request.measure \
        else (None, "")
    rounding = serving_rounding(run, meter, label)  # GPTQ for the NVFP4 exports, layer by layer (None: nearest)
    with measuring_sqnr(meter):  # the hooks also measure each layer's error under the recipe(s)
        if run.resolved.mode == LAYER_SEQUENTIAL:
            try:
                with _kv_recording(run, run.resolved.meta_model) as kv:
                    boundary = None if run.distributed is None else \
                        run.distributed.layer_boundary(run.request.to_dict(), run.resolved.directory,
                                                       run.resolved.stack, batches, paths, kv=kv, meter=meter,
                                                       rounding=rounding)
                    amax, te_check = _calibrate_layer_by_layer(run, batches, paths, forward, boundary, rounding)
            except SequentialUnsupported as exc:
                if rounding is not None:
                    raise RequestError(f"nvfp4_weight_rounding gptq needs the layer-sequential calibration, which "
                                       f"stopped: {exc}; use nvfp4_weight_rounding nearest for this model",
                                       field="recipe.nvfp4_weight_rounding") from exc
                run.mode_fallback = f"layer-sequential calibration stopped: {exc}"
                run.warn(f"calibrated the whole model at once: {exc}")
                if meter is not None:
                    meter.reset()
                _load_whole_model(run, run.resolved)
        if amax is None:
            with _kv_recording(run, run.model) as kv:
                amax = _calibrate_whole_model(run, batches, paths)
    amax = _apply_sensitivity(run, meter, label, amax)
    _report_experts(run, amax)
    return CalibrationResult(data_source=source, amax=amax, states=_scaling_states(run, amax),
                             check_batch=batches[0], te_check=te_check, kv_amax=kv.results() if kv else {},
                             serving_sqnr=serving_sqnr(run, meter),
                             forward=forward.to_dict() if forward.compute_dtype else {},
                             rounded_weights=dict(rounding.rounded) if rounding else {},
                             rounding=rounding.summary() if rounding else {}, smoothing=smoothing or {})


def _kv_recording(run: Run, model: Any) -> Any:
    """With ``kv_cache``: a recorder of every attention layer's key and value amax, in the calibration's own pass."""
    return recording_kv_amax(model) if run.request.kv_cache else nullcontext(None)


def _apply_sensitivity(run: Run, meter: Any, label: str, amax: dict[str, Any]) -> dict[str, Any]:
    """Put each layer's SQNR in the report; with min_sqnr_db, keep the layers below it out of the conversion.

    An excluded layer leaves the report's eligible set here, after calibration and before convert, so the swap,
    the state and calibration files and the serving selections (made again) all leave it in high precision.
    """
    if meter is None:
        run.report["sensitivity"] = {"measured": False, "reason": "the request turned the measurement off "
                                     "(measure: false)", "definition": SQNR_DEFINITION}
        return amax
    threshold = run.request.min_sqnr_db
    excluded = report_sqnr(run.report, meter, label, min_sqnr_db=threshold)
    if not excluded:
        return amax
    shown = ", ".join(excluded[:5]) + (f" and {len(excluded) - 5} more" if len(excluded) > 5 else "")
    run.warn(f"{len(excluded)} layer(s) stay in high precision (low_sqnr): output SQNR under {label} below "
             f"min_sqnr_db {threshold:g} dB: {shown}")
    _warn_partly_fp8_groups(run, run.report, after=" after low_sqnr", touching=set(excluded))
    if run.serving:
        run.serving = select_serving_formats(run, run.report)
    dropped = set(excluded)
    return {path: layer for path, layer in amax.items() if path not in dropped}


def _report_experts(run: Run, amax: dict[str, Any]) -> None:
    """Per MoE block: the experts converted, the tokens each received, and a warning for any that got none."""
    tokens: dict[str, dict[int, int]] = {}
    for path, layer in amax.items():
        unit = parse_unit_path(path)
        if unit is not None and layer.tokens is not None:
            tokens.setdefault(unit.module, {})[unit.index] = int(layer.tokens.sum())
    for block in run.report["moe"]:
        seen = tokens.get(block["module"], {})
        block["converted_experts"] = sorted(seen)
        block["tokens_per_expert"] = [seen.get(e) for e in range(block["experts"])]
        block["experts_without_tokens"] = [e for e in sorted(seen) if seen[e] == 0]
        if block["experts_without_tokens"]:
            run.warn(f"{block['module']}: expert(s) {block['experts_without_tokens']} received no calibration token; "
                     "they keep the weight-only state (input scale 1): give more or more varied calibration data")


def _calibration_batches(run: Run) -> tuple[list[dict[str, Any]], str]:
    settings = run.request.calibration
    tokenizer = run.tokenizer = load_tokenizer(run.resolved.directory, run.sources)
    vocab_size = getattr(_text_config(run.resolved.config), "vocab_size", None)
    if not vocab_size:
        raise CalibrationDataError(
            f"{type(run.resolved.config).__name__} declares no vocab_size: fp8forge calibrates text models only",
            field="model",
        )
    # Without the user's texts, the corpus less its held-out part: quality is measured on that part.
    texts = list(settings.texts) if settings.texts is not None else calibration_part()
    batches, source = calibration_batches(tokenizer, vocab_size=vocab_size, texts=texts, steps=settings.steps,
                                          batch_size=settings.batch_size, seq_len=settings.seq_len)
    if settings.texts is None:
        source = f"built-in corpus (calibration part, {len(texts)} paragraphs){source.partition('user text(s)')[2]}"
    if tokenizer is None:
        run.warn("the model ships no tokenizer: calibration used random token ids, not text")
    else:
        _warn_if_shorter_than_a_window(run, batches[0]["attention_mask"])
    return [model_inputs(run.resolved.meta_model, run.resolved.config, batch) for batch in batches], source


def _warn_if_shorter_than_a_window(run: Run, first_mask: torch.Tensor) -> None:
    # Only a token stream shorter than one window is padded, and then every window is that one sequence.
    tokens, seq_len = int(first_mask[0].sum()), run.request.calibration.seq_len
    if tokens < seq_len:
        run.warn(f"the calibration text holds {tokens} tokens, fewer than one window of calibration.seq_len "
                 f"{seq_len}: every step sees the same padded sequence; give more calibration.texts or a smaller "
                 "calibration.seq_len")


def _calibrate_whole_model(run: Run, batches: list[dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    try:
        return record_amax(run.model, paths, batches, backward=run.request.calibration.backward,
                           on_step=lambda done, total: run.sink.progress(done, total, Unit.STEP),
                           should_stop=run.sink.should_stop)
    except (TypeError, ValueError) as exc:  # the architecture rejects plain token batches
        raise CalibrationDataError(
            f"{type(run.model).__name__} cannot be calibrated from token batches: {exc}", field="model"
        ) from exc


def _calibrate_layer_by_layer(run: Run, batches: list[dict[str, Any]], paths: list[str], stats: SequentialStats,
                              boundary: Any = None, rounding: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each eligible layer's amax, and the TE check block of the per-layer check (where the backend has one);
    ``stats`` receives the compute dtype, prefetch and per-layer seconds; ``rounding`` (an ``after_layer``) rounds
    each layer's NVFP4 weights after the check has seen the layer as it is."""
    after_layer, te_check = run.backend.layer_check(run.recipe)
    te_check = te_check if te_check is not None else dict(NO_TE_CHECK)
    callbacks = [callback for callback in (after_layer, rounding) if callback is not None]
    try:
        amax = calibrate_layer_by_layer(
            run.resolved.meta_model, run.resolved.stack, run.resolved.checkpoint, batches, paths,
            on_layer=lambda done, total: run.sink.progress(done, total, Unit.LAYER),
            should_stop=run.sink.should_stop, stats=stats, boundary=boundary,
            after_layer=(lambda layer_pass: [callback(layer_pass) for callback in callbacks]) if callbacks else None,
        )
    except (TypeError, ValueError) as exc:  # the architecture rejects plain token batches
        raise CalibrationDataError(
            f"{type(run.resolved.meta_model).__name__} cannot be calibrated from token batches: {exc}", field="model"
        ) from exc
    if after_layer is not None:
        te_check = after_layer.summary()
        if not te_check["ran"]:
            run.warn(f"the FP8 check step did not run: {te_check['reason']}")
    return amax, te_check


def _text_config(config: Any) -> Any:
    """The text part of a config (multimodal configs keep vocab_size and positions in ``text_config``)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_inputs(model: Any, config: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the inputs the model's forward accepts; an encoder-decoder gets the tokens as decoder input too."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    inputs = {key: value for key, value in batch.items() if key in accepted}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = batch["input_ids"]
    if "use_cache" in accepted:  # a KV cache would keep every layer's keys and values for nothing
        inputs["use_cache"] = False
    return inputs


def _scaling_states(run: Run, amax: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """TE delayed scaling: the state TE would hold. Other recipes scale dynamically: per-step scales."""
    if run.recipe.stateful:
        return {path: te_scaling_state(layer, run.recipe) for path, layer in amax.items()}
    # e4m3 for inputs and weights in every torchao recipe and in TE current scaling
    return {
        path: {"scale_fwd_per_step": torch.where(layer.forward > 0, E4M3_MAX / layer.forward, torch.ones(()))}
        for path, layer in amax.items()
    }


#: The stages before export, in order, each with the function that runs it and the Run field its record goes to
#: (export needs a directory: the driver calls it itself).
STAGE_FUNCTIONS = ((Stage.RESOLVE, resolve, "resolved"), (Stage.ANALYZE, analyze, "report"),
                   (Stage.CALIBRATE, calibrate, "calibration"), (Stage.CONVERT, convert, "conversion"))
