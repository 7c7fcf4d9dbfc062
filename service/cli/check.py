"""`fp8forge check ARTIFACT`: is FP8 on? One training step of a training artifact, reported per Linear.

Exit status 0 when every Linear ran as the artifact says, 1 when one did not (each named), 2 for bad input (not an
artifact, a failed manifest). torch, torchao and TE load only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from converters.errors import RequestError
from converters.frozen_imports import import_model_stack

__all__ = ["register", "run_check"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``check`` to the ``fp8forge`` parser."""
    check = subparsers.add_parser(
        "check", help="run one training step of an artifact and report, per Linear, whether its GEMMs ran in FP8",
        description="Load a TE or torchao training artifact as load_te()/load_torchao() do, run one forward and "
                    "backward step, and report per Linear how its GEMMs ran (FP8, FP8 emulated on CPU, emulated, or "
                    "high precision), the active recipe, and the loss next to the high-precision model's. A layer "
                    "the artifact says is FP8 that ran in high precision is an error, named; the exit status is 1.")
    check.add_argument("artifact", type=Path, help="the artifact directory (written by fp8forge convert)")
    check.add_argument("--device", default=None,
                       help="where to run the step (default: cuda for TE artifacts, cpu for torchao ones)")
    check.add_argument("--no-verify", action="store_true", help="skip the manifest's checksums")
    check.add_argument("--seq-len", type=int, default=32, help="tokens per row of the step's batch (default 32)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    if args.seq_len < 1:
        raise RequestError(f"--seq-len must be a positive number of tokens, got {args.seq_len}", field="seq_len")
    import_model_stack()
    from converters.backends.probe import format_probe, probe_artifact  # torch, torchao: only when the command runs

    report = probe_artifact(args.artifact, device=args.device, verify=not args.no_verify, seq_len=args.seq_len)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_probe(report))
    if not report.ok:
        print(f"fp8forge check: {len(report.errors)} layer(s) did not run as the artifact says", file=sys.stderr)
    return 0 if report.ok else 1
