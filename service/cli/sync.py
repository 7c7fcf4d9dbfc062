"""`fp8forge sync`: a training artifact's serving export, bit-identical to the training casts, streamed.

The export is :func:`converters.sync.sync_serving`: the recipe's training twin by default (docs/sync.md), the
weights of the artifact or of the checkpoint its training wrote (``--weights``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run_sync_command"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sync`` to the ``fp8forge`` parser."""
    parser = subparsers.add_parser(
        "sync", help="write a training artifact's serving export, bit-identical to the training casts",
        description="Write only the serving export of an fp8forge training artifact: each converted Linear's weight "
                    "cast exactly as its recipe's training kernels cast it, every other tensor copied as bytes, one "
                    "tensor at a time.")
    parser.add_argument("artifact", type=Path, help="an fp8forge training artifact directory")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
    parser.add_argument("--format", default=None, metavar="FORMAT",
                        help="serving format (default: the recipe's training twin; see docs/sync.md)")
    parser.add_argument("--weights", default=None, type=Path, metavar="DIR",
                        help="safetensors written by training after the artifact was loaded (default: the "
                             "artifact's own weights)")
    parser.set_defaults(func=run_sync_command)


def run_sync_command(args: argparse.Namespace) -> int:
    from converters.sync import SYNC_REPORT_NAME, sync_serving  # imports torch: only when it runs

    report = sync_serving(args.artifact, args.out, format_name=args.format, weights=args.weights)
    twin = report["serving"][report["format"]]["training_twin"]
    gigabytes = report["bytes_written"] / 1e9
    print(f"{report['format']}: cast {len(report['quantized'])} weights, {len(report['kept'])} Linears kept in high "
          f"precision; {gigabytes:.3f} GB in {report['seconds']:.2f} s")
    if report["differs_from_training"]:
        print(f"note: {len(report['differs_from_training'])} Linear(s) ran in FP8 in training but stay in high "
              "precision here (their fused group was not converted whole): see differs_from_training in the report")
    if twin["identical"]:
        print(f"the FP8 weights are bit-identical to the casts of {twin['training']} "
              f"(checked by {twin['how_checked'].split(':')[0]})")
    else:
        print(f"not the training twin (that is {twin['twin'] or 'no format'}): the FP8 weights differ from the "
              "ones training cast")
    print(f"wrote {args.out}; report: {args.out / SYNC_REPORT_NAME}")
    return 0
