"""Throughput of `fp8forge sync` against a plain file copy of the same bytes, on a 1B-shaped Llama.

The model: random bf16 weights of a Llama with bench_scale's width (hidden 2048, intermediate 8192, 16 heads,
8 KV heads, vocab 32000, untied head) and the depth closest to `--billions` (1.0: 16 layers, 1.1B parameters) in
~2 GiB shards with an index, written by benchmarks/bench_scale.py. The training artifact around it is what
`fp8forge convert` writes into config.json for it: an `fp8` block with the recipe (`--recipe`, a JSON object) and
`converted_modules`, every decoder Linear but the first (the default skip_first_last; the head is left out too),
beside the source's weight files. No calibration runs: sync reads only that block and the weights.

Measured in this process, each after `os.sync()` and with the weight files read once before (the page cache
cannot be dropped without root, so both sides read from a warm cache and neither pays the other's writeback):
  copy   shutil.copyfile of every weight file and the index (what `cp` does: copy_file_range where the kernel has it)
  sync   converters.sync.sync_serving(artifact, out, format_name=F) for each `--formats` entry (default: the
         recipe's twin), including its report and manifest
Printed: source GB, seconds and GB/s of each (source bytes / seconds), and sync / copy as a time ratio and a GB/s
ratio; the peak anonymous RSS above the start during each sync (one layer's weight, not the model's).

  .venv/bin/python benchmarks/bench_sync.py                        # 1B, TE Float8BlockScaling twin
  .venv/bin/python benchmarks/bench_sync.py --formats mxfp8-te,compressed-tensors-fp8-torchao-rowwise
  .venv/bin/python benchmarks/bench_sync.py --billions 0.1 --keep  # a quick look; keep the files
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_scale import LAYER_PREFIX, Width, layers_for, plan_model, read_through, weight_files, write_model
from measure import RssSampler

GB = 1e9
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_artifact(directory: Path, billions: float, recipe: dict) -> int:
    """The weights and an artifact config.json for them; returns the bytes of the weight files."""
    width = Width()
    plan = plan_model("sync", width, layers_for(width, billions))
    write_model(plan, directory)
    linears = [name.removesuffix(".weight") for name in plan.tensor_shapes
               if LAYER_PREFIX.match(name) and name.rsplit(".", 2)[-2] in _LINEARS]
    config = json.loads((directory / "config.json").read_text())
    config["fp8"] = {"version": 2, "backend": recipe["backend"], "recipe": recipe, "converted_modules": linears[1:]}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"model: {plan.layers} layers, {sum(_numel(s) for s in plan.tensor_shapes.values()) / 1e9:.2f}B "
          f"parameters, {len(linears) - 1} converted Linears")
    return sum(path.stat().st_size for path in weight_files(directory))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def timed_copy(files: list[Path], out: Path) -> float:
    os.sync()
    out.mkdir()
    start = time.perf_counter()
    for path in files:
        shutil.copyfile(path, out / path.name)
    os.sync()  # the copy's writeback is counted, as sync's is (its files are fsynced by write_json only)
    return time.perf_counter() - start


def timed_sync(artifact: Path, out: Path, format_name: str | None) -> tuple[float, dict, int]:
    from converters.sync import sync_serving

    os.sync()
    start_anon = _rss_anon()
    with RssSampler() as sampler:
        start = time.perf_counter()
        report = sync_serving(artifact, out, format_name=format_name)
        os.sync()
        seconds = time.perf_counter() - start
    return seconds, report, sampler.peaks()["anon"]["bytes"] - start_anon


def _rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--billions", type=float, default=1.0, help="model size in billions of parameters")
    parser.add_argument("--recipe", default='{"backend": "te", "scaling": "float8_block"}', help="recipe JSON")
    parser.add_argument("--formats", default="", help="comma-separated serving formats (default: the twin)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    import torch  # noqa: F401  (imported before any clock starts)

    import converters.sync  # noqa: F401

    base = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    try:
        artifact = base / "artifact"
        source_bytes = make_artifact(artifact, args.billions, json.loads(args.recipe))
        files = weight_files(artifact)
        read_through(files)
        copy_s = timed_copy(files, base / "copy")
        shutil.rmtree(base / "copy")
        print(f"source: {source_bytes / GB:.2f} GB in {len(files)} files")
        print(f"{'':42s} {'seconds':>8s} {'GB/s':>7s} {'time/copy':>9s} {'GB/s ratio':>10s} {'peak anon MiB':>13s}")
        print(f"{'copy (shutil.copyfile)':42s} {copy_s:8.2f} {source_bytes / GB / copy_s:7.2f} {1.0:9.2f} {1.0:10.2f}")
        for format_name in [name for name in args.formats.split(",") if name] or [None]:
            out = base / "serving"
            seconds, report, anon = timed_sync(artifact, out, format_name)
            label = f"sync {report['format']} ({len(report['quantized'])} cast)"
            print(f"{label:42s} {seconds:8.2f} {source_bytes / GB / seconds:7.2f} {seconds / copy_s:9.2f} "
                  f"{copy_s / seconds:10.2f} {anon / 2**20:13.0f}")
            shutil.rmtree(out)
    finally:
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
