"""`fp8forge compare` and `fp8forge analyze --calibrate`: per-layer quantization error (SQNR) under recipes.

One calibration feeds every recipe: the table shows, per eligible layer, the SQNR each recipe's casts leave
(``converters.sensitivity``), so a recipe can be picked before training. Only argparse is imported at start-up.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from pathlib import Path
from typing import Any

__all__ = [
    "register",
    "add_calibration_arguments",
    "add_min_sqnr_argument",
    "calibration_from_args",
    "run_compare_command",
    "run_calibrated_analyze",
    "format_comparison",
    "format_sqnr_layers",
    "format_worst_layers",
]

_METRICS = ("output", "input", "weight")
#: what the comparison tables fit into unless --width says otherwise (a terminal's 80 leaves too few recipes)
DEFAULT_WIDTH = 100


def add_calibration_arguments(parser: argparse.ArgumentParser, *, backward: bool = True) -> None:
    parser.add_argument("--calib-steps", type=int, default=None, help="calibration steps (default 16)")
    parser.add_argument("--calib-batch-size", type=int, default=None, help="sequences per step (default 2)")
    parser.add_argument("--calib-seq-len", type=int, default=None, help="tokens per sequence (default 128)")
    parser.add_argument("--calib-texts", type=Path, help="text file, one calibration sample per paragraph")
    if backward:
        parser.add_argument("--calib-backward", action="store_true", help="also record gradient amax")


def _sqnr_threshold(text: str) -> float:
    from converters.requests import MIN_SQNR_DB_RANGE

    low, high = MIN_SQNR_DB_RANGE
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of dB: {text!r}") from None
    if not low <= value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g} dB, got {text}")
    return value


def add_min_sqnr_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--min-sqnr-db", type=_sqnr_threshold, default=None, metavar="DB",
                        help=f"{what} every layer whose output SQNR under the recipe is below DB (reason low_sqnr)")


def _read_texts(path: Path) -> list[str]:
    from converters.errors import CalibrationDataError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"cannot read --calib-texts {path}: {exc}", field="calib_texts") from exc
    return [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]


def calibration_from_args(args: argparse.Namespace):
    """``CalibrationSettings`` from the ``--calib-*`` flags (library defaults for those not given)."""
    from converters.requests import CalibrationSettings

    defaults = CalibrationSettings()
    return CalibrationSettings(
        steps=args.calib_steps if args.calib_steps is not None else defaults.steps,
        batch_size=args.calib_batch_size if args.calib_batch_size is not None else defaults.batch_size,
        seq_len=args.calib_seq_len if args.calib_seq_len is not None else defaults.seq_len,
        texts=tuple(_read_texts(args.calib_texts)) if args.calib_texts else None,
        backward=getattr(args, "calib_backward", False),
    )


def register(subparsers: argparse._SubParsersAction, add_selection, add_sources) -> None:
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
    compare.add_argument("--metric", choices=(*_METRICS, "all"), default="output",
                         help="which SQNR to tabulate (default output)")
    add_selection(compare)
    add_calibration_arguments(compare, backward=False)
    add_min_sqnr_argument(compare, "flag")
    compare.add_argument("--width", type=int, default=DEFAULT_WIDTH, metavar="COLUMNS",
                         help="fit the tables into COLUMNS characters, continuing with the recipes that do not fit in "
                              "a further table (default %(default)s; 0: one table however wide)")
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    compare.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_sources(compare)
    compare.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from service.cli.main import source_options_from_args

    return run_compare_command(args, source_options_from_args(args))


def _compare_entries(args: argparse.Namespace) -> tuple[list[Any], list[str | None]]:
    """The recipes to compare as request entries (names or recipe dicts) and their labels."""
    from converters.errors import RecipeError
    from converters.sensitivity import RECIPE_NAMES
    from service.cli.convert import recipe_file_warned

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
    from converters.requests import ConversionRequest

    return ConversionRequest(model=args.model, recipe=recipe, calibration=calibration_from_args(args),
                             include=tuple(args.include), exclude=tuple(args.exclude),
                             skip_first_last=not args.no_skip_first_last,
                             convert_router_gates=args.convert_router_gates,
                             min_sqnr_db=args.min_sqnr_db, compare_recipes=tuple(compare))


def _analysis_with_bars(request, sources, enabled: bool) -> dict[str, Any]:
    from converters.sync_analysis import calibrated_analysis
    from service.cli.convert import BarSink

    sink = BarSink(enabled=enabled)
    try:
        return calibrated_analysis(request, sources, sink=sink)
    finally:
        sink.close()


def run_compare_command(args: argparse.Namespace, sources) -> int:
    import json

    from converters.sensitivity import relabel_comparison

    entries, labels = _compare_entries(args)
    report = _analysis_with_bars(_request(args, {"backend": args.backend or "te"}, entries), sources,
                                 not args.no_progress)
    relabel_comparison(report, labels)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    metrics = _METRICS if args.metric == "all" else (args.metric,)
    print("\n\n".join(format_comparison(report, metric, max(args.width, 0)) for metric in metrics))
    return 0


def run_calibrated_analyze(args: argparse.Namespace, sources) -> int:
    """``fp8forge analyze --calibrate``: the analysis table, then each calibrated layer's SQNR under the recipe."""
    import json

    from converters.report_format import format_analysis
    from service.cli.convert import recipe_file_warned

    recipe = recipe_file_warned(args.recipe) if args.recipe else {"backend": args.backend or "te"}
    report = _analysis_with_bars(_request(args, recipe), sources, not args.no_progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_analysis(report))
        print()
        print(format_sqnr_layers(report))
    return 0


