"""The report's end-to-end quality block: the training artifact under its recipe's casts (emulated) and each
serving export as written (its quantized weights read back), against the source on held-out texts.

One layer-sequential pass (:func:`converters.quality.measure_qualities`) runs the source once and every variant
beside it. A model the pass cannot score (an encoder without an LM head, no tokenizer, a layer list it cannot
walk) gets ``measured: false`` and the reason; the job goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from converters.analysis.eligibility import eligible_paths
from converters.calibration.sequential import SequentialUnsupported
from converters.pipeline.state import Run
from converters.quality import (
    BUILT_IN_HELD_OUT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    QUALITY_DEFINITION,
    REQUEST_TEXTS,
    QualityUnavailable,
    export_layer_casts,
    load_source,
    measure_qualities,
    recipe_layer_casts,
)
from converters.recipes import recipe_from_dict
from converters.serving import serving_format

__all__ = ["TRAINING", "COMPARISON_COLUMNS", "COMPARISON_MAX_TOKENS", "quality_block", "add_comparison_quality"]

TRAINING = "training"


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
            variants[f"serving:{name}"] = _export_casts(run, staging / "serving" / name)
        texts = run.request.quality_texts
        figures = measure_qualities(source, variants, list(texts) if texts is not None else None,
                                    max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQ_LEN,
                                    should_stop=run.sink.should_stop, on_layer=on_layer)
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
        "serving": {name: figures[f"serving:{name}"].to_dict() for name in run.serving},
        "seconds": round(time.perf_counter() - started, 3),
    }


def _linears(run: Run) -> list[str]:
    """The Linears the training artifact converts (expert GEMM units run in high precision in this pass)."""
    return eligible_paths(run.report)


def _export_casts(run: Run, directory: Path) -> dict[str, Any]:
    fmt = serving_format(directory.name)
    library = "torchao" if run.recipe.backend.value == "ao" else "te"
    return export_layer_casts(directory, _linears(run), run.resolved.checkpoint.on_disk_name,
                              input_cast=getattr(fmt, "input_cast", None), library=library,
                              pow2_scales=getattr(fmt, "pow2_scales", False))


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
