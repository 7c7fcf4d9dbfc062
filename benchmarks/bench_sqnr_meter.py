"""The SQNR meter's own cost on one decoder layer, next to that layer's Linear forwards on the same calls.

What is measured: one Llama decoder layer's seven Linears (q, k, v, o, gate, up, down) with random bf16 weights
of the given width, called `--steps` times on `--batch-size` x `--seq-len` bf16 inputs, as a layer-sequential
calibration calls them. Three figures per round, each the fastest of `--rounds` interleaved rounds (on a shared
VM a single run moves by 10 to 30%):
  forward   the seven Linears' forward for every call (the GEMMs the calibration runs anyway)
  calls     the meter's per-call work for the same calls (SqnrMeter.input_rows and observe: row amax, sampling,
            gathering the sampled rows and outputs, delayed scaling's history)
  flush     the meter's per-layer work (SqnrMeter.flush: the weight and the gathered rows cast, the emulated
            FP8 GEMM, the sums)
and the ratios (calls + flush) / forward overall and per part. The meter is the job's (sensitivity.meter_for,
`--recipe`, no cached weight casts, the job's row budget for `--steps`).

Run:
  .venv/bin/python benchmarks/bench_sqnr_meter.py                       # SmolLM2-135M's width, 16 steps, TE
  .venv/bin/python benchmarks/bench_sqnr_meter.py --hidden 2048 --intermediate 8192 --kv 512 --steps 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converters.calibration.sensitivity import meter_for  # noqa: E402
from converters.recipes import recipe_from_dict  # noqa: E402


def layer_linears(hidden: int, intermediate: int, kv: int) -> list[tuple[str, torch.Tensor, str]]:
    """(name, weight, input) per Linear; the input names which activation it reads (q/k/v and gate/up share)."""
    generator = torch.Generator().manual_seed(0)

    def weight(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=generator) * inp ** -0.5).bfloat16()

    return [("q", weight(hidden, hidden), "normed"), ("k", weight(kv, hidden), "normed"),
            ("v", weight(kv, hidden), "normed"), ("o", weight(hidden, hidden), "attention"),
            ("gate", weight(intermediate, hidden), "normed2"), ("up", weight(intermediate, hidden), "normed2"),
            ("down", weight(hidden, intermediate), "product")]


def calls(args: argparse.Namespace, linears: list) -> list[dict[str, torch.Tensor]]:
    """Per step, each distinct input of the layer (outlier tokens at each sequence's start, as trained models have)."""
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        inputs = {}
        for _, weight, source in linears:
            if source not in inputs:
                x = torch.randn(args.batch_size, args.seq_len, weight.shape[1], generator=generator)
                x[:, 0] *= 30
                inputs[source] = x.bfloat16()
        steps.append(inputs)
    return steps


def one_round(args: argparse.Namespace, linears: list, steps: list) -> dict[str, float]:
    meter, _ = meter_for(recipe_from_dict({"backend": args.recipe}))
    meter.expect_steps(args.steps)
    forward = measured = 0.0
    with torch.no_grad():
        for step, inputs in enumerate(steps):
            for name, weight, source in linears:
                x = inputs[source]
                started = time.perf_counter()
                output = torch.nn.functional.linear(x, weight)
                between = time.perf_counter()
                meter.input_rows(x, weight.shape[1], step)
                meter.observe(name, step, x, weight, None, output)
                forward += between - started
                measured += time.perf_counter() - between
        started = time.perf_counter()
        meter.flush()
        flushed = time.perf_counter() - started
    return {"forward": forward, "calls": measured, "flush": flushed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="k and v projections' output width")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--recipe", choices=("te", "ao"), default="te", help="the job's backend (default recipe)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    linears = layer_linears(args.hidden, args.intermediate, args.kv)
    steps = calls(args, linears)
    one_round(args, linears, steps)  # warm-up: first-call allocations and imports
    rounds = [one_round(args, linears, steps) for _ in range(args.rounds)]
    best = {part: min(r[part] for r in rounds) for part in ("forward", "calls", "flush")}
    print(f"one layer (hidden {args.hidden}, intermediate {args.intermediate}, kv {args.kv}), {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens, {args.recipe} recipe, torch threads {torch.get_num_threads()}, "
          f"fastest of {args.rounds} rounds:")
    for part in ("forward", "calls", "flush"):
        print(f"  {part:8s} {best[part] * 1e3:8.1f} ms")
    calls_per_step = len(linears)
    print(f"  per Linear call: forward {best['forward'] / (args.steps * calls_per_step) * 1e6:.0f} us, "
          f"meter {best['calls'] / (args.steps * calls_per_step) * 1e6:.0f} us")
    print(f"  meter / forward: calls {best['calls'] / best['forward']:.2f}, "
          f"flush {best['flush'] / best['forward']:.2f}, "
          f"together {(best['calls'] + best['flush']) / best['forward']:.2f}")


if __name__ == "__main__":
    main()
