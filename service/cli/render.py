"""What the ``fp8forge`` commands print: progress bars per pipeline stage, SQNR tables."""

from __future__ import annotations

import statistics
import sys
import textwrap
from typing import Any

from converters.pipeline.progress import Unit, progress_event
from service.cli.wording import in_cli_words

__all__ = ["BarSink", "METRICS", "DEFAULT_WIDTH", "format_comparison", "format_serving_exports", "format_sqnr_layers",
           "format_worst_layers"]

METRICS = ("output", "input", "weight")
#: what the comparison tables fit into unless --width says otherwise (a terminal's 80 leaves too few recipes)
DEFAULT_WIDTH = 100
#: a stage's bar: the progress event's words first (what the API's events say), then the bar and the time spent
_BAR_FORMAT = "{desc}  {percentage:3.0f}%|{bar:20}| {elapsed}"


class BarSink:
    """Draws one tqdm bar per pipeline stage on stderr, worded as the API's progress events are (``text``:
    :func:`converters.pipeline.progress.progress_event`); warnings are printed as they come."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.stage_name = ""
        self.warnings: list[str] = []

    def stage(self, name: str) -> None:
        self._close()
        self.stage_name = name
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=1, desc=f"{name}:", bar_format=_BAR_FORMAT, file=sys.stderr, leave=True)

    def progress(self, done: int, total: int, unit: Unit | str = Unit.STEP, **detail: Any) -> None:
        if self.bar is not None:
            self.bar.total = max(total, 1)
            self.bar.n = done
            self.bar.set_description_str(progress_event(self.stage_name, done, total, unit, **detail)["text"],
                                         refresh=False)
            self.bar.refresh()

    def warning(self, message: str) -> None:
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
        rows.append([row["path"], *("excl" if "excluded" in row["sqnr_db"][label] else _cell(value, threshold)
                                    for label, value in zip(labels, values, strict=True))])
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
        lines += _wrapped(text, width)
    return "\n".join(lines + _comparison_notes(comparison, width) + _comparison_quality(report, width))


def _wrapped(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ") if width else ["  " + text]


def _comparison_notes(comparison: dict[str, Any], width: int) -> list[str]:
    """What the ``excl`` cells mean, per recipe; and which recipes measured alike, and why."""
    lines = []
    excluded = [(recipe["label"], recipe.get("excluded", {})) for recipe in comparison["recipes"]]
    if any(paths for _, paths in excluded):
        header = ("excl: kept in high precision by the recipe's shape rule (the analysis's reason), so not measured "
                  "and not in its end-to-end figures:")
        lines += ["", *(textwrap.wrap(header, width) if width else [header])]
        for label, paths in excluded:
            for reason in sorted(set(paths.values())):
                count = sum(1 for value in paths.values() if value == reason)
                lines += _wrapped(f"{label}: {count} layers {reason}", width)
    for group in comparison.get("identical", []):
        lines += ["", *_wrapped(f"{', '.join(group['labels'])}: the same figures on every layer: {group['why']}",
                                width)]
    return lines


def _comparison_quality(report: dict[str, Any], width: int) -> list[str]:
    """The end-to-end quality per compared recipe (perplexity, KL, top-1 agreement), or why it is missing."""
    quality = report.get("quality")
    if not quality:
        return []
    def wrapped(text: str) -> list[str]:
        return textwrap.wrap(text, width) if width else [text]

    if not quality["measured"]:
        return ["", *wrapped(f"end-to-end quality not measured: {quality['reason']}")]
    held = quality["held_out"]
    rows = [["recipe", "perplexity", "kl_mean", "kl_max", "top1_agreement"]]
    for recipe in report["comparison"]["recipes"]:
        figures = recipe.get("quality")
        if figures:
            rows.append([recipe["label"], f"{figures['perplexity']:.3f}", f"{figures['kl_mean']:.4g}",
                         f"{figures['kl_max']:.4g}", f"{figures['top1_agreement']:.3f}"])
    return ["", *wrapped(f"end-to-end quality on {held['tokens']} held-out tokens ({held['source']}; the source's "
                         f"perplexity {quality['reference']['perplexity']:.3f}; KL(source || fp8) in nats per "
                         "token):"), *_table(rows)]


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


def format_serving_exports(report: dict[str, Any]) -> str:
    """One line per serving export: layers quantized, lowest weight SQNR, KV-cache scales, load audit; first, where the
    recipe asked ``nvfp4_smoothing``, what the smoothing did."""
    lines = []
    smoothing = (report.get("calibration") or {}).get("nvfp4_smoothing")
    if smoothing:
        counts = smoothing.get("mappings") or {}
        lines.append(f"nvfp4_smoothing {smoothing['method']}: " + (
            f"{counts.get('smoothed', 0)} mapping(s) smoothed, {counts.get('kept', 0)} kept, "
            f"{counts.get('skipped', 0)} skipped; every export holds the smoothed model"
            if smoothing["applied"] else f"not applied ({smoothing['reason']})"))
    for name, block in (report.get("serving") or {}).items():
        sqnr = [stats["weight_sqnr_db"] for stats in (block.get("layer_stats") or {}).values()
                if stats.get("weight_sqnr_db") is not None]
        audit = block.get("load_audit") or {}
        verdict = "not audited"
        if audit.get("audited"):
            verdict = "ok" if audit.get("ok") else f"{len(audit.get('problems', []))} problem(s)"
        kv = block.get("kv_cache")
        rounded = sum(stats.get("rounding") == "gptq" for stats in (block.get("layer_stats") or {}).values())
        # GPTQ lowers the layers' output error at the weights' expense: say so beside the weight figure (counted in
        # weights: a MoE expert's gate_up unit is two of them, gate and up)
        gptq = f" (GPTQ-rounded: {rounded} weights, below nearest rounding's by design)" if rounded else ""
        lines.append(f"serving/{name}: {len(block['quantized'])} layers quantized"
                     + (f", lowest weight SQNR {min(sqnr):.1f} dB{gptq}" if sqnr else "")
                     + (f", KV-cache scales for {len(kv['layers'])} attention layers" if kv else "")
                     + f", load audit {verdict}")
    return "\n".join(lines)


def format_quality(report: dict[str, Any]) -> str:
    """The job's end-to-end quality: the training artifact and each serving export against the source."""
    quality = report.get("quality")
    if not quality:
        return ""
    if not quality["measured"]:
        return f"end-to-end quality not measured: {quality['reason']}"
    smoothing = (report.get("calibration") or {}).get("nvfp4_smoothing") or {}
    source = "source (smoothed)" if smoothing.get("changed_tensors") else "source"  # what the job converted
    rows = [["", "perplexity", "kl_mean", "kl_max", "top1_agreement"],
            [source, f"{quality['reference']['perplexity']:.3f}", "", "", ""]]
    serving = [(f"serving/{name}", figures) for name, figures in quality["serving"].items()]
    # an export with an FP8 KV cache: its figures without it too, the FP8 KV cache's own cost
    serving = [row for name, figures in serving for row in [(name, figures)] + (
        [(f"{name} without FP8 KV", figures["kv_cache"]["without_fp8_kv"])] if "kv_cache" in figures else [])]
    for name, figures in [("training (emulated)", quality["training"]), *serving]:
        rows.append([name, f"{figures['perplexity']:.3f}", f"{figures['kl_mean']:.4g}", f"{figures['kl_max']:.4g}",
                     f"{figures['top1_agreement']:.3f}"])
    held = quality["held_out"]
    return "\n".join([f"end-to-end quality on {held['tokens']} held-out tokens ({held['source']}):", *_table(rows)])
