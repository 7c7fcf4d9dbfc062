"""`fp8forge plan`: a per-layer precision plan for a target GPU, measured end to end (docs/plan.md).

One calibration measures every eligible Linear's SQNR under each recipe the GPU runs; the planner
(``converters.plan``) measures each layer's end-to-end contribution, chooses, and measures the whole plan.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from converters.errors import RequestError
from converters.frozen_imports import import_model_stack
from converters.pipeline.request import ConversionRequest
from converters.plan.candidates import plan_compare_recipes
from converters.plan.settings import GPUS, OBJECTIVES, PlanSettings
from service.cli.args import (
    add_calibration_arguments,
    add_selection_arguments,
    add_source_arguments,
    calibration_from_args,
    source_options_from_args,
)
from service.cli.render import BarSink

__all__ = ["register", "run_plan_command", "format_plan"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the ``fp8forge`` parser."""
    plan = subparsers.add_parser(
        "plan", help="choose bf16 or an FP8/FP4 recipe per layer to meet a quality target on a GPU",
        description="Per layer, bf16 or one of the recipes the GPU runs (FP8 current scaling, block FP8, MXFP8, "
                    "NVFP4), chosen to meet the target at the least memory or the most FP8 GEMM FLOPs; the plan is "
                    "then measured end to end next to all-FP8 and all-bf16.")
    plan.add_argument("model", help="org/name[@revision] or a local model directory")
    target = plan.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-kl", type=float, metavar="NATS", help="mean next-token KL budget (nats per token)")
    target.add_argument("--max-ppl-increase", type=float, metavar="POINTS", help="perplexity budget over the source's")
    target.add_argument("--min-sqnr-db", type=float, metavar="DB", help="every planned layer's output SQNR")
    plan.add_argument("--objective", choices=OBJECTIVES, default="memory",
                      help="memory: least weight bytes (default); fp8-flops: most GEMM FLOPs in FP8/FP4")
    plan.add_argument("--gpu", choices=tuple(GPUS), default="h100", help="the GPU the plan is for (default h100)")
    plan.add_argument("--quality-texts", type=Path, metavar="FILE",
                      help="held-out texts, one per paragraph (default: the built-in held-out part)")
    plan.add_argument("--max-tokens", type=int, default=512, help="held-out positions scored (default 512)")
    plan.add_argument("--sensitivity", choices=("auto", "measured", "sqnr"), default="auto",
                      help="each layer's contribution: measured alone per precision, or the all-layers figure per "
                           "precision shared out by SQNR (auto: measured for up to 64 variants)")
    plan.add_argument("--out", type=Path,
                      help="write plan.json and the framework files (plan/) into this new directory")
    add_selection_arguments(plan)
    add_calibration_arguments(plan, backward=False)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_source_arguments(plan)
    plan.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    return run_plan_command(args, source_options_from_args(args))


def _texts(path: Path | None) -> list[str] | None:
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"cannot read --quality-texts {path}: {exc}", field="quality_texts") from exc
    texts = [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]
    if not texts:
        raise RequestError(f"--quality-texts {path} holds no text", field="quality_texts")
    return texts


def run_plan_command(args: argparse.Namespace, sources: Any) -> int:
    settings = PlanSettings(target_kl=args.target_kl, max_ppl_increase=args.max_ppl_increase,
                            min_sqnr_db=args.min_sqnr_db, objective=args.objective, gpu=args.gpu)
    if args.backend == "ao":
        raise RequestError("--backend ao: a plan chooses among TransformerEngine's stateless recipes (torchao's "
                           "configs are written for it in plan/torchao_fqn_to_config.json); drop --backend",
                           field="backend")
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be >= 1, got {args.max_tokens}", field="max_tokens")
    if args.out is not None and args.out.exists():
        raise RequestError(f"--out {args.out} already exists; choose a new directory", field="out")
    texts = _texts(args.quality_texts)
    request = ConversionRequest(model=args.model, recipe={"backend": "te", "scaling": "current"},
                                calibration=calibration_from_args(args), include=tuple(args.include),
                                exclude=tuple(args.exclude), skip_first_last=not args.no_skip_first_last,
                                compare_recipes=plan_compare_recipes(settings.to_dict()))
    import_model_stack()  # once the flags are checked
    from converters.pipeline.sync_analysis import calibrated_analysis  # imports torch: only when a plan is made
    from converters.plan.emit import write_plan_files  # imports torchao: only when a plan is written
    from converters.plan.planner import make_plan  # imports torch: only when a plan is made

    sink = BarSink(enabled=not args.no_progress)
    try:
        report = calibrated_analysis(request, sources, sink=sink)
    finally:
        sink.close()
    plan = make_plan(report, args.model, settings, sources, quality_texts=texts, max_tokens=args.max_tokens,
                     sensitivity=args.sensitivity)
    if args.out is not None:
        args.out.mkdir(parents=True)
        files, notes = write_plan_files(plan, args.out, report.get("model", {}).get("model_type"))
        plan = {**plan, "files": files, "not_expressible": notes}
        (args.out / "plan.json").write_text(json.dumps(plan, indent=1), encoding="utf-8")
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


def _figures(name: str, figures: dict[str, Any]) -> str:
    return (f"{name:<9} perplexity {figures['perplexity']:.4f}  KL mean {figures['kl_mean']:.3g}  "
            f"max {figures['kl_max']:.3g}  top-1 {figures['top1_agreement']:.3f}")


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text: one line per Linear, the totals, the measured figures next to all-FP8 and all-bf16."""
    width = max(len(row["path"]) for row in plan["layers"])
    lines = [f"plan for {plan['gpu']['name']} ({', '.join(plan['gpu']['precisions'])}), target "
             f"{plan['target']['name']} {plan['target']['value']:g}, objective {plan['objective']}", ""]
    lines += [f"{row['path']:<{width}}  {row['precision']:<11}  {row['why']}" for row in plan["layers"]]
    totals, measured = plan["totals"], plan["measured"]
    lines += ["", f"weights {totals['weight_bytes']:,} bytes of {totals['weight_bytes_bf16']:,} in bf16 "
              f"({totals['memory_ratio']:.3f}); FP8/FP4 share of GEMM FLOPs {totals['fp8_gemm_flop_share']:.3f}; "
              + ", ".join(f"{n} {p}" for p, n in totals["layers_per_precision"].items()),
              f"measured on {measured['plan']['tokens']} held-out tokens ({measured['plan']['held_out']}), "
              f"target met: {plan['target']['met']}",
              _figures("plan", measured["plan"]), _figures("all-fp8", measured["all_fp8"]),
              _figures("all-bf16", measured["all_bf16"])]
    if plan.get("files"):
        lines.append("wrote " + ", ".join(plan["files"]))
    return "\n".join(lines)
