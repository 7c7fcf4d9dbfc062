"""`fp8forge convert` on a ~100M-parameter Llama built from config, against plain safetensors I/O.

Baseline, measured in the same run: load the same weights with safetensors and save them again
(`load_file` + `save_file`). Figures printed:
  convert wall / (baseline + calibration time)          target <= 2.0
  peak RSS of convert above its import baseline / bf16 weight bytes   target <= 2.5
The import baseline is the peak RSS of a process that imports the same libraries and does nothing else,
since torch and transformers alone take several hundred MB before any weight is read.

Run: .venv/bin/python benchmarks/bench_convert.py [--backend ao|te] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=12, vocab_size=16000, max_position_embeddings=1024, tie_word_embeddings=False)

BASELINE_IO = """
import sys, time
from safetensors.torch import load_file, save_file
start = time.perf_counter()
tensors = load_file(sys.argv[1])
save_file(tensors, sys.argv[2], metadata={"format": "pt"})
print(time.perf_counter() - start)
"""
IMPORTS_ONLY = "import torch, transformers, safetensors, torchao.float8; from transformers import LlamaForCausalLM"


def child_peak_rss(argv: list[str]) -> tuple[float, int, str]:
    """Run ``argv`` in a fresh process (via a wrapper so each measurement is its own child)."""
    wrapper = (
        "import resource, subprocess, sys, time\n"
        "start = time.perf_counter()\n"
        "out = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "elapsed = time.perf_counter() - start\n"
        "sys.stderr.write(out.stderr[-2000:] if out.returncode else '')\n"
        "print(elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, out.returncode)\n"
        "print(out.stdout)\n"
    )
    result = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, check=True)
    first, _, rest = result.stdout.partition("\n")
    elapsed, rss_kib, code = first.split()
    if code != "0":
        raise SystemExit(f"command failed: {' '.join(argv)}\n{result.stderr}")
    return float(elapsed), int(rss_kib) * 1024, rest


def build_model(directory: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from converters.demo import build_demo_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    build_demo_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ao", choices=("ao", "te"))
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    with tempfile.TemporaryDirectory() as root:
        model_dir = Path(root) / "llama-100m"
        parameters = build_model(model_dir)
        weight_bytes = (model_dir / "model.safetensors").stat().st_size
        print(f"model: Llama {parameters / 1e6:.0f}M parameters, bf16 weights {weight_bytes / 2**20:.0f} MiB")

        baseline_wall, _, out = child_peak_rss(
            [sys.executable, "-c", BASELINE_IO, str(model_dir / "model.safetensors"), str(Path(root) / "copy.st")])
        baseline = float(out.strip())
        _, import_rss, _ = child_peak_rss([sys.executable, "-c", IMPORTS_ONLY])
        out_dir = Path(root) / "out"
        convert_wall, convert_rss, _ = child_peak_rss([
            sys.executable, "-m", "service.cli", "convert", str(model_dir), "--out", str(out_dir),
            "--allow-root", root, "--backend", args.backend, "--calib-steps", str(args.steps), "--no-progress",
        ])
        report = json.loads((out_dir / "fp8_report.json").read_text())
        calibration = report["stage_seconds"]["calibrate"]

        print(f"baseline safetensors load+save:  {baseline:7.2f} s")
        print(f"calibration ({args.steps} steps):        {calibration:7.2f} s  (inside convert)")
        print(f"convert wall ({args.backend}):              {convert_wall:7.2f} s  stages: {report['stage_seconds']}")
        print(f"convert / (baseline + calibration): {convert_wall / (baseline + calibration):5.2f}  (target <= 2.0)")
        print(f"peak RSS convert {convert_rss / 2**20:.0f} MiB, import-only {import_rss / 2**20:.0f} MiB")
        above = convert_rss - import_rss
        print(f"peak RSS above imports / bf16 weight bytes: {above / weight_bytes:5.2f}  (target <= 2.5); "
              f"raw peak / weight bytes: {convert_rss / weight_bytes:5.2f}")


if __name__ == "__main__":
    main()
