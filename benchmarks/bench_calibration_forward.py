"""Timeline of the layer-sequential calibration forward: per layer, load, forward and amax recording.

Model: a Llama-shaped bf16 checkpoint written by bench_scale's shard writer (hidden 1024, intermediate 2816,
16 heads, 8 KV heads, vocab 32000, untied head; `--layers` decoder layers: 8 give about 0.16B parameters),
kept under `--root` between runs. Calibration: `--steps` batches of `--batch-size` x `--seq-len` tokens.

Each configuration runs calibrate_layer_by_layer on a fresh meta model, twice: with every eligible Linear
hooked (the real job) and with none (no amax hooks), so `record` = forward(hooks) - forward(no hooks).
Columns, medians over layers in seconds: wait (blocked on the prefetch read), load (placing tensors; the
read too without prefetch), forward, record, and the pass-2 wall time.

Configurations: `bf16` (compute_dtype=torch.bfloat16, prefetch off: the code before the change), `bf16+pf`,
`fp32+pf` (forced), `auto+pf` (the default: a timed probe picks the dtype).

To see a CPU without native bf16 GEMMs on one that has them, cap torch's and oneDNN's kernels at AVX2:
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/bench_calibration_forward.py

The weight files are in the page cache (just written or read before); the load columns are not cold reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {"bf16": ("bfloat16", False), "bf16+pf": ("bfloat16", True), "fp32+pf": ("float32", True),
           "auto+pf": (None, True)}


def ensure_model(root: Path, layers: int) -> Path:
    from bench_scale import Width, plan_model, write_model

    directory = root / f"llama_1024x{layers}"
    if not (directory / "config.json").is_file():
        width = Width(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
                      vocab_size=32000, max_position_embeddings=2048)
        write_model(plan_model(directory.name, width, layers), directory)
    for path in directory.glob("*.safetensors"):
        path.read_bytes()  # into the page cache, as for every configuration alike
    return directory


def run_once(directory: Path, args: argparse.Namespace, compute: str | None, prefetch: bool, hooked: bool):
    import torch

    from converters.calibration.batches import calibration_batches
    from converters.calibration.sequential import SequentialStats, calibrate_layer_by_layer, find_layer_stack
    from converters.model.checkpoint import Checkpoint
    from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, model_dtype

    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    config = load_config(directory, sources)
    meta = build_meta_model(config, sources)
    stack, _ = find_layer_stack(meta)
    batches, _ = calibration_batches(None, vocab_size=config.vocab_size, steps=args.steps,
                                     batch_size=args.batch_size, seq_len=args.seq_len)
    paths = [p for p, m in meta.named_modules() if isinstance(m, torch.nn.Linear) and p.startswith("model.layers.")]
    checkpoint = Checkpoint(directory, meta, dtype=model_dtype(config), device="cpu")
    stats = SequentialStats()
    started = time.perf_counter()
    calibrate_layer_by_layer(meta, stack, checkpoint, batches, paths if hooked else [], stats=stats,
                             compute_dtype=getattr(torch, compute) if compute else None, prefetch=prefetch)
    return stats, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/fp8forge-bench-calibration"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--timeline", action="store_true", help="print every layer of the hooked runs")
    args = parser.parse_args()

    import torch

    directory = ensure_model(args.root, args.layers)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"{args.layers} layers, {args.steps} x {args.batch_size} x {args.seq_len} tokens")
    print(f"{'config':8} {'dtype':8} {'wait':>6} {'load':>6} {'forward':>8} {'record':>7} {'pass2':>7} {'total':>7}")
    for name in args.configs.split(","):
        compute, prefetch = CONFIGS[name]
        bare, _ = run_once(directory, args, compute, prefetch, hooked=False)
        stats, total = run_once(directory, args, compute, prefetch, hooked=True)
        med = {key: statistics.median(getattr(t, key) for t in stats.layers)
               for key in ("wait_s", "load_s", "forward_s")}
        bare_fwd = statistics.median(t.forward_s for t in bare.layers)
        pass2 = sum(t.wait_s + t.load_s + t.forward_s for t in stats.layers)
        print(f"{name:8} {stats.compute_dtype:8} {med['wait_s']:6.3f} {med['load_s']:6.3f} {bare_fwd:8.3f} "
              f"{med['forward_s'] - bare_fwd:7.3f} {pass2:7.2f} {total:7.2f}")
        if name.startswith("auto"):
            print(f"         auto: {stats.compute_reason}")
        if args.timeline:
            for t in stats.layers:
                print(f"           layer {t.index}: wait {t.wait_s:.3f} load {t.load_s:.3f} forward {t.forward_s:.3f}")


if __name__ == "__main__":
    main()
