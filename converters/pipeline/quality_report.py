"""The report's end-to-end quality block: the training artifact under its recipe's casts (emulated) and each
serving export as written (its quantized weights read back), against the source on held-out texts.

One layer-sequential pass (:func:`converters.quality.measure_qualities`) runs the source once and every variant
beside it. A model the pass cannot score (an encoder without an LM head, no tokenizer, a layer list it cannot
walk) gets ``measured: false`` and the reason; the job goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from converters.analysis.eligibility import eligible_paths
from converters.calibration.sequential import SequentialUnsupported
from converters.pipeline.state import Run
from converters.quality import (
    BUILT_IN_HELD_OUT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    KV_ROUNDING_NEAREST,
    KV_ROUNDING_TRUNCATE,
    QUALITY_DEFINITION,
    REQUEST_TEXTS,
    ExportFiles,
    QualityUnavailable,
    export_kv_casts,
    export_layer_casts,
    load_source,
    measure_qualities,
    recipe_layer_casts,
)
from converters.recipes import recipe_from_dict
from converters.serving import serving_format

__all__ = ["TRAINING", "COMPARISON_COLUMNS", "COMPARISON_MAX_TOKENS", "quality_block", "add_comparison_quality"]

TRAINING = "training"
#: the suffix of an export's variant that keeps its KV cache in high precision (what FP8 KV costs on its own)
_WITHOUT_KV = ":without-fp8-kv"
#: the suffix of an export's variant whose FP8 KV cache truncates as vLLM's CPU build casts it
_KV_TRUNCATED = ":fp8-kv-truncated"


def quality_block(run: Run, staging: Path, on_layer: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """``report["quality"]`` for this job (its serving exports already written under ``staging/serving``);
    ``on_layer(done, total)`` after each layer of the pass (and its head)."""
    if not run.request.measure:
        return {"measured": False, "reason": "the request turned the measurement off (measure: false)",
                "definition": QUALITY_DEFINITION}
    started = time.perf_counter()
    try:
        source = load_source(run.resolved.directory, run.sources, tokenizer=run.tokenizer)
        variants = {TRAINING: recipe_layer_casts(run.recipe, _linears(run), run.calibration.amax)}
        for name in run.serving:
            linears, kv = _export_casts(run, source, staging / "serving" / name)
            variants[f"serving:{name}"] = {**linears, **kv}
            if kv:
                variants[f"serving:{name}{_WITHOUT_KV}"] = linears
                variants[f"serving:{name}{_KV_TRUNCATED}"] = {
                    **linears, **{path: replace(cast, rounding=KV_ROUNDING_TRUNCATE) for path, cast in kv.items()}}
        texts = run.request.quality_texts
        share = run.distributed.quality_share(run, staging) if run.distributed is not None else None
        figures = measure_qualities(source, variants, list(texts) if texts is not None else None,
                                    max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQ_LEN,
                                    should_stop=run.sink.should_stop, on_layer=on_layer, share=share)
    except (QualityUnavailable, SequentialUnsupported) as exc:
        run.warn(f"end-to-end quality not measured: {exc}")
        return {"measured": False, "reason": str(exc), "definition": QUALITY_DEFINITION}
    training = figures[TRAINING]
    return {
        "measured": True, "definition": QUALITY_DEFINITION,
        "held_out": {"source": REQUEST_TEXTS if texts is not None else BUILT_IN_HELD_OUT, "texts": training.texts,
                     "tokens": training.tokens, "max_tokens": DEFAULT_MAX_TOKENS, "seq_len": DEFAULT_SEQ_LEN},
        "reference": {"perplexity": training.perplexity_reference},
        "training": {"recipe": run.recipe.to_dict(), "emulated": True, **training.to_dict()},
        "serving": {name: _serving_figures(figures, name) for name in run.serving},
        "seconds": round(time.perf_counter() - started, 3),
    }


def _linears(run: Run) -> list[str]:
    """The Linears the training artifact converts (expert GEMM units run in high precision in this pass)."""
    return eligible_paths(run.report)


def _export_casts(run: Run, source: Any, directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The export's Linears as the engine runs them, and its attention modules' FP8 KV cache ({} without one),
    both read from its files."""
    fmt = serving_format(directory.name)
    library = "torchao" if run.recipe.backend.value == "ao" else "te"
    files = ExportFiles(directory)
    on_disk_name = run.resolved.checkpoint.on_disk_name
    linears = export_layer_casts(directory, _linears(run), on_disk_name, input_cast=getattr(fmt, "input_cast", None),
                                 library=getattr(fmt, "input_library", None) or library,
                                 pow2_scales=getattr(fmt, "pow2_scales", False), files=files)
    try:
        kv = export_kv_casts(directory, source.model, on_disk_name, files.read, files.file_of,
                             source.checkpoint.dtype, rounding=KV_ROUNDING_NEAREST)
    except ValueError as exc:
        raise QualityUnavailable(f"the FP8 KV cache of {directory.name} cannot be emulated: {exc}",
                                 field="kv_cache") from None
    return linears, kv


