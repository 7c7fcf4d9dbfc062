"""Model-free conversion of a Llama-3-8B-shaped bf16 checkpoint by 1, 2 and 4 workers, against a plain file copy.

The model has Llama-3-8B's real shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256,
untied head) and random bf16 weights, one decoder layer per shard plus a shard for the embedding and one for
the head; ``--layers`` cuts the depth (all 32 do not fit this shared machine's disk and time budget in one run).

Workers: ``convert_model_free(..., workers=N)``, the modelfree runner's N spawned processes, the same shard task
functions the service's worker processes run one task at a time. Each measurement is a fresh process.

Printed per format and worker count: wall time; bytes read + written per second next to a plain copy of the
source files (``shutil.copyfile``, measured in the same run: the physical limit of reading and writing those
bytes here); the speedup over one worker; peak RSS of a worker process (N = 1: the converting process itself;
N > 1: the largest pool process). The page cache cannot be dropped without root: the source is read once
before anything is timed, so conversions and the copy all read from a warm cache.

Extrapolated, not measured: the full 32-layer 8B time from the one-worker run's measured per-shard seconds
(embedding and head shards as measured, they have the full model's shapes; a decoder-layer shard's mean times
32), and a 1T-parameter bf16 checkpoint on N hosts from the measured per-byte rate of the decoder-layer shards.

    .venv/bin/python benchmarks/bench_shards.py --layers 2

``--task-start N``: instead, the service's task child on a tiny two-shard model's plan task (the real
``task_child_main``, from ``Process.start()`` to its result at the worker's end of the pipe), started N times
from a fresh spawned interpreter (how task children started before) and N times from the worker's task server
(``service.workers.task_server``), interleaved; the server's own first start (its imports) is printed apart,
once with the shard tasks' imports and once with a conversion's, and their ratio.

    .venv/bin/python benchmarks/bench_shards.py --task-start 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from measure import print_start_table

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, FULL_LAYERS = 4096, 14336, 32, 8, 128256, 32
FORMATS = ("fp8-block", "compressed-tensors-fp8-dynamic")


def _layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    prefix = f"model.layers.{i}."
    return {prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}


def build_model(directory: Path, layers: int) -> dict[str, int]:
    """Write the checkpoint one shard at a time; returns each shard's bytes."""
    import torch
    from safetensors.torch import save_file

    shards = [{"model.embed_tokens.weight": (VOCAB, HIDDEN)}, *(_layer_shapes(i) for i in range(layers)),
              {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}]
    directory.mkdir(parents=True)
    names = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    weight_map, sizes = {}, {}
    # 16M random values tiled: drawing 7B normal samples would take longer than the conversions measured here,
    # and the casts cost the same whatever the values
    pool = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    for name, shapes in zip(names, shards, strict=True):
        tensors = {key: pool.repeat(-(-math.prod(shape) // pool.numel()))[:math.prod(shape)].view(shape).clone()
                   for key, shape in shapes.items()}
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        sizes[name] = (directory / name).stat().st_size
        del tensors
    total = sum(sizes.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sizes


def _tree_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def run_one(source: Path, out: Path, target: str, workers: int) -> dict:
    """One conversion in this (fresh) process; with one worker each shard's write is timed too."""
    from converters.modelfree import convert_model_free, driver

    shard_seconds: dict[str, float] = {}
    if workers == 1:  # tasks run in this process: time each shard's write task
        write_shard = driver.write_shard

        def timed(task):
            start = time.perf_counter()
            result = write_shard(task)
            shard_seconds[task.shard] = time.perf_counter() - start
            return result

        driver.write_shard = timed
    start = time.perf_counter()
    convert_model_free(source, out, target, workers=workers)
    seconds = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pool = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"seconds": seconds, "written": _tree_bytes(out), "rss_self": own, "rss_pool": pool,
            "shard_seconds": shard_seconds}


def copy_baseline(source: Path, out: Path) -> float:
    out.mkdir()
    start = time.perf_counter()
    for path in sorted(source.iterdir()):
        shutil.copyfile(path, out / path.name)
    os.sync()
    return time.perf_counter() - start


def _fresh(args: list[str]) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                            env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def task_start(rounds: int, workdir: Path) -> None:
    """Seconds from start() to the plan task's result: spawned child against the task server's fork."""
    import multiprocessing as mp

    import torch
    from safetensors.torch import save_file

    from service.workers.task_child import task_child_main
    from service.workers.task_server import start_task_server, task_context

    model = workdir / "tiny"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "hidden_size": 256, "intermediate_size": 512,
                                                   "num_hidden_layers": 1, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "vocab_size": 512}))
    save_file({f"model.layers.0.mlp.{name}.weight": torch.randn(512, 256).bfloat16() for name in ("gate_proj",
               "up_proj")}, model / "model.safetensors")
    sources = {"allowed_roots": [str(workdir)], "offline": True}
    payload = {"model": str(model), "target": "fp8-block", "include": [], "exclude": [], "skip_first_last": False}

    def one(context: mp.context.BaseContext) -> float:
        receiver, sender = context.Pipe(duplex=False)
        started = time.perf_counter()
        task = {"kind": "plan", "shard": None, "payload": payload}
        proc = context.Process(target=task_child_main, args=(task, str(model), {}, str(workdir / "out"), sources,
                                                            sender, os.getpid()), kwargs={"threads": 1})
        proc.start()
        sender.close()
        result = receiver.recv()
        seconds = time.perf_counter() - started
        proc.join()
        if type(result).__name__ != "TaskDone":
            raise SystemExit(f"the plan task failed: {result}")
        return seconds

    firsts = {}
    for conversions in (False, True):  # a worker's first task: from a server with the tasks' imports only, or not
        started = time.perf_counter()
        start_task_server(conversions=conversions)  # the second replaces the first (it has the tasks' imports only)
        firsts[conversions] = one(task_context(conversions=False)), time.perf_counter() - started
        print(f"task server ({'conversion' if conversions else 'shard task'} imports): first task "
              f"{firsts[conversions][0]:.2f} s, {firsts[conversions][1]:.2f} s after the server's start (its imports "
              f"included); load average {os.getloadavg()[0]:.2f}")
    print(f"ratio, first task from the server's start: conversion imports / shard task imports "
          f"{firsts[True][1] / firsts[False][1]:.1f}")
    spawned, forked = [], []
    for _ in range(rounds):
        spawned.append(one(mp.get_context("spawn")))
        forked.append(one(task_context(conversions=False)))
    slow, fast = print_start_table("start", ("spawned (before)", spawned), ("task server fork (after)", forked))
    print(f"ratio spawned / forked (medians): {slow / fast:.1f}; load average {os.getloadavg()[0]:.2f}, "
          f"cpus {os.cpu_count()}")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3-8B has 32; default 2)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp8forge-bench-shards"))
    parser.add_argument("--hosts", default="1,8,32", help="host counts of the 1T estimate")
    parser.add_argument("--one", nargs=4, metavar=("SOURCE", "OUT", "FORMAT", "WORKERS"), help=argparse.SUPPRESS)
    parser.add_argument("--task-start", type=int, metavar="N", help="measure task children's start instead")
    args = parser.parse_args()
    if args.task_start:
        task_start(args.task_start, args.workdir)
        return
    if args.one:
        source, out, target, workers = args.one
        print(json.dumps(run_one(Path(source), Path(out), target, int(workers))))
        return
    shutil.rmtree(args.workdir, ignore_errors=True)
    source = args.workdir / "llama3-8b-shaped"
    sizes = build_model(source, args.layers)
    read = _tree_bytes(source)
    for path in source.iterdir():  # warm the page cache for every measurement alike
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass
    os.sync()
    copy_s = copy_baseline(source, args.workdir / "copy")
    shutil.rmtree(args.workdir / "copy")
    copy_rate = 2 * read / copy_s
    print(f"Llama-3-8B shapes, {args.layers} of {FULL_LAYERS} layers: {len(sizes)} shards, {read / 1e9:.2f} GB bf16; "
          f"cpus {os.cpu_count()}")
    print(f"plain copy: {copy_s:.1f} s, {copy_rate / 1e6:.0f} MB/s read+written")
    print(f"{'format':32} {'workers':>7} {'wall s':>8} {'MB/s r+w':>9} {'/copy':>6} {'speedup':>7} "
          f"{'worker peak RSS MiB':>20}")
    one_worker: dict[str, dict] = {}
    for target in FORMATS:
        for workers in (int(n) for n in args.workers.split(",")):
            out = args.workdir / f"out-{target}-{workers}"
            result = _fresh(["--one", str(source), str(out), target, str(workers)])
            shutil.rmtree(out)
            os.sync()
            if workers == 1:
                one_worker[target] = result
            rate = (read + result["written"]) / result["seconds"]
            base = one_worker.get(target, {}).get("seconds")
            speedup = f"{base / result['seconds']:.2f}" if base else "-"
            rss = result["rss_self"] if workers == 1 else result["rss_pool"]
            print(f"{target:32} {workers:>7} {result['seconds']:>8.1f} {rate / 1e6:>9.0f} {rate / copy_rate:>6.2f} "
                  f"{speedup:>7} {rss / 2**20:>20.0f}")
    _extrapolate(one_worker, sizes, args)


