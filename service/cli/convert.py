"""`fp8forge convert`: run the conversion pipeline with a progress bar per stage and a closing summary."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from converters.analysis.render import human_bytes
from converters.artifact.layout import REPORT_FILE
from converters.calibration.result import amax_swing_line
from converters.errors import Fp8ForgeError, RecipeError
from converters.frozen_imports import import_model_stack
from converters.pipeline.request import ConversionRequest
from service.cli.args import calibration_from_args, recipe_file
from service.cli.render import BarSink, format_quality, format_serving_exports, format_worst_layers

__all__ = ["run_convert_command", "request_from_args"]


def request_from_args(args: argparse.Namespace):
    """Build the ConversionRequest from CLI flags (recipe file, backend, calibration, selection), and the recipe
    file's own warnings (see :func:`service.cli.args.recipe_file`)."""
    recipe: dict[str, Any] = {"backend": args.backend or "te"}
    notes: list[str] = []
    if args.recipe is not None:
        recipe, notes = recipe_file(args.recipe)
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
        kv_cache=getattr(args, "kv_cache", None),
        measure=not getattr(args, "no_measure", False),
    ), notes


def _make_parents(out: Path) -> list[Path]:
    """Create the missing parents of ``out``, outermost first; returns the ones created.

    Raises:
        Fp8ForgeError (bad input, ``--out``): a parent cannot be created (a file in the way, no permission).
    """
    missing = [parent for parent in reversed(out.absolute().parents) if not parent.exists()]
    for index, parent in enumerate(missing):
        try:
            parent.mkdir()
        except OSError as exc:
            for made in reversed(missing[:index]):
                made.rmdir()
            raise Fp8ForgeError(f"--out {out}: cannot create {parent}: {exc.strerror}", field="out") from exc
    return missing


def run_convert_command(args: argparse.Namespace, sources) -> int:
    import json

    request, notes = request_from_args(args)
    import_model_stack()  # once the flags are checked
    from converters.pipeline.driver import run_conversion  # imports torch: only in the process that converts

    sink = BarSink(enabled=not args.no_progress)
    created = [] if args.out.exists() else _make_parents(args.out)
    try:
        result = run_conversion(request, args.out, sources, sink, notes=notes)
    except BaseException:
        for parent in reversed(created):  # a failed convert leaves no directory behind, parents included
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    finally:
        sink.close()
    total = sum(entry["bytes"] for entry in result.manifest)
    experts = f" and {len(result.converted_experts)} expert GEMM groups" if result.converted_experts else ""
    print(f"converted {len(result.converted)} layers{experts} with backend {request.parsed_recipe().backend.value}")
    print(f"mode: {result.pipeline['mode'].replace('_', '-')} ({result.pipeline['reason']})")
    print(f"wrote {len(result.manifest) + 1} files ({human_bytes(total)}) to {result.out_dir}")
    print(f"report: {result.report_path}")
    report = json.loads(result.report_path.read_text(encoding="utf-8"))
    print(format_worst_layers(report["analysis"]))
    if amax_swing_line(report.get("amax_swing")):
        print(amax_swing_line(report["amax_swing"]))
    if report.get("serving"):
        print(format_serving_exports(report))
    if report.get("quality"):
        print(format_quality(report))
    if sink.warnings:
        print(f"{len(sink.warnings)} warning(s); see {REPORT_FILE}")
    return 0