def _serving_figures(figures: dict[str, Any], name: str) -> dict[str, Any]:
    """An export's figures as the engine runs it; with an FP8 KV cache, also without it and what it costs."""
    engine = figures[f"serving:{name}"]
    out = engine.to_dict()
    without = figures.get(f"serving:{name}{_WITHOUT_KV}")
    if without is not None:
        truncated = figures[f"serving:{name}{_KV_TRUNCATED}"]
        out["kv_cache"] = {
            "dtype": "fp8_e4m3", "keys": "after RoPE", "rounding": KV_ROUNDING_NEAREST,
            "without_fp8_kv": without.to_dict(),
            # the FP8 KV cache's share of the export's loss: the figures with it over those without it
            "perplexity_increase": engine.perplexity / without.perplexity - 1.0,
            "kl_mean_increase": engine.kl_mean - without.kl_mean,
            # vLLM's CPU build truncates the cast (csrc/cpu/cpu_attn_fp8.hpp): keys and values come out ~4% smaller
            "truncated_as_vllm_cpu": {**truncated.to_dict(), "rounding": KV_ROUNDING_TRUNCATE,
                                      "perplexity_increase": truncated.perplexity / without.perplexity - 1.0,
                                      "kl_mean_increase": truncated.kl_mean - without.kl_mean}}
    return out


#: positions a synchronous analysis scores per compared recipe: the answer stays within seconds for a small model
COMPARISON_MAX_TOKENS = 64
#: the columns ``compare_recipes`` gains per recipe (and the CLI prints)
COMPARISON_COLUMNS = ("perplexity", "kl_mean", "kl_max", "top1_agreement")


def add_comparison_quality(run: Run, on_layer: Callable[[int, int], None] | None = None) -> None:
    """Each compared recipe of ``run.report["comparison"]`` gains ``quality`` (its figures; None when the model
    cannot be scored) and the report a ``quality`` block (held-out texts, the source's perplexity, or the reason);
    ``on_layer(done, total)`` after each layer of the pass."""
    comparison = run.report.get("comparison")
    if not comparison:
        return
    started = time.perf_counter()
    texts = run.request.quality_texts
    try:
        source = load_source(run.resolved.directory, run.sources, tokenizer=run.tokenizer)
        # each recipe scored on the layers it would convert: those its shape rule excludes stay in high precision
        variants = {recipe["label"]: recipe_layer_casts(recipe_from_dict(recipe["recipe"]),
                                                        [path for path in _linears(run)
                                                         if path not in recipe.get("excluded", {})],
                                                        run.calibration.amax)
                    for recipe in comparison["recipes"]}
        figures = measure_qualities(source, variants, list(texts) if texts is not None else None,
                                    max_tokens=COMPARISON_MAX_TOKENS, seq_len=DEFAULT_SEQ_LEN,
                                    should_stop=run.sink.should_stop, on_layer=on_layer)
    except (QualityUnavailable, SequentialUnsupported) as exc:
        for recipe in comparison["recipes"]:
            recipe["quality"] = None
        run.report["quality"] = {"measured": False, "reason": str(exc), "definition": QUALITY_DEFINITION}
        return
    for recipe in comparison["recipes"]:
        recipe["quality"] = figures[recipe["label"]].to_dict()
    first = next(iter(figures.values()))
    run.report["quality"] = {
        "measured": True, "definition": QUALITY_DEFINITION,
        "held_out": {"source": first.held_out, "texts": first.texts, "tokens": first.tokens,
                     "max_tokens": COMPARISON_MAX_TOKENS, "seq_len": DEFAULT_SEQ_LEN},
        "reference": {"perplexity": first.perplexity_reference}, "seconds": round(time.perf_counter() - started, 3)}