def _extrapolate(one_worker: dict[str, dict], sizes: dict[str, int], args: argparse.Namespace) -> None:
    names = sorted(sizes)
    layer_shards, edge_shards = names[1:-1], [names[0], names[-1]]
    print("\nEXTRAPOLATED (not measured), from the one-worker runs' measured per-shard seconds:")
    for target, result in one_worker.items():
        seconds = result["shard_seconds"]
        if not layer_shards or not all(name in seconds for name in names):
            continue
        per_layer = sum(seconds[name] for name in layer_shards) / len(layer_shards)
        layer_rate = sum(sizes[name] for name in layer_shards) / sum(seconds[name] for name in layer_shards)
        full = sum(seconds[name] for name in edge_shards) + FULL_LAYERS * per_layer
        print(f"  {target}: one decoder-layer shard {per_layer:.1f} s ({layer_rate / 1e6:.0f} MB/s of bf16 source "
              f"per worker); full 32-layer 8B (16.1 GB) on 1 worker ~{full:.0f} s, on 4 ideal workers "
              f"~{full / 4:.0f} s")
        for hosts in (int(n) for n in args.hosts.split(",")):
            total = 2e12  # 1T parameters in bf16
            print(f"    1T bf16 checkpoint (2 TB) on {hosts} host(s) x 4 workers at that rate: "
                  f"~{total / (layer_rate * 4 * hosts) / 3600:.1f} h (compute only: each host must also read its "
                  f"{total / hosts / 1e9:.0f} GB and write ~half that)")


if __name__ == "__main__":
    main()
