"""`fp8forge convert` on a ~100M-parameter Llama built from config, against plain safetensors I/O.

Baseline, measured in the same run: load the same weights with safetensors and save them again
(`load_file` + `save_file`). Two views, both printed:
  warm (in one process whose imports are done, as in a worker after its first job):
      convert time / (baseline + calibration time)                       target <= 2.0
  cold (`fp8forge convert` as a fresh process, next to a fresh process doing load + save):
      wall times, and peak RSS above the import-only baseline / bf16 weight bytes   target <= 2.5
The import-only baseline is the peak RSS of a process that imports the same libraries and does nothing
else: torch and transformers alone take several hundred MB before any weight is read.

Run: .venv/bin/python benchmarks/bench_convert.py [--backend ao|te] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from measure import child_peak_rss

CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=12, vocab_size=16000, max_position_embeddings=1024, tie_word_embeddings=False)

BASELINE_IO = """
import sys
from safetensors.torch import load_file, save_file
save_file(load_file(sys.argv[1]), sys.argv[2], metadata={"format": "pt"})
"""
IMPORTS_ONLY = "import torch, transformers, safetensors, torchao.float8; from transformers import LlamaForCausalLM"


def build_model(directory: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from converters.model.demo import build_demo_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    build_demo_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def warm_ratio(model_dir: Path, root: Path, backend: str, steps: int) -> None:
    """Time convert and the safetensors baseline in this process, after a first conversion warmed it."""
    from safetensors.torch import load_file, save_file

    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import NullSink, run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    sources = ModelSourceOptions(allowed_roots=(root,))

    def convert(out: Path, calibration_steps: int) -> float:
        request = ConversionRequest(model=str(model_dir), recipe={"backend": backend},
                                    calibration=CalibrationSettings(steps=calibration_steps))
        start = time.perf_counter()
        run_conversion(request, out, sources, NullSink())
        return time.perf_counter() - start

    convert(root / "warm-up", 1)
    start = time.perf_counter()
    save_file(load_file(model_dir / "model.safetensors"), root / "copy.safetensors", metadata={"format": "pt"})
    baseline = time.perf_counter() - start
    total = convert(root / "warm", steps)
    stages = json.loads((root / "warm" / "fp8_report.json").read_text())["stage_seconds"]
    calibration = stages["calibrate"]
    print(f"warm: safetensors load+save (baseline) {baseline:6.2f} s")
    print(f"warm: convert {total:6.2f} s, of which calibration ({steps} steps) {calibration:6.2f} s; stages {stages}")
    print(f"warm: convert / (baseline + calibration) = {total / (baseline + calibration):5.2f}  (target <= 2.0)")


def cold_figures(model_dir: Path, root: Path, backend: str, steps: int, weight_bytes: int) -> None:
    baseline_wall, _, _ = child_peak_rss(
        [sys.executable, "-c", BASELINE_IO, str(model_dir / "model.safetensors"), str(root / "copy-cold.st")])
    _, import_rss, _ = child_peak_rss([sys.executable, "-c", IMPORTS_ONLY])
    convert_wall, convert_rss, _ = child_peak_rss([
        sys.executable, "-m", "service.cli.main", "convert", str(model_dir), "--out", str(root / "cold"),
        "--allow-root", str(root), "--backend", backend, "--calib-steps", str(steps), "--no-progress",
    ])
    calibration = json.loads((root / "cold" / "fp8_report.json").read_text())["stage_seconds"]["calibrate"]
    print(f"cold: process doing safetensors load+save {baseline_wall:6.2f} s; `fp8forge convert` {convert_wall:6.2f} s "
          f"(calibration {calibration:.2f} s; the rest is mostly importing torch, transformers and torchao)")
    print(f"cold: convert / (baseline + calibration) = {convert_wall / (baseline_wall + calibration):5.2f}")
    print(f"cold: peak RSS convert {convert_rss / 2**20:.0f} MiB, import-only {import_rss / 2**20:.0f} MiB")
    print(f"cold: peak RSS above imports / bf16 weight bytes = {(convert_rss - import_rss) / weight_bytes:5.2f}  "
          f"(target <= 2.5); raw peak / weight bytes = {convert_rss / weight_bytes:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ao", choices=("ao", "te"))
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        model_dir = root / "llama-100m"
        parameters = build_model(model_dir)
        weight_bytes = (model_dir / "model.safetensors").stat().st_size
        print(f"model: Llama {parameters / 1e6:.0f}M parameters, bf16 weights {weight_bytes / 2**20:.0f} MiB, "
              f"backend {args.backend}")
        cold_figures(model_dir, root, args.backend, args.steps, weight_bytes)
        warm_ratio(model_dir, root, args.backend, args.steps)


if __name__ == "__main__":
    main()
