"""The five pipeline stages. Each takes the run state, reports progress, and returns nothing but export."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from converters.errors import BackendUnavailableError, CalibrationDataError, ConversionError

if TYPE_CHECKING:
    from converters.pipeline import _Run

__all__ = ["resolve", "analyze", "convert", "calibrate", "export"]

logger = logging.getLogger(__name__)


def resolve(run: _Run) -> None:
    """Parse the recipe, find the model's files, read its config, load its weights (on the GPU if any)."""
    from converters.loading import load_config, load_model, resolve_model_dir

    run.recipe = run.request.parsed_recipe()
    for message in run.recipe.warnings():
        run.warn(message)
    run.model_dir = resolve_model_dir(run.request.model, run.sources, with_weights=True)
    run.config = load_config(run.model_dir, run.sources)
    max_positions = getattr(_text_config(run.config), "max_position_embeddings", None)
    if max_positions and run.request.calibration.seq_len > max_positions:
        raise CalibrationDataError(
            f"calibration.seq_len {run.request.calibration.seq_len} exceeds the model's "
            f"max_position_embeddings {max_positions}",
            field="calibration.seq_len",
        )
    run.sink.progress(1, 2)
    run.model = load_model(run.model_dir, run.sources)
    if torch.cuda.is_available():
        run.model.to("cuda")
    run.sink.progress(2, 2)


def analyze(run: _Run) -> None:
    """The eligibility report on the meta device; it alone decides what is converted."""
    from converters.analysis import AnalysisOptions, analyze_model
    from converters.loading import build_meta_model

    options = AnalysisOptions(
        backend=run.recipe.backend.value,
        include=run.request.include,
        exclude=run.request.exclude,
        skip_first_last=run.request.skip_first_last,
        convert_router_gates=run.request.convert_router_gates,
    )
    run.report = analyze_model(build_meta_model(run.config, run.sources), options)
    run.report["model"] = {"reference": run.request.model, "model_type": getattr(run.config, "model_type", None)}
    if run.report["totals"]["eligible_layers"] == 0:
        raise ConversionError(
            "no layer is eligible for FP8 (see `fp8forge analyze`): nothing to convert; "
            "adjust include/exclude or choose a model with nn.Linear layers whose dims are multiples of 16"
        )
    for group in run.report["fused_groups"]:
        if group["partly_eligible"]:
            run.warn(f"fused group {group['name']} is only partly FP8; serving engines may refuse it")
    run.sink.progress(1, 1)


def convert(run: _Run) -> None:
    """Swap the eligible layers (TE modules only where CUDA and TE are present) and seed their state."""
    from converters.analysis import eligible_paths

    eligible = eligible_paths(run.report)
    if run.recipe.backend.value == "ao":
        from converters.backends.torchao import convert_to_torchao

        run.converted = convert_to_torchao(run.model, eligible, run.recipe.to_float8_linear_config())
    else:
        _convert_te(run, eligible)
    run.sink.progress(1, 1)


def _convert_te(run: _Run, eligible: list[str]) -> None:
    from converters.backends.transformer_engine import te_status

    available, why = te_status()
    if available:
        from converters.backends.transformer_engine import apply_scaling_state, convert_to_te, fp8_check_step

        run.converted = convert_to_te(run.model, eligible)
        run.te_modules = True
        if run.calibration["states"] and "scale_fwd" in next(iter(run.calibration["states"].values())):
            apply_scaling_state(run.model, run.calibration["states"], run.recipe)
        try:
            run.calibration["te_check"] = fp8_check_step(run.model, run.calibration["check_batch"], run.recipe)
        except BackendUnavailableError as exc:  # TE imports, but this GPU cannot execute FP8 (before sm89)
            run.calibration["te_check"] = {"ran": False, "reason": exc.message}
            run.warn(f"the FP8 check step did not run: {exc.message}")
        return
    if run.request.te_extra_state:
        raise BackendUnavailableError(
            f"te_extra_state needs TransformerEngine to write its own _extra_state, and {why}; "
            "drop te_extra_state (the plain-tensor state is complete) or run on a CUDA worker with TE"
        )
    # No fake TE modules: the checkpoint is written from the recorded calibration, in TE's layout.
    run.converted = list(eligible)
    run.warn(f"TransformerEngine modules were not built here ({why}); the TE checkpoint is computed from "
             "the recorded calibration and loads with load_te() on a CUDA machine")


