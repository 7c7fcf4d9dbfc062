"""`fp8forge requantize` beside a copy of the same files and llm-compressor's `model_free_ptq`, interleaved, in one run.

The checkpoint: Llama-shaped, bf16, random weights, 8 layers, hidden 2048, intermediate 5632, 16 heads, 4 KV
heads, vocab 32000, untied head: ~0.94 GB in 4 shards (the embedding in the first, the head in the last). Made by
this script in ``--workdir``; its bytes are read once before anything is timed, so every run reads a warm page cache.

Per round and per format, in this order (each a fresh process):

  copy        ``cp -r`` of the source directory: the physical limit of reading and writing those bytes here;
  fp8forge    ``convert_model_free(source, out, format, workers=1)`` (what ``fp8forge requantize`` runs), its
              work timed inside the process; the process's start (imports) is measured apart by an import-only child;
              with ``--no-measure`` without the report's weight SQNR (``measure=False``: the same bytes);
  peer        llm-compressor 0.14 ``model_free_ptq(source, out, scheme, device="cpu", max_workers=1)`` in its own
              venv (never a project dependency; the venv of bench_serving.py, built by it), timed the same way.

Both tools are told the same work: every Linear of the decoder quantized, ``lm_head`` kept in bf16
(fp8forge ``--no-skip-first-last --exclude lm_head``; the peer ``ignore=["lm_head"]``). Formats and the peer's
schemes: fp8-block (FP8_BLOCK), compressed-tensors-fp8-dynamic (FP8_DYNAMIC), mxfp8 (MXFP8), nvfp4-a16 (NVFP4A16).

Printed: each run's work seconds, its CPU seconds (all threads; the copy's: cp's), whole-process seconds and peak
RSS (and its RSS once imported); per format the fastest of the rounds, and the ratios fp8forge / copy and
peer / fp8forge, then the least CPU seconds and their ratio; fp8forge's largest peak RSS above its imports' next to
the largest converted weight. Targets: fp8forge <= 2x a copy, the peer >= 2x fp8forge, fp8forge's
memory one weight's worth plus a fixed buffer.

    .venv/bin/python benchmarks/bench_requantize.py                      # 2 rounds, all four formats
    .venv/bin/python benchmarks/bench_requantize.py --rounds 1 --formats fp8-block --skip-peer
    .venv/bin/python benchmarks/bench_requantize.py --rounds 1 --skip-peer --no-measure
    .venv/bin/python benchmarks/bench_requantize.py --device cuda          # on a GPU worker: both tools cast there
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB, SHARDS = 2048, 5632, 8, 16, 4, 32000, 4


@dataclass(frozen=True)
class CheckpointShape:
    """A Llama-shaped checkpoint's sizes (the default: this benchmark's ~1 GB one)."""

    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    layers: int = LAYERS
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    vocab: int = VOCAB
    shards: int = SHARDS


FORMATS = {"fp8-block": "FP8_BLOCK", "compressed-tensors-fp8-dynamic": "FP8_DYNAMIC", "mxfp8": "MXFP8",
           "nvfp4-a16": "NVFP4A16"}
DEFAULT_PEER_VENV = Path.home() / ".cache" / "fp8forge-bench" / "llmcompressor-venv"
ROOT = Path(__file__).resolve().parents[1]


def _tensor_shapes(size: CheckpointShape) -> dict[str, tuple[int, ...]]:
    hidden, inner, kv_rows = size.hidden, size.intermediate, size.kv_heads * (size.hidden // size.heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (size.vocab, hidden)}
    for i in range(size.layers):
        prefix = f"model.layers.{i}."
        shapes.update({prefix + "input_layernorm.weight": (hidden,),
                       prefix + "self_attn.q_proj.weight": (hidden, hidden),
                       prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
                       prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
                       prefix + "self_attn.o_proj.weight": (hidden, hidden),
                       prefix + "post_attention_layernorm.weight": (hidden,),
                       prefix + "mlp.gate_proj.weight": (inner, hidden),
                       prefix + "mlp.up_proj.weight": (inner, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, inner)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (size.vocab, hidden)})
    return shapes


def build_model(directory: Path, size: CheckpointShape = CheckpointShape()) -> int:
    """Write the checkpoint (tensors split evenly by count over the shards); returns its bytes."""
    import torch
    from safetensors.torch import save_file

    shapes = _tensor_shapes(size)
    names = list(shapes)
    per_shard = math.ceil(len(names) / size.shards)
    # 16M random values tiled: the casts cost the same whatever the values, and drawing 0.5G samples would not
    pool = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    directory.mkdir(parents=True)
    weight_map = {}
    for n in range(size.shards):
        file = f"model-{n + 1:05d}-of-{size.shards:05d}.safetensors"
        keys = names[n * per_shard:(n + 1) * per_shard]
        tensors = {key: pool.repeat(-(-math.prod(shapes[key]) // pool.numel()))[:math.prod(shapes[key])]
                   .view(shapes[key]).clone() for key in keys}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
        del tensors
    total = sum(math.prod(shape) * 2 for shape in shapes.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": size.hidden,
              "intermediate_size": size.intermediate, "num_attention_heads": size.heads,
              "num_key_value_heads": size.kv_heads, "num_hidden_layers": size.layers, "vocab_size": size.vocab,
              "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sum(path.stat().st_size for path in directory.iterdir())


# ---- the measured children (``bench_requantize.py --child ROLE ...``, in either venv) -----------------------


def child(role: str, fmt: str, source: str, out: str, measure: str = "measure", device: str = "cpu") -> None:
    """One measured run: imports, then the work timed; prints one JSON line.

    Memory is this process's own high-water mark (``VmHWM``), not ``ru_maxrss``: Linux carries a parent's peak into
    a child's ``ru_maxrss`` across fork and exec, so a child of the process that built the checkpoint reported the
    builder's peak for both figures. The mark is reset once the imports are done (``clear_refs``), so the work's
    peak is read apart from theirs.
    """
    started = time.perf_counter()
    if role == "fp8forge":
        from converters.modelfree import ModelFreeOptions, convert_model_free  # noqa: F401  (the start's imports)
    elif role == "peer":
        from llmcompressor import model_free_ptq  # noqa: F401
    imported = time.perf_counter()
    imports_rss = _memory_mb("VmHWM")
    reset = _reset_peak()
    cpu = _cpu_seconds(os.times(), children=False)
    if role == "fp8forge":
        convert_model_free(Path(source), Path(out), fmt, exclude=("lm_head",), skip_first_last=False,
                           measure=measure == "measure", device=device)
    elif role == "peer":
        model_free_ptq(source, out, scheme=FORMATS[fmt], ignore=["lm_head"], max_workers=1, device=device)
    done = time.perf_counter()
    cpu = _cpu_seconds(os.times(), children=False) - cpu
    peak = _memory_mb("VmHWM")
    print(json.dumps({"imports_s": imported - started, "work_s": done - imported, "cpu_s": cpu,
                      "imports_rss_mb": imports_rss,
                      "rss_mb": max(peak, imports_rss) if not reset else peak, "peak_reset": reset}))


def _cpu_seconds(times: os.times_result, *, children: bool) -> float:
    """User plus system CPU seconds of this process (all its threads) or of its waited-for children: on a machine
    whose cores other jobs share, the work's own cost, which its wall seconds mix with the time it waits for a
    core."""
    return times.children_user + times.children_system if children else times.user + times.system


def _memory_mb(field: str) -> float:
    """A ``/proc/self/status`` figure (``VmHWM``: the peak resident set, ``VmRSS``: the current one) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status (this bench reads Linux's figures)")


def _reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux 4.0+); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _run(python: Path, role: str, fmt: str, source: Path, out: Path, measure: bool, device: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    result = subprocess.run([str(python), __file__, "--child", role, fmt, str(source), str(out),
                             "measure" if measure else "no-measure", device], capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
                                                      "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - started
    if result.returncode:
        if role == "fp8forge":
            raise SystemExit(f"{role} {fmt} failed:\n{result.stderr[-3000:]}")
        # the peer's own failure is a result: recorded and shown, the run goes on
        error = (result.stderr.strip().splitlines() or ["no message"])[-1]
        shutil.rmtree(out, ignore_errors=True)
        return {"failed": error[:300], "work_s": math.nan, "cpu_s": math.nan, "process_s": seconds,
                "imports_s": math.nan, "rss_mb": math.nan, "imports_rss_mb": math.nan}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured |= {"process_s": seconds, "written_mb": _tree_bytes(out) / 1e6}
    shutil.rmtree(out, ignore_errors=True)
    return measured


def _copy(source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    started, cpu = time.perf_counter(), _cpu_seconds(os.times(), children=True)
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds(os.times(), children=True) - cpu
    shutil.rmtree(out, ignore_errors=True)
    return {"work_s": seconds, "cpu_s": cpu, "process_s": seconds, "imports_s": 0.0, "rss_mb": 0.0,
            "imports_rss_mb": 0.0}


def _tree_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _warm(source: Path) -> None:
    for path in source.iterdir():
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp8forge-bench-requantize"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--no-measure", action="store_true",
                        help="fp8forge without the report's weight SQNR (the peer computes none)")
    parser.add_argument("--device", default="cpu",
                        help="where both tools cast: cpu (default) or cuda (fp8forge requantize --device, the "
                             "peer's device=); reads, writes and the copy stay on the host")
    args = parser.parse_args()
    formats = [name for name in args.formats.split(",") if name]
    unknown = [name for name in formats if name not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    peer_python = args.peer_venv / "bin" / "python"
    run_peer = not args.skip_peer and peer_python.exists()
    if not args.skip_peer and not run_peer:
        print(f"no peer venv at {args.peer_venv}: build it with benchmarks/bench_serving.py (its first run installs "
              "llm-compressor there), or pass --skip-peer; measuring without the peer")
    source = args.workdir / "source"
    if not source.is_dir():
        shutil.rmtree(args.workdir, ignore_errors=True)
        print(f"building the checkpoint in {source}", flush=True)
        build_model(source)
    size = _tree_bytes(source)
    print(f"checkpoint: {size / 1e9:.2f} GB in {SHARDS} shards, {LAYERS} layers, hidden {HIDDEN}; "
          f"cpus {os.cpu_count()}; rounds {args.rounds}; fp8forge's weight SQNR "
          f"{'off' if args.no_measure else 'on'}; casts on {args.device}", flush=True)
    _warm(source)
    out = args.workdir / "out"
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for fmt in formats:
            tools = [("copy", None), ("fp8forge", Path(sys.executable))] + ([("peer", peer_python)] if run_peer else [])
            for tool, python in tools:
                measured = _copy(source, out) if python is None else _run(python, tool, fmt, source, out,
                                                                          not args.no_measure, args.device)
                runs.setdefault((fmt, tool), []).append(measured)
                if "failed" in measured:
                    print(f"round {round_ + 1} {fmt:32s} {tool:9s} FAILED: {measured['failed']}", flush=True)
                    continue
                print(f"round {round_ + 1} {fmt:32s} {tool:9s} work {measured['work_s']:6.2f} s  cpu "
                      f"{measured.get('cpu_s', math.nan):6.2f} s  process "
                      f"{measured['process_s']:6.2f} s  (imports {measured['imports_s']:.2f} s)  peak RSS "
                      f"{measured['rss_mb']:7.0f} MB (after imports {measured['imports_rss_mb']:.0f} MB)", flush=True)
    print("\nfastest of the rounds (work: the process's start apart)")
    print(f"{'format':32s} {'copy s':>7s} {'fp8forge s':>10s} {'peer s':>7s} {'fp8forge/copy':>13s} "
          f"{'peer/fp8forge':>13s} {'fp8forge MB/s':>13s} {'RSS MB':>7s} {'peer RSS':>8s}")
    for fmt in formats:
        best = {tool: min(ok, key=lambda run: run["work_s"]) for tool in ("copy", "fp8forge", "peer")
                if (ok := [run for run in runs.get((fmt, tool), []) if "failed" not in run])}
        ours, copy = best["fp8forge"], best["copy"]
        peer = best.get("peer")
        print(f"{fmt:32s} {copy['work_s']:7.2f} {ours['work_s']:10.2f} "
              f"{peer['work_s'] if peer else float('nan'):7.2f} {ours['work_s'] / copy['work_s']:13.2f} "
              f"{peer['work_s'] / ours['work_s'] if peer else float('nan'):13.2f} {size / 1e6 / ours['work_s']:13.0f} "
              f"{max(run['rss_mb'] for run in runs[(fmt, 'fp8forge')]):7.0f} "
              f"{peer['rss_mb'] if peer else float('nan'):8.0f}" + ("" if peer or not run_peer else "  (peer failed)"))
    starts = {tool: min(run["imports_s"] for (fmt, name), group in runs.items() if name == tool for run in group
                        if "failed" not in run)
              for tool in ("fp8forge", "peer") if any(name == tool for _, name in runs)}
    largest = max(math.prod(shape) * 2 for key, shape in _tensor_shapes(CheckpointShape()).items()
                  if key.endswith("proj.weight"))
    growth = max((run["rss_mb"] - run["imports_rss_mb"]) for (_, tool), group in runs.items() if tool == "fp8forge"
                 for run in group)
    print("CPU seconds of the work, least of the rounds (less sensitive to other jobs on the cores than wall seconds):")
    for fmt in formats:
        cpu = {tool: min((run.get("cpu_s", math.nan) for run in runs.get((fmt, tool), []) if "failed" not in run),
                         default=math.nan) for tool in ("copy", "fp8forge", "peer")}
        print(f"  {fmt:32s} copy {cpu['copy']:6.2f}  fp8forge {cpu['fp8forge']:6.2f}  peer {cpu['peer']:6.2f}  "
              f"fp8forge/copy {cpu['fp8forge'] / cpu['copy']:6.2f}")
    print(f"fp8forge peak RSS above its imports' {growth:.0f} MB (the largest converted weight: "
          f"{largest / 1e6:.0f} MB)")
    print("process start (imports), fastest: " + ", ".join(f"{tool} {value:.2f} s" for tool, value in starts.items()))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:8])
    else:
        main()
