"""A job's conversion child: spawned (a fresh interpreter importing torch and the pipeline) against a fork of the
worker's fork server (``service/workers/task_server.py``), on the same small job, interleaved in one run.

Each round runs the service's real conversion child (``service.workers.child.child_main``) on a two-layer random
Llama (ao tensorwise, 2 calibration steps, no quality pass), from ``Process.start()`` to its result, once spawned
and once forked; the job's own work is the same in both, so the difference is the child's start. The first fork
waits for the server's imports (a worker's first job) and is shown apart. Wall seconds: a fork server's children
are not this process's, so their CPU is not counted here.

    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_job_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

from measure import print_start_table  # the script's own directory is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_model(workdir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = workdir / "tiny-llama"
    if not (model / "config.json").exists():
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(model)
    return model


def run_child(context: mp.context.BaseContext, request: dict, out_dir: Path, sources: dict) -> float:
    """Seconds from start() to the child's result (Succeeded, else the run stops with the failure)."""
    from service.workers.child import child_main
    from service.workers.messages import Succeeded
    from service.workers.task_server import worker_environment

    shutil.rmtree(out_dir, ignore_errors=True)
    receiver, sender = context.Pipe(duplex=False)
    stop = context.Event()
    started = time.perf_counter()
    proc = context.Process(target=child_main, args=(request, str(out_dir), sources, sender, stop, os.getpid()),
                           kwargs={"threads": 1, "log_level": "warning", "environ": worker_environment()})
    proc.start()
    sender.close()
    while not isinstance(message := receiver.recv(), Succeeded):
        if type(message).__name__ == "Failed":
            raise SystemExit(f"the conversion failed: {message}")
    seconds = time.perf_counter() - started
    proc.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="jobs each way (default 5)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fp8forge-bench-job-start"))
    args = parser.parse_args()
    from service.workers.task_server import start_task_server, task_context

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = tiny_model(args.workdir)
    request = {"model": str(model), "recipe": {"backend": "ao", "recipe_name": "tensorwise"}, "measure": False,
               "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}
    sources = {"allowed_roots": [str(args.workdir)], "offline": True}
    out = args.workdir / "out"
    started = time.perf_counter()
    start_task_server(conversions=True)
    first = run_child(task_context(conversions=True), request, out, sources)
    print(f"fork server: first job {first:.2f} s, the server started {time.perf_counter() - started:.2f} s ago "
          f"(its imports included); load average {os.getloadavg()[0]:.2f}")
    spawned, forked = [], []
    for _ in range(args.rounds):
        spawned.append(run_child(mp.get_context("spawn"), request, out, sources))
        forked.append(run_child(task_context(conversions=True), request, out, sources))
    slow, fast = print_start_table("job, start to result", ("spawned child (before)", spawned),
                                   ("fork server child (after)", forked))
    print(f"ratio forked / spawned (medians): {fast / slow:.2f}; saved {slow - fast:.2f} s a job; load average "
          f"{os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")

if __name__ == "__main__":
    main()
