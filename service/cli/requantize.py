"""`fp8forge requantize`: a checkpoint converted shard by shard from its files alone (no model class, no calibration).

The source is resolved through the same source options as ``convert`` (allowed roots, hub cache, offline);
the conversion is :func:`converters.modelfree.convert_model_free`.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from converters.errors import RequestError
from converters.pipeline.request import REQUANTIZE_TARGETS
from service.cli.args import add_source_arguments, source_options_from_args
from service.cli.render import BarSink

__all__ = ["register", "run_requantize_command"]

#: what --to takes, in the order its error lists them (converters.modelfree.targets.MODEL_FREE_TARGETS, which imports
#: torch; tests/service/cli/test_first_steps.py checks the two are one list): read from the torch-free request module
#: so that --help imports no torch
_TARGETS = REQUANTIZE_TARGETS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``requantize`` to the ``fp8forge`` parser."""
    parser = subparsers.add_parser(
        "requantize", help="convert a checkpoint shard by shard from its files alone (formats needing no calibration)",
        description="Convert a safetensors checkpoint to a serving format (or back to bf16) from its files and "
                    "config.json alone: no model class, no remote code, no calibration; shard by shard, so memory is "
                    "that of the largest weight.")
    parser.add_argument("model", help="org/name[@revision] or a local model directory")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
    parser.add_argument("--to", required=True, metavar="FORMAT", help="target format: " + ", ".join(_TARGETS))
    parser.add_argument("--include", action="append", default=[], metavar="PAT", help="only convert matching layers")
    parser.add_argument("--exclude", action="append", default=[], metavar="PAT", help="never convert matching layers")
    parser.add_argument("--no-skip-first-last", action="store_true", help="also convert the first and last Linear")
    parser.add_argument("--no-measure", action="store_true",
                        help="leave each converted weight's SQNR out of the report (the same bytes, one pass over "
                             "every weight less)")
    parser.add_argument("--workers", type=int, default=1, help="shard tasks run in this many processes (default 1)")
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="cast the converted weights on cpu (default) or cuda / cuda:N: the same bytes; reads, "
                             "writes and checksums stay on the host")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (by default each stage's bar counts the shards and bytes written)")
    add_source_arguments(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return run_requantize_command(args, source_options_from_args(args))


def run_requantize_command(args: argparse.Namespace, sources) -> int:
    from converters.model.sources import confinement_for, resolve_model_dir  # imports torch: only when it runs
    from converters.modelfree import REPORT_NAME, convert_model_free  # imports torch: only when it runs

    if args.workers < 1:
        raise RequestError("--workers must be at least 1", field="workers")
    directory = resolve_model_dir(args.model, sources, with_weights=True)
    created = [] if args.out.exists() else _missing_parents(args.out)
    for parent in reversed(created):
        parent.mkdir()
    sink = BarSink(enabled=not args.no_progress)  # the stages and words of a requantize job's events
    try:
        report = convert_model_free(directory, args.out, args.to, include=args.include, exclude=args.exclude,
                                    skip_first_last=not args.no_skip_first_last, measure=not args.no_measure,
                                    workers=args.workers, device=args.device,
                                    confinement=confinement_for(sources), sink=sink)
    except BaseException:
        for parent in created:  # a failed run leaves no directory behind, parents included
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    finally:
        sink.close()
    kept = sum(1 for layer in report["layers"] if not layer["eligible"])
    print(f"{args.to}: converted {len(report['quantized'])} weights in {len(report['shards'])} shard(s); "
          f"{kept} kept in high precision")
    print(f"wrote {args.out}; report: {args.out / REPORT_NAME}")
    return 0


def _missing_parents(out: Path) -> list[Path]:
    """The parents of ``out`` that do not exist yet, nearest first."""
    return [parent for parent in out.parents if not parent.exists()]
