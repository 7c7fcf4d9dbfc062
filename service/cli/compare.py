"""`fp8forge compare` and `fp8forge analyze --calibrate`: per-layer quantization error (SQNR) under recipes.

One calibration feeds every recipe: the table shows, per eligible layer, the SQNR each recipe's casts leave
(``converters.calibration.sensitivity``), so a recipe can be picked before training.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from converters.analysis.render import format_analysis
from converters.errors import RecipeError
from converters.frozen_imports import import_model_stack
from converters.pipeline.request import ConversionRequest
from converters.recipes.presets import RECIPE_NAMES
from service.cli.args import (
    add_calibration_arguments,
    add_min_sqnr_argument,
    add_selection_arguments,
    add_source_arguments,
    calibration_from_args,
    recipe_file_warned,
    source_options_from_args,
)
from service.cli.render import DEFAULT_WIDTH, METRICS, BarSink, format_comparison, format_sqnr_layers

__all__ = [
    "register",
    "run_compare_command",
    "run_calibrated_analyze",
]



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``compare`` to the ``fp8forge`` parser (selection and source flags as ``analyze`` has them)."""
    compare = subparsers.add_parser(
        "compare", help="per-layer SQNR of several recipes side by side, from one calibration",
        description="Calibrate once and show, per eligible layer, the signal-to-quantization-noise ratio (dB) "
                    "each recipe's FP8/FP4 casts leave, emulated on the CPU with the hardware's rounding.")
    compare.add_argument("model", help="org/name[@revision] or a local model directory")
    compare.add_argument("--recipes", default=None, metavar="NAMES",
                         help="comma-separated recipe names, or all (default: all unless --recipe is given): "
                              "te-delayed, te-current, te-mxfp8, te-float8-block, te-nvfp4, ao-tensorwise, "
                              "ao-rowwise, ao-rowwise-gw-hp, ao-float8-op, ao-mxfp8-op")
    compare.add_argument("--recipe", action="append", type=Path, default=[], metavar="FILE",
                         help="a recipe file (JSON or Accelerate YAML) to compare too; repeatable")
    compare.add_argument("--metric", choices=(*METRICS, "all"), default="output",
                         help="which SQNR to tabulate (default output)")
    add_selection_arguments(compare)
    add_calibration_arguments(compare, backward=False)
    add_min_sqnr_argument(compare, "flag")
    compare.add_argument("--width", type=int, default=DEFAULT_WIDTH, metavar="COLUMNS",
                         help="fit the tables into COLUMNS characters, continuing with the recipes that do not fit in "
                              "a further table (default %(default)s; 0: one table however wide)")
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    compare.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_source_arguments(compare)
    compare.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    return run_compare_command(args, source_options_from_args(args))


def _compare_entries(args: argparse.Namespace) -> tuple[list[Any], list[str | None]]:
    """The recipes to compare as request entries (names or recipe dicts) and their labels."""
    entries: list[Any] = []
    labels: list[str | None] = []
    names = args.recipes if args.recipes is not None else ("all" if not args.recipe else "")
    for name in (part.strip() for part in names.split(",") if part.strip()):
        chosen = list(RECIPE_NAMES) if name == "all" else [name]
        for item in chosen:
            if item not in RECIPE_NAMES:
                raise RecipeError(f"--recipes: unknown recipe name {item!r}; known: all, {', '.join(RECIPE_NAMES)}",
                                  field="recipes")
            entries.append(item)
            labels.append(None)
    for path in args.recipe:
        entries.append(recipe_file_warned(path))
        labels.append(path.stem)
    if not entries:
        raise RecipeError("--recipes names no recipe; give names, all, or --recipe FILE", field="recipes")
    return entries, labels


def _request(args: argparse.Namespace, recipe: dict[str, Any], compare: list[Any] = ()):
    return ConversionRequest(model=args.model, recipe=recipe, calibration=calibration_from_args(args),
                             include=tuple(args.include), exclude=tuple(args.exclude),
                             skip_first_last=not args.no_skip_first_last,
                             convert_router_gates=args.convert_router_gates,
                             min_sqnr_db=args.min_sqnr_db, compare_recipes=tuple(compare))


def _analysis_with_bars(request, sources, enabled: bool) -> dict[str, Any]:
    import_model_stack()
    from converters.pipeline.sync_analysis import calibrated_analysis  # imports torch: only when a calibration runs

    sink = BarSink(enabled=enabled)
    try:
        return calibrated_analysis(request, sources, sink=sink)
    finally:
        sink.close()


def run_compare_command(args: argparse.Namespace, sources) -> int:
    import json

    from converters.calibration.sensitivity import relabel_comparison  # imports torch: only when a calibration runs

    entries, labels = _compare_entries(args)
    report = _analysis_with_bars(_request(args, {"backend": args.backend or "te"}, entries), sources,
                                 not args.no_progress)
    relabel_comparison(report, labels)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    metrics = METRICS if args.metric == "all" else (args.metric,)
    print("\n\n".join(format_comparison(report, metric, max(args.width, 0)) for metric in metrics))
    return 0


def run_calibrated_analyze(args: argparse.Namespace, sources) -> int:
    """``fp8forge analyze --calibrate``: the analysis table, then each calibrated layer's SQNR under the recipe."""
    import json


    recipe = recipe_file_warned(args.recipe) if args.recipe else {"backend": args.backend or "te"}
    report = _analysis_with_bars(_request(args, recipe), sources, not args.no_progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_analysis(report))
        print()
        print(format_sqnr_layers(report))
    return 0


