"""`fp8forge convert`: run the conversion pipeline with a progress bar per stage and a closing summary."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_convert_command", "request_from_args", "recipe_file", "recipe_file_warned"]


class BarSink:
    """Draws one tqdm bar per pipeline stage on stderr; warnings are printed as they come."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.warnings: list[str] = []

    def stage(self, name: str) -> None:
        self._close()
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=1, desc=f"{name:<9}", unit="step", file=sys.stderr, leave=True)

    def progress(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def warning(self, message: str) -> None:
        from service.cli.wording import in_cli_words

        self.warnings.append(message)
        line = f"warning: {in_cli_words(message)}"
        if self.bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)  # above the open bar, not through it
        else:
            print(line, file=sys.stderr)

    def should_stop(self) -> bool:
        return False

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    close = _close


def recipe_file(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A recipe file as the request's recipe object, and the warnings only the file can give.

    An Accelerate config's keys that do not apply (the delayed-scaling keys beside ``use_mxfp8_block_scaling``)
    are dropped from the recorded recipe, so the pipeline, which sees only that object, cannot name them.
    """
    from converters.recipes import load_recipe_file, recipe_from_dict

    parsed = load_recipe_file(path)
    recipe = parsed.to_dict()
    recorded = set(recipe_from_dict(recipe).warnings())
    dropped = getattr(parsed, "accelerate_ignored", ())
    if dropped:  # one line for the lot, rather than one per key
        return recipe, [f"{path}: use_mxfp8_block_scaling drops {', '.join(dropped)}: delayed-scaling keys that "
                        f"{parsed.library_class} has no use for (Accelerate drops them too); they are not recorded"]
    return recipe, [f"{path}: {note}" for note in parsed.warnings() if note not in recorded]


def recipe_file_warned(path: Path) -> dict[str, Any]:
    """:func:`recipe_file` for the commands that write no report: its warnings go to stderr now."""
    recipe, notes = recipe_file(path)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return recipe


def request_from_args(args: argparse.Namespace):
    """Build the ConversionRequest from CLI flags (recipe file, backend, calibration, selection), and the recipe
    file's own warnings (see :func:`recipe_file`)."""
    from converters.errors import RecipeError
    from converters.requests import ConversionRequest
    from service.cli.compare import calibration_from_args

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
    ), notes


def _make_parents(out: Path) -> list[Path]:
    """Create the missing parents of ``out``, outermost first; returns the ones created.

    Raises:
        Fp8ForgeError (bad input, ``--out``): a parent cannot be created (a file in the way, no permission).
    """
    from converters.errors import Fp8ForgeError

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

    from converters.pipeline import run_conversion
    from converters.report_format import human_bytes
    from service.cli.compare import format_worst_layers

    request, notes = request_from_args(args)
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
    print(format_worst_layers(json.loads(result.report_path.read_text(encoding="utf-8"))["analysis"]))
    if sink.warnings:
        print(f"{len(sink.warnings)} warning(s); see fp8_report.json")
    return 0