def _cell(value: float | None, threshold: float | None = None) -> str:
    if value is None:
        return "-"
    mark = "!" if threshold is not None and value < threshold else ""
    return f"{value:.1f}{mark}"


def _table(rows: list[list[str]], right_from: int = 1) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) if i >= right_from else cell.ljust(width)
                       for i, (cell, width) in enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def _chunks(widths: list[int], width: int) -> list[list[int]]:
    """Value columns (indices 1..) grouped so that each group beside column 0 fits ``width`` (0: one group)."""
    groups: list[list[int]] = [[]]
    used = widths[0]
    for index in range(1, len(widths)):
        if width and groups[-1] and used + 2 + widths[index] > width:
            groups.append([])
            used = widths[0]
        groups[-1].append(index)
        used += 2 + widths[index]
    return groups


def format_comparison(report: dict[str, Any], metric: str = "output", width: int = DEFAULT_WIDTH) -> str:
    """The comparison table: one row per measured layer, one column per recipe, ``metric`` SQNR in dB.

    Values below the report's ``min_sqnr_db`` carry ``!``; the last rows give each recipe's minimum and median.
    Recipes that do not fit ``width`` columns beside the layer paths go to a further table below (0: one table).
    """
    comparison = report["comparison"]
    labels = [recipe["label"] for recipe in comparison["recipes"]]
    threshold = report["sensitivity"]["min_sqnr_db"]
    rows = [["layer", *labels]]
    columns: dict[str, list[float]] = {label: [] for label in labels}
    for row in comparison["layers"]:
        values = [row["sqnr_db"][label][metric] for label in labels]
        rows.append([row["path"], *(_cell(value, threshold) for value in values)])
        for label, value in zip(labels, values, strict=True):
            if value is not None:
                columns[label].append(value)
    lines = [f"{metric} SQNR (dB) per layer, one calibration "
             f"({_calibration_words(report)}); higher is better", ""]
    summary = [["min", *(_cell(min(columns[label]) if columns[label] else None) for label in labels)],
               ["median", *(_cell(statistics.median(columns[label]) if columns[label] else None) for label in labels)]]
    if threshold is not None:
        summary.append([f"below {threshold:g}", *(str(sum(1 for v in columns[label] if v < threshold))
                                                  for label in labels)])
    everything = rows + summary
    for number, group in enumerate(_chunks([max(len(row[i]) for row in everything) for i in range(len(rows[0]))],
                                           width)):
        table = _table([[row[0], *(row[i] for i in group)] for row in everything])
        lines += [""] * (number > 0) + table[: len(rows) + 1] + [table[1]] + table[len(rows) + 1:]
    lines.append("")
    for recipe in comparison["recipes"]:
        note = f"; not emulated: {'; '.join(recipe['not_emulated'])}" if recipe["not_emulated"] else ""
        text = (f"{recipe['label']}: weight {recipe['weight_format']}, input {recipe['input_format']}"
                f"{', delayed scaling' if recipe['delayed'] else ''}{note}")
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ") if width else ["  " + text]
    return "\n".join(lines)


def _calibration_words(report: dict[str, Any]) -> str:
    calibration = report.get("calibration", {})
    if not calibration:
        return "calibration"
    return f"{calibration['steps']} steps of {calibration['batch_size']} x {calibration['seq_len']} tokens"


def format_sqnr_layers(report: dict[str, Any]) -> str:
    """Each measured layer's weight / input / output SQNR under the report's recipe, and whether it stays FP8."""
    sensitivity = report["sensitivity"]
    recipe = sensitivity["recipe"]
    threshold = sensitivity["min_sqnr_db"]
    rows = [["layer", "weight", "input", "output", "fp8"]]
    for layer in report["layers"]:
        if "sqnr_db" in layer:
            sqnr = layer["sqnr_db"]
            rows.append([layer["path"], _cell(sqnr["weight"]), _cell(sqnr["input"]),
                         _cell(sqnr["output"], threshold), "yes" if layer["eligible"] else "no (low_sqnr)"])
    lines = [f"SQNR (dB) under {recipe['label']} (weight {recipe['weight_format']}, input {recipe['input_format']}; "
             f"{_calibration_words(report)}):", *_table(rows)]
    if threshold is not None:
        lines.append(f"min_sqnr_db {threshold:g}: {len(sensitivity['excluded'])} layer(s) would stay in high precision")
    return "\n".join(lines)


def format_worst_layers(report: dict[str, Any], count: int = 5) -> str:
    """The ``count`` layers with the lowest output SQNR under the recipe (what ``fp8forge convert`` prints)."""
    sensitivity = report.get("sensitivity")
    measured = [layer for layer in report["layers"]
                if (layer.get("sqnr_db") or {}).get("output") is not None]
    if not sensitivity or not measured:
        return "no layer's SQNR was measured"
    measured.sort(key=lambda layer: layer["sqnr_db"]["output"])
    rows = [["layer", "weight", "input", "output"]]
    rows += [[layer["path"], _cell(layer["sqnr_db"]["weight"]), _cell(layer["sqnr_db"]["input"]),
              _cell(layer["sqnr_db"]["output"])] for layer in measured[:count]]
    head = f"lowest output SQNR under {sensitivity['recipe']['label']} (dB):"
    lines = [head, *("  " + line for line in _table(rows))]
    if sensitivity["min_sqnr_db"] is not None:
        lines.append(f"kept in high precision (output SQNR below {sensitivity['min_sqnr_db']:g} dB): "
                     f"{len(sensitivity['excluded'])} layer(s)" + (
                         f": {', '.join(sensitivity['excluded'])}" if sensitivity["excluded"] else ""))
    return "\n".join(lines)