def calibrate(run: _Run) -> None:
    """Record amax per eligible layer over the calibration batches and derive the scaling state.

    This runs on the high-precision model, before the swap: the amax seeds describe the tensors FP8
    will have to represent (TE's own calibration mode also runs in high precision), and on a CPU an
    emulated FP8 matmul costs twenty times a bf16 one.
    """
    from converters.analysis import eligible_paths
    from converters.calibration import calibration_batches, record_amax
    from converters.loading import load_tokenizer

    settings = run.request.calibration
    tokenizer = load_tokenizer(run.model_dir, run.sources)
    vocab_size = getattr(_text_config(run.config), "vocab_size", None)
    if not vocab_size:
        raise CalibrationDataError(
            f"{type(run.config).__name__} declares no vocab_size: fp8forge calibrates text models only",
            field="model",
        )
    batches, source = calibration_batches(
        tokenizer,
        vocab_size=vocab_size,
        texts=list(settings.texts) if settings.texts is not None else None,
        steps=settings.steps,
        batch_size=settings.batch_size,
        seq_len=settings.seq_len,
    )
    if tokenizer is None:
        run.warn("the model ships no tokenizer: calibration used random token ids, not text")
    batches = [_model_inputs(run.model, run.config, batch) for batch in batches]
    try:
        amax = record_amax(
            run.model, eligible_paths(run.report), batches, backward=settings.backward,
            on_step=run.sink.progress, should_stop=run.sink.should_stop,
        )
    except (TypeError, ValueError) as exc:  # the architecture rejects plain token batches
        raise CalibrationDataError(
            f"{type(run.model).__name__} cannot be calibrated from token batches: {exc}", field="model"
        ) from exc
    run.calibration = {
        "data_source": source, "amax": amax, "states": _scaling_states(run, amax), "check_batch": batches[0],
    }


def _text_config(config: Any) -> Any:
    """The text part of a config (multimodal configs keep vocab_size and positions in ``text_config``)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _model_inputs(model: Any, config: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the inputs the model's forward accepts; an encoder-decoder gets the tokens as decoder input too."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    inputs = {key: value for key, value in batch.items() if key in accepted}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = batch["input_ids"]
    return inputs


def _scaling_states(run: _Run, amax: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """TE delayed scaling: the state TE would hold. Other recipes scale dynamically: per-step scales."""
    from converters.calibration import te_scaling_state
    from converters.recipes import TEDelayedScalingRecipe

    if isinstance(run.recipe, TEDelayedScalingRecipe):
        return {path: te_scaling_state(layer, run.recipe) for path, layer in amax.items()}
    fp8_max = 448.0  # e4m3 for inputs and weights in every torchao recipe and in TE current scaling
    return {
        path: {"scale_fwd_per_step": torch.where(layer.forward > 0, fp8_max / layer.forward, torch.ones(()))}
        for path, layer in amax.items()
    }


def export(run: _Run, staging: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Write weights, calibration, config, report and manifest into ``staging``."""
    from converters import artifact_files

    written = artifact_files.write_model_files(run, staging)
    run.sink.progress(1, 3)
    written += artifact_files.write_calibration_file(run, staging)
    written += _copy_side_files(run.model_dir, staging)
    written += artifact_files.write_json_files(run, staging, written)
    run.sink.progress(2, 3)
    from converters.export import write_manifest

    manifest = write_manifest(staging)
    run.sink.progress(3, 3)
    return sorted({*written, "manifest.json"}), manifest


def _copy_side_files(source: Path, staging: Path) -> list[str]:
    from converters.loading import TOKENIZER_FILES

    copied = []
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        if (source / name).is_file():
            shutil.copyfile(source / name, staging / name)
            copied.append(name)
    return copied
