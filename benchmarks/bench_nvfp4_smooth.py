"""NVFP4 W4A4 on the real SmolLM2-135M with activation-aware per-channel smoothing (AWQ's scale search) before
the job: does moving each input channel's magnitude between the activation and the weight lower the loss that
round to nearest and GPTQ leave?

What runs: the same conversion jobs with and without the recipe's ``nvfp4_smoothing: awq``: round to nearest, and
``nvfp4_weight_scales: four_over_six`` + ``nvfp4_weight_rounding: gptq`` (the product's best W4A4 path). With
smoothing, the job's layer walk (converters.pipeline.source_smoothing) searches each mapping of a decoder layer
(input norm -> q/k/v, post-attention norm -> gate/up, up -> down; v -> o only where the shapes match, not in a GQA
model such as this one) by AWQ's ratio search scored by the group's W4A4 output error, folds the scales into the
norm or up's rows, and converts the smoothed model (its calibration, GPTQ and input global scales read it); the
report's ``calibration.nvfp4_smoothing`` block lists each mapping.
Scoring: bench_nvfp4.perplexity on the source model with each export's Linears read back and their inputs cast as
the W4A4 kernels cast them; a smoothed export's changed norms (the job's artifact holds the smoothed model) replace
the source's, as an engine loads them. The row "smoothed model (bf16)" is the smoothed job's artifact weights
unquantized: the reference the job's report measures its exports against, next to the source's own bf16 row.
``--engine``: every export (and the bf16 source) also scored by vLLM's CPU build on the same windows, with vLLM's
own NVFP4 emulation kernel (registered for the CPU by tests/engines/vllm_driver.py, docs/engines.md).
``--peer``: llm-compressor 0.14's NVFP4 RTN export (bench_nvfp4.peer_export, its own venv) on the same token rows,
and every row against it; otherwise against the source's own RTN export (byte-identical weights to llm-compressor
RTN's, bench_nvfp4). With bench_nvfp4's 5-95% interval over the held-out windows. Figures only, nothing asserted.

Run:  .venv/bin/python benchmarks/bench_nvfp4_smooth.py [--steps 24] [--tokens 4096]
      [--held-out-file benchmarks/data/held_out_extra.txt] [--held-out-package-prose] [--peer] [--engine]
      [--weight-only] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from bench_nvfp4 import (  # noqa: E402
    fp8forge_export,
    held_out_windows,
    job_batches,
    loss_ratio_interval,
    peer_export,
    perplexity,
    read_export,
    write_calibration_rows,
)
from bench_serving import DEFAULT_PEER_VENV  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def engine_rows(work: Path, exports: dict[str, Path], ids: torch.Tensor, scores: dict[str, float]) -> None:
    """Each export scored by vLLM's CPU build on the same windows (its own NVFP4 emulation kernel, which casts the
    inputs per 16-block under the file's input global scale as the W4A4 kernels do: tests/engines), beside the
    emulated forward's perplexity above."""
    from tests.engines.engine import EngineRequest, run_vllm, vllm_missing

    missing = vllm_missing()
    if missing is not None:
        print(f"\nvLLM not run: {missing}")
        return
    started = time.perf_counter()
    runs = run_vllm([EngineRequest(model=path, score=ids.tolist(), dump=False) for path in exports.values()],
                    work / "vllm")
    print(f"\nvLLM's CPU build, {time.perf_counter() - started:.0f} s:\n\n| export (W4A4) | vLLM perplexity | "
          "loss vs bf16 in vLLM | the emulated forward's | vLLM / emulated |\n|---|---:|---:|---:|---:|")
    engine = dict(zip(exports, runs, strict=True))
    base = engine["bf16"].perplexity
    for name, run in engine.items():
        if run.error is not None:
            print(f"| {name} | {run.error[-200:]} | | | |")
            continue
        print(f"| {name} | {run.perplexity:.3f} | {run.perplexity / base - 1:+.2%} | {scores[name]:.3f} | "
              f"{run.perplexity / scores[name]:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="calibration windows of 128 tokens (default 24)")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored (default 4096)")
    parser.add_argument("--held-out-file", type=Path, action="append", default=[],
                        help="more held-out text (paragraphs separated by blank lines); repeatable")
    parser.add_argument("--held-out-package-prose", action="store_true",
                        help="also score the installed packages' descriptions (bench_nvfp4.package_prose)")
    parser.add_argument("--peer", action="store_true",
                        help="also llm-compressor's NVFP4 RTN export on the same token rows (its own venv)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--weight-only", action="store_true",
                        help="score the exports' weights with bf16 inputs (as nvfp4-a16 runs; the same codes as the "
                             "W4A4 export's) instead of W4A4; the smoothing is still searched for W4A4")
    parser.add_argument("--engine", action="store_true",
                        help="also score every export in vLLM's CPU build (`make vllm-venv`; VLLM_VENV elsewhere)")
    parser.add_argument("--keep", type=Path, help="write the exports here and keep them (reused when present)")
    args = parser.parse_args()
    if args.engine and args.weight_only:
        parser.error("--engine runs the W4A4 exports in vLLM: leave out --weight-only (or run the two separately)")

    from transformers import AutoModelForCausalLM

    from tests.converters.quality.smollm import smollm_dir

    model_dir = smollm_dir()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_nvfp4_smooth-"))
    work.mkdir(parents=True, exist_ok=True)
    batches, data_source = job_batches(model_dir, args.steps)
    print(f"SmolLM2-135M-Instruct ({model_dir}); calibration: {data_source}")

    source = load_file(model_dir / "model.safetensors")
    jobs = {"rtn": {}, "gptq four_over_six": {"nvfp4_weight_scales": "four_over_six",
                                              "nvfp4_weight_rounding": "gptq"}}
    variants: dict[str, tuple[dict | None, dict | None]] = {"bf16": (None, None)}
    exports: dict[str, Path] = {"bf16": model_dir}  #: what vLLM loads for each row (--engine)
    for smoothed in (False, True):
        for name, recipe in jobs.items():
            out = work / f"{'smoothed' if smoothed else 'source'}-{name.replace(' ', '-')}"
            if not (out / "serving" / "nvfp4" / "config.json").is_file():
                started = time.perf_counter()
                shutil.rmtree(out, ignore_errors=True)
                smoothing = {"nvfp4_smoothing": "awq"} if smoothed else {}
                fp8forge_export(model_dir, out, args.steps, **recipe, **smoothing)
                print(f"job {'smoothed' if smoothed else 'source'} {name}: {time.perf_counter() - started:.0f} s",
                      flush=True)
            norms = None
            if smoothed:  # the artifact holds the smoothed model: its changed norms are the export's
                report = json.loads((out / "fp8_report.json").read_text())["calibration"]["nvfp4_smoothing"]
                print(f"  smoothing: {report['mappings']}, {report['changed_tensors']} tensors changed")
                changed = {key: tensor for key, tensor in load_file(out / "model.safetensors").items()
                           if not torch.equal(tensor, source[key])}
                norms = {key: tensor for key, tensor in changed.items() if key.endswith("norm.weight")}
                if name == "rtn":  # the smoothed model itself, unquantized: the reference the job's report uses
                    variants["smoothed model (bf16)"] = (None, changed)
            row = f"{'smoothed + ' if smoothed else ''}{name}"
            variants[row] = (read_export(out / "serving" / "nvfp4"), norms)
            exports[row] = out / "serving" / "nvfp4"

    if args.peer:
        peer_dir = work / "llm-compressor"
        if not (peer_dir / "config.json").is_file():
            started = time.perf_counter()
            peer_export(model_dir, write_calibration_rows(batches, work / "calibration_rows.json"), peer_dir,
                        args.peer_venv)
            print(f"llm-compressor NVFP4 RTN export: {time.perf_counter() - started:.0f} s", flush=True)
        variants["llm-compressor rtn"] = (read_export(peer_dir), None)
        exports["llm-compressor rtn"] = peer_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = held_out_windows(model_dir, args.tokens, args.held_out_file, work if args.held_out_package_prose else None)
    scores, windows = {}, {}
    for name, (layers, replaced) in variants.items():
        started = time.perf_counter()
        scores[name], windows[name] = perplexity(model, ids, layers, replaced, cast_inputs=not args.weight_only)
        print(f"  scored {name} in {time.perf_counter() - started:.0f} s", flush=True)
    (work / "scores.json").write_text(json.dumps({"perplexity": scores, "window_nll": windows}))
    base = scores["bf16"]
    reference = "llm-compressor rtn" if "llm-compressor rtn" in scores else "rtn"
    rtn_loss = scores[reference] / base - 1
    kind = "weight-only, as nvfp4-a16 runs" if args.weight_only else "W4A4"
    print(f"\n| export ({kind}) | perplexity | loss vs bf16 | loss / {reference}'s | 5-95% over the windows |\n"
          "|---|---:|---:|---:|---:|")
    for name, value in scores.items():
        loss = value / base - 1
        versus = spread = ""
        if name != "bf16":
            versus = f"{loss / rtn_loss:.2f}x"
            if name != reference:
                low, high = loss_ratio_interval(windows[name], windows[reference], windows["bf16"],
                                                ids.shape[1] - 1)
                spread = f"{low:.2f}-{high:.2f}x"
        print(f"| {name} | {value:.3f} | {loss:+.2%} | {versus} | {spread} |")
    if args.engine:
        engine_rows(work, {name: path for name, path in exports.items() if name in scores}, ids, scores)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
