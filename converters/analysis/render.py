"""Human-readable rendering of an analysis report (the CLI's default output)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_analysis", "human_bytes"]


def human_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_analysis(report: dict[str, Any]) -> str:
    """A table of every layer (path, class, shape, parameters, verdict) followed by the totals."""
    rows = [("layer", "class", "in", "out", "params", "fp8", "why not")]
    for layer in report["layers"]:
        rows.append(
            (
                layer["path"],
                layer["class"],
                str(layer["in_features"]),
                str(layer["out_features"]),
                f"{layer['parameters']:,}",
                "yes" if layer["eligible"] else "no",
                ", ".join(layer["reasons"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))

    if report["other_weights"]:
        lines.append("")
        lines.append("matmul weights outside nn.Linear (stay in high precision):")
        for entry in report["other_weights"]:
            shape = "x".join(str(dim) for dim in entry["shape"])
            lines.append(f"  {entry['path']}  {entry['cls']}  [{shape}]  {entry['parameters']:,}  {entry['reason']}")
    partly = [group for group in report["fused_groups"] if group["partly_eligible"]]
    if partly:
        lines.append("")
        lines.append("fused groups only partly eligible (serving exports keep such a group in high precision whole, "
                     "as engines run it as one GEMM; TE and torchao artifacts convert its eligible members):")
        for group in partly:
            lines.append(f"  {group['name']}: {len(group['eligible_members'])}/{len(group['members'])} eligible")

    totals = report["totals"]
    dtype = totals["weight_dtype"]
    lines += [
        "",
        f"model: {report.get('model', {}).get('reference', report['model_class'])}  "
        f"backend: {report['options']['backend']}  rule: {report['rule']}",
        f"Linear layers: {totals['linear_layers']}  eligible: {totals['eligible_layers']}  "
        f"skipped: {totals['skipped_layers']}  Conv1D: {totals['conv1d_layers']}",
        *([f"MoE expert GEMMs: {totals['expert_units']} in {len(report['moe'])} experts modules  eligible: "
           f"{totals['eligible_expert_units']}  FP8 share of expert parameters: "
           f"{totals['fp8_share_of_expert_parameters']:.1%}"] if report.get("moe") else []),
        f"FP8 share of Linear parameters: {totals['fp8_share_of_linear_parameters']:.1%}  "
        f"of all matmul parameters: {totals['fp8_share_of_all_matmul_parameters']:.1%}",
        f"weights: {human_bytes(totals['weight_bytes'])} in {dtype} (the model's dtype) -> "
        f"{human_bytes(totals['weight_bytes_with_fp8'])} with the eligible weights in FP8",
        f"  (a serving export's size; TE and torchao artifacts keep the {dtype} weights, cast to FP8 at run time)",
    ]
    return "\n".join(lines)
