"""The ``fp8forge`` command: analyze, convert, compare, requantize, sync, serve, worker, keys.

At start-up only the torch-free parts of converters and the settings load; each command imports its heavy
libraries itself, so ``fp8forge analyze`` pays neither for torchao nor for the service stack.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from converters.analysis.render import format_analysis
from converters.errors import Fp8ForgeError, ModelNotFoundError, ModelReferenceError, RequestError
from converters.frozen_imports import imports_frozen
from converters.pipeline.request import KV_CACHE_DTYPES, KV_CACHE_FORMAT_NAMES, SERVING_FORMAT_NAMES
from converters.recipes.presets import RECIPE_NAMES
from converters.third_party_noise import silence_third_party_noise
from service.cli import check, compare, convert, keys, plan, requantize, serve, sync
from service.cli.args import (
    add_calibration_arguments,
    add_min_sqnr_argument,
    add_selection_arguments,
    add_source_arguments,
    recipe_file_warned,
    source_options_from_args,
)
from service.cli.help import finish_help
from service.cli.wording import error_in_cli_words, local_directory_hint
from service.config import SettingsError

__all__ = ["main", "build_parser"]


EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fp8forge")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8forge", description="Turn Hugging Face models into FP8 checkpoints.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    analyze = commands.add_parser("analyze", help="report which layers FP8 conversion would touch, and why not")
    analyze.add_argument("model", help="org/name[@revision] or a local model directory")
    add_selection_arguments(analyze)
    analyze.add_argument("--json", action="store_true", help="print the report as JSON")
    sensitivity = analyze.add_argument_group(
        "quantization error", "with --calibrate the model's weights are loaded and a calibration runs: each eligible "
        "layer's SQNR (dB) under the recipe is shown")
    sensitivity.add_argument("--calibrate", action="store_true", help="calibrate and show each layer's SQNR")
    sensitivity.add_argument("--recipe", type=Path,
                             help="recipe file (JSON or Accelerate YAML): its shape rule decides eligibility; "
                                  "with --calibrate its casts are measured")
    add_calibration_arguments(sensitivity, backward=False)
    add_min_sqnr_argument(sensitivity, "with --calibrate, mark")
    sensitivity.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_source_arguments(analyze)
    analyze.set_defaults(func=_run_analyze)

    convert = commands.add_parser("convert", help="convert a model to FP8 and write safetensors artifacts")
    convert.add_argument("model", help="org/name[@revision] or a local model directory")
    convert.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
    convert.add_argument("--recipe", type=Path, metavar="FILE|NAME",
                         help="recipe file (JSON, or an Accelerate config.yaml), or a recipe name as `fp8forge "
                              "compare` prints them: " + ", ".join(RECIPE_NAMES)
                              + " (default: --backend's default recipe)")
    add_selection_arguments(convert)
    add_calibration_arguments(convert)
    add_min_sqnr_argument(convert, "keep in high precision")
    convert.add_argument("--serving", action="append", default=[], metavar="FORMAT",
                         help="also write a serving checkpoint in serving/FORMAT/: " + ", ".join(SERVING_FORMAT_NAMES)
                              + "; repeatable")
    convert.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, default=None,
                         help="fp8: the serving checkpoints also carry calibrated FP8 KV-cache scales (k_scale/v_scale "
                              "per attention layer) for vLLM/SGLang --kv-cache-dtype fp8; needs --serving "
                              + " or ".join(KV_CACHE_FORMAT_NAMES))
    convert.add_argument("--no-measure", action="store_true",
                         help="do not measure each layer's SQNR during calibration (the job costs the calibration "
                              "forward alone; the report says the measurement was off)")
    convert.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_source_arguments(convert)
    convert.set_defaults(func=_run_convert)

    compare.register(commands)
    check.register(commands)
    plan.register(commands)
    requantize.register(commands)
    sync.register(commands)

    serve.register(commands)
    keys.register(commands)
    finish_help(parser)
    return parser


def _run_analyze(args: argparse.Namespace) -> int:
    if args.calibrate:
        return compare.run_calibrated_analyze(args, source_options_from_args(args))
    flags = {"--min-sqnr-db": args.min_sqnr_db, "--calib-steps": args.calib_steps,
             "--calib-batch-size": args.calib_batch_size, "--calib-seq-len": args.calib_seq_len,
             "--calib-texts": args.calib_texts}
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        raise RequestError(f"{given[0]} applies to a calibrated analysis: add --calibrate", field="calibrate")
    # transformers imports torchao whenever it is installed; analysis never needs it, so hide it while
    # analysing (a None entry makes importlib report the package as absent) and un-hide it afterwards.
    hidden = "torchao" not in sys.modules
    if hidden:
        sys.modules["torchao"] = None
    try:
        with imports_frozen():  # held out of the collector's way, as the model commands' imports are
            import transformers.modeling_utils  # noqa: F401 - what the meta model's classes import

            from converters.analysis.eligibility import analyze_model_reference  # torch: after the flag checks
        report = analyze_model_reference(
            args.model,
            source_options_from_args(args),
            backend=args.backend or "te",
            include=args.include,
            exclude=args.exclude,
            skip_first_last=not args.no_skip_first_last,
            convert_router_gates=args.convert_router_gates,
            recipe=recipe_file_warned(args.recipe) if args.recipe is not None else None,  # its own shape rule
        )
    finally:
        if hidden and sys.modules.get("torchao", 0) is None:
            del sys.modules["torchao"]
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print(format_analysis(report))
    return EXIT_OK


def _run_convert(args: argparse.Namespace) -> int:
    return convert.run_convert_command(args, source_options_from_args(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8forge`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")

    silence_third_party_noise()  # before any command imports torch, torchao or transformers
    # libgomp reads its wait policy when torch loads: passive, as in the service's conversion children (spinning
    # OpenMP threads slow a calibration several times on a host whose cores are shared:
    # docs/benchmarks/calibration-speed-2026-12-02.md)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    try:
        return args.func(args)
    except Fp8ForgeError as exc:
        message = error_in_cli_words(exc.message, exc.field)
        hint = local_directory_hint(getattr(args, "model", None))  # `models/x` read as a hub id, ./models/x there
        if hint and isinstance(exc, (ModelReferenceError, ModelNotFoundError)):
            message = f"{hint}. {message}"  # the fix first: the library's message is about the hub
        print(f"fp8forge {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.is_bad_input else EXIT_FAILED
    except SettingsError as exc:
        print(f"fp8forge {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"fp8forge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
