"""What the per-layer resume record costs a layer-sequential calibration (converters.distributed, issue #39).

Model: the Llama-shaped bf16 checkpoint of bench_calibration_forward (hidden 1024, `--layers` layers), kept under
`--root`. Calibration: `--steps` batches of `--batch-size` x `--seq-len` random tokens, every eligible Linear hooked.

Each round runs calibrate_layer_by_layer twice on a fresh meta model, in alternating order: without a boundary
(the ordinary run, the baseline) and as rank 0 of 1 with a resume record (every layer's outputs and its reduced
record written through temp + fsync + rename, the previous layer's outputs removed). Printed: the median pass
seconds of each, their ratio, and the record's bytes per layer. The amax of both runs are checked equal.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_once(directory: Path, args: argparse.Namespace, record: Path | None):
    import torch

    from converters.calibration.batches import calibration_batches
    from converters.calibration.sequential import calibrate_layer_by_layer, find_layer_stack
    from converters.distributed.layer_walk import RankedLayerWalk
    from converters.distributed.ranks import RankInfo
    from converters.distributed.resume import ResumeStore
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
    boundary = None
    if record is not None:
        shutil.rmtree(record, ignore_errors=True)
        boundary = RankedLayerWalk(RankInfo(), ResumeStore(record, "bench"), stack.path)
    started = time.perf_counter()
    amax = calibrate_layer_by_layer(meta, stack, checkpoint, batches, paths, boundary=boundary)
    return amax, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/fp8forge-bench-calibration"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch
    from bench_calibration_forward import ensure_model

    directory = ensure_model(args.root, args.layers)
    record = Path(tempfile.mkdtemp(prefix="fp8forge-resume-bench-")) / "record"
    plain, recorded, sizes = [], [], []
    for number in range(args.rounds):
        order = (None, record) if number % 2 == 0 else (record, None)
        for where in order:
            amax, seconds = run_once(directory, args, where)
            if where is None:
                plain.append(seconds)
                reference = amax
            else:
                recorded.append(seconds)
                sizes = [path.stat().st_size for path in record.glob("layer-*.safetensors")]
                hidden = sum(path.stat().st_size for path in (record / "hidden").iterdir())
                with_record = amax
        assert all(torch.equal(reference[p].forward, with_record[p].forward) for p in reference)
    base, ours = statistics.median(plain), statistics.median(recorded)
    print(f"{torch.get_num_threads()} threads; {args.layers} layers, {args.steps} x {args.batch_size} x "
          f"{args.seq_len} tokens, {args.rounds} rounds (medians)")
    print(f"plain {base:.2f} s, with resume record {ours:.2f} s, ratio {ours / base:.3f}")
    print(f"record per layer {statistics.median(sizes)} bytes; last layer's outputs {hidden} bytes")
    shutil.rmtree(record.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
