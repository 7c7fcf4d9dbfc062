"""`fp8forge convert`: run the conversion pipeline with a progress bar per stage and a closing summary."""

from __future__ import annotations

import argparse
from typing import Any

from converters.analysis.render import human_bytes
from converters.errors import RecipeError
from converters.pipeline.request import ConversionRequest
from converters.recipes import load_recipe_file
from service.cli.args import calibration_from_args
from service.cli.render import BarSink, format_worst_layers

__all__ = ["run_convert_command", "request_from_args"]


def request_from_args(args: argparse.Namespace):
    """Build the ConversionRequest from CLI flags (recipe file, backend, calibration, selection)."""
    recipe: dict[str, Any] = {"backend": args.backend or "te"}
    if args.recipe is not None:
        recipe = load_recipe_file(args.recipe).to_dict()
        if args.backend and args.backend != recipe["backend"]:
            raise RecipeError(
                f"--backend {args.backend} contradicts the recipe file's backend {recipe['backend']}; drop one",
                field="backend",
            )
    calibration = calibration_from_args(args)
    return ConversionRequest(
        model=args.model,
        recipe=recipe,
        calibration=calibration,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        skip_first_last=not args.no_skip_first_last,
        convert_router_gates=args.convert_router_gates,
        serving_formats=tuple(args.serving),
        min_sqnr_db=args.min_sqnr_db,
    )


def run_convert_command(args: argparse.Namespace, sources) -> int:
    import json

    from converters.pipeline.driver import run_conversion  # imports torch: only in the process that converts

    request = request_from_args(args)
    sink = BarSink(enabled=not args.no_progress)
    try:
        result = run_conversion(request, args.out, sources, sink)
    finally:
        sink.close()
    total = sum(entry["bytes"] for entry in result.manifest)
    experts = f" and {len(result.converted_experts)} expert GEMM groups" if result.converted_experts else ""
    print(f"converted {len(result.converted)} layers{experts} with backend {request.parsed_recipe().backend.value}")
    print(f"mode: {result.pipeline['mode'].replace('_', '-')} ({result.pipeline['reason']})")
    print(f"wrote {len(result.manifest) + 1} files ({human_bytes(total)}) to {result.out_dir}")
    print(f"report: {result.report_path}")
    print(format_worst_layers(json.loads(result.report_path.read_text(encoding="utf-8"))["analysis"]))
    if sink.warnings:
        print(f"{len(sink.warnings)} warning(s); see fp8_report.json")
    return 0
