"""The command every rank of a data-parallel conversion runs (docs/distributed.md)::

    python -m converters.distributed --request REQUEST.json --out DIR [--allow-root DIR]... [--offline]
                                     [--resume-dir DIR | --no-resume]

with the launcher's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment (torchrun, srun).
REQUEST.json holds a conversion request as the service stores it (``ConversionRequest.to_dict``). Rank 0 prints one
JSON line when the artifact is published. Exit codes: 0 done, 2 bad input (one line on stderr naming what to fix),
1 any other failure (a lost rank among them: restart the same command to resume).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from converters.frozen_imports import import_model_stack, imports_frozen

with imports_frozen():  # the rank's own collections skip what it imports: the model stack and the rank's modules
    import_model_stack()
    from converters.distributed.entry import run_ranked_conversion
    from converters.distributed.ranks import rank_from_environment
    from converters.errors import Fp8ForgeError
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.request import ConversionRequest


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m converters.distributed",
                                     description="run one rank of a data-parallel, resumable conversion")
    parser.add_argument("--request", type=Path, required=True, help="the conversion request, as JSON")
    parser.add_argument("--out", type=Path, required=True, help="the artifact directory to publish (must not exist)")
    parser.add_argument("--allow-root", type=Path, action="append", default=[],
                        help="a directory below which local models are accepted (default: the current directory)")
    parser.add_argument("--offline", action="store_true", help="use the hub cache alone")
    parser.add_argument("--resume-dir", type=Path, default=None,
                        help="where the per-layer resume record lives (default: .<out name>.resume beside --out)")
    parser.add_argument("--no-resume", action="store_true", help="keep no per-layer resume record")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        info = rank_from_environment()
        try:
            body = json.loads(args.request.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Fp8ForgeError(f"--request {args.request}: cannot read a JSON request ({exc}); write the job's "
                                "request (ConversionRequest.to_dict) there", field="request") from None
        sources = ModelSourceOptions(allowed_roots=tuple(args.allow_root) or (Path.cwd(),), offline=args.offline,
                                     reveal_roots=True)
        result = run_ranked_conversion(ConversionRequest.from_dict(body), args.out, sources, info=info,
                                       resume_dir=args.resume_dir, resume=not args.no_resume)
    except Fp8ForgeError as exc:
        print(f"rank {_rank_name()}: {exc}", file=sys.stderr)
        return 2 if exc.is_bad_input else 1
    if result is not None:
        print(json.dumps({"out": str(result.out_dir), "ranks": info.world_size, "files": len(result.files)}))
    return 0


def _rank_name() -> str:
    try:
        info = rank_from_environment()
    except Fp8ForgeError:
        return "?"
    return f"{info.rank}/{info.world_size}"


if __name__ == "__main__":
    sys.exit(main())
