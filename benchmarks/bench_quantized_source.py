"""What a quantized source costs `fp8forge convert` and `fp8forge requantize --to bf16`: memory and time against the
same model's bf16 checkpoint, measured in the same run.

A Llama-shaped model (random weights, bf16, in shards) is written, then converted model-free to fp8-block; each
measurement is a fresh process (peak RSS is its own, see benchmarks/measure.py):

  import-only       imports torch, transformers and converters.pipeline.driver: the baseline every RSS is taken above;
  convert bf16      fp8forge convert of the bf16 checkpoint (TE recipe, layer-sequential, measure off);
  convert fp8       the same of the fp8-block checkpoint: each weight dequantized as its layer loads, the artifact's
                    weight files written dequantized;
  requantize bf16   fp8forge requantize --to bf16 of the fp8-block checkpoint (one weight at a time).

Targets: convert fp8 / convert bf16 peak RSS above the baseline <= 1.25 (dequantizing adds one layer's fp32
intermediates, not a model), and both well under the model's bf16 bytes (no whole-model copy).

    .venv/bin/python benchmarks/bench_quantized_source.py [--layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure import child_peak_rss  # noqa: E402

MIB = 1024 * 1024
FP8FORGE = str(Path(sys.executable).parent / "fp8forge")
IMPORTS = "import torch, transformers, converters.pipeline.driver"


def write_models(root: Path, layers: int, hidden: int) -> tuple[Path, Path, int, int]:
    """The bf16 checkpoint and its fp8-block conversion; returns their paths, the model's and one layer's bytes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from converters.modelfree import convert_model_free

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 128 * 128,
                         num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
                         head_dim=128, vocab_size=8192, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "bf16", max_shard_size="64MB")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    del model
    convert_model_free(root / "bf16", root / "fp8-block", "fp8-block")
    return root / "bf16", root / "fp8-block", model_bytes, layer_bytes


def convert_argv(source: Path, out: Path) -> list[str]:
    return [FP8FORGE, "convert", str(source), "--out", str(out), "--backend", "te", "--calib-steps", "2",
            "--calib-seq-len", "64", "--no-measure", "--no-progress", "--allow-root", str(source.parent)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_quantized_source-"))
    try:
        bf16, fp8, model_bytes, layer_bytes = write_models(root, args.layers, args.hidden)
        runs = {
            "import-only": [sys.executable, "-c", IMPORTS],
            "convert bf16": convert_argv(bf16, root / "te-from-bf16"),
            "convert fp8": convert_argv(fp8, root / "te-from-fp8"),
            "requantize bf16": [FP8FORGE, "requantize", str(fp8), "--out", str(root / "bf16-again"), "--to", "bf16",
                                "--allow-root", str(root)],
        }
        measured = {name: child_peak_rss(argv)[:2] for name, argv in runs.items()}
        baseline = measured["import-only"][1]
        print(f"model: {args.layers} layers, hidden {args.hidden}; bf16 weights {model_bytes / MIB:.0f} MiB, one "
              f"decoder layer {layer_bytes / MIB:.1f} MiB; baseline (imports) {baseline / MIB:.0f} MiB")
        print(f"{'run':16s} {'wall s':>7s} {'peak RSS MiB':>13s} {'above baseline':>15s} {'/ model bytes':>14s}")
        for name, (wall, rss) in measured.items():
            above = rss - baseline
            print(f"{name:16s} {wall:7.1f} {rss / MIB:13.0f} {above / MIB:15.0f} {above / model_bytes:14.2f}")
        above = {name: measured[name][1] - baseline for name in ("convert bf16", "convert fp8")}
        ratio = above["convert fp8"] / above["convert bf16"]
        time_ratio = measured["convert fp8"][0] / measured["convert bf16"][0]
        print(f"convert fp8 / convert bf16: peak RSS above baseline {ratio:.2f} (target <= 1.25), "
              f"wall {time_ratio:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
