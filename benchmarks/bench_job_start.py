"""A job's conversion child: spawned (a fresh interpreter importing torch and the pipeline) against a fork of the
worker's fork server (``service/workers/task_server.py``), on the same small job, interleaved in one run.

Each round runs the service's real conversion child (``service.workers.child.child_main``) on a two-layer random
Llama (ao tensorwise, 2 calibration steps, no quality pass), from ``Process.start()`` to its result, once spawned
and once forked; the job's own work is the same in both, so the difference is the child's start. The first fork
waits for the server's imports (a worker's first job) and is shown apart. Wall seconds: a fork server's children
are not this process's, so their CPU is not counted here.

``--frozen``: forks only, each child's own CPU seconds and minor page faults (its ``getrusage``, written by the
child), with the server's imports frozen as shipped (``imports_frozen`` in the fork server's preloads)
against thawed (``gc.unfreeze`` at the child's start: the server's objects back in the collector's oldest
generation, as in a server that never froze them), interleaved.

``--server-start``: no job; a fresh interpreter importing a fork server's preload (each kind: conversions,
shard tasks), its CPU seconds, objects frozen and anonymous resident memory, with the garbage collector held off
during the imports as shipped (one collection at the end) against left on (``gc.disable`` made a no-op: the
collections every import would trigger), interleaved.

    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_job_start.py --rounds 5
    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_job_start.py --rounds 7 --frozen
    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_job_start.py --rounds 5 --server-start
"""

from __future__ import annotations

import argparse
import gc
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


def child_with_usage(usage_file: str, thaw: bool, *args, **kwargs) -> None:
    """The conversion child (``child_main``), the server's objects first thawed if ``thaw``; then this process's
    CPU seconds and minor page faults to ``usage_file``."""
    import resource

    from service.workers.child import child_main

    if thaw:
        gc.unfreeze()
    child_main(*args, **kwargs)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(usage_file).write_text(f"{usage.ru_utime + usage.ru_stime} {usage.ru_minflt}")


def run_child(context: mp.context.BaseContext, request: dict, out_dir: Path, sources: dict,
              usage: tuple[Path, bool] | None = None) -> float:
    """Seconds from start() to the child's result (Succeeded, else the run stops with the failure). ``usage``:
    (file, thaw) for :func:`child_with_usage`."""
    from service.workers.child import child_main
    from service.workers.messages import Succeeded
    from service.workers.task_server import worker_environment

    shutil.rmtree(out_dir, ignore_errors=True)
    receiver, sender = context.Pipe(duplex=False)
    stop = context.Event()
    started = time.perf_counter()
    target, leading = (child_main, ()) if usage is None else (child_with_usage, (str(usage[0]), usage[1]))
    proc = context.Process(target=target, args=(*leading, request, str(out_dir), sources, sender, stop, os.getpid()),
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
    parser.add_argument("--frozen", action="store_true", help="forks only: the server's imports frozen / thawed")
    parser.add_argument("--server-start", action="store_true",
                        help="no job: a preload's import with collections held off / left on")
    args = parser.parse_args()
    if args.server_start:
        compare_server_start(args.rounds)
        return
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
    if args.frozen:
        compare_frozen(request, out, sources, args.rounds, args.workdir / "usage")
        return
    spawned, forked = [], []
    for _ in range(args.rounds):
        spawned.append(run_child(mp.get_context("spawn"), request, out, sources))
        forked.append(run_child(task_context(conversions=True), request, out, sources))
    slow, fast = print_start_table("job, start to result", ("spawned child (before)", spawned),
                                   ("fork server child (after)", forked))
    print(f"ratio forked / spawned (medians): {fast / slow:.2f}; saved {slow - fast:.2f} s a job; load average "
          f"{os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")


def compare_frozen(request: dict, out: Path, sources: dict, rounds: int, usage_file: Path) -> None:
    """Each round a thawed child, then a frozen one, of the same server: their CPU seconds and page faults."""
    from service.workers.task_server import task_context

    seen: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for _ in range(rounds):
        for thaw in (True, False):
            run_child(task_context(conversions=True), request, out, sources, usage=(usage_file, thaw))
            cpu, faults = usage_file.read_text().split()
            seen[thaw].append((float(cpu), int(faults)))
    medians = {}
    print(f"{'conversion child':28} {'median CPU s':>13} {'min':>6} {'max':>6} {'median page faults':>19}")
    for thaw, name in ((True, "server's imports thawed"), (False, "frozen (as shipped)")):
        cpus, faults = sorted(cpu for cpu, _ in seen[thaw]), sorted(fault for _, fault in seen[thaw])
        medians[thaw] = (cpus[len(cpus) // 2], faults[len(faults) // 2])
        print(f"{name:28} {medians[thaw][0]:>13.2f} {cpus[0]:>6.2f} {cpus[-1]:>6.2f} {medians[thaw][1]:>19,}")
    print(f"ratio frozen / thawed (medians): CPU {medians[False][0] / medians[True][0]:.2f}, page faults "
          f"{medians[False][1] / medians[True][1]:.2f}; load average {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")


_IMPORT_PRELOAD = """
import gc, json, resource, sys
if sys.argv[2] == "on":
    gc.disable = lambda: None  # the preload's gc.disable() does nothing: every import's collections run
import importlib
importlib.import_module(sys.argv[1])
usage = resource.getrusage(resource.RUSAGE_SELF)
anon = next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1]
print(json.dumps([usage.ru_utime + usage.ru_stime, gc.get_freeze_count(), int(anon) // 1024]))
"""


def compare_server_start(rounds: int) -> None:
    """Each round, each preload imported in a fresh interpreter with collections left on, then held off."""
    import json
    import subprocess

    from service.workers.task_server import PRELOAD, SHARD_TASK_PRELOAD

    root = Path(__file__).resolve().parents[1]
    seen: dict[tuple[str, str], list[list[float]]] = {}
    for _ in range(rounds):
        for preload in (PRELOAD, SHARD_TASK_PRELOAD):
            for collections in ("on", "off"):
                done = subprocess.run([sys.executable, "-c", _IMPORT_PRELOAD, preload, collections], cwd=root,
                                      capture_output=True, text=True, check=True)
                seen.setdefault((preload, collections), []).append(json.loads(done.stdout.splitlines()[-1]))
    print(f"{'preload, collections':44} {'median CPU s':>13} {'min':>6} {'max':>6} {'frozen objects':>15} "
          f"{'RssAnon MB':>11}")
    for preload in (PRELOAD, SHARD_TASK_PRELOAD):
        medians = {}
        for collections, name in (("on", "left on (before)"), ("off", "held off (as shipped)")):
            runs = seen[(preload, collections)]
            cpus = sorted(run[0] for run in runs)
            medians[collections] = cpus[len(cpus) // 2]
            print(f"{preload.rsplit('.', 1)[1] + ', ' + name:44} {medians[collections]:>13.2f} {cpus[0]:>6.2f} "
                  f"{cpus[-1]:>6.2f} {runs[-1][1]:>15,} {runs[-1][2]:>11}")
        print(f"ratio held off / left on (medians): {medians['off'] / medians['on']:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")


if __name__ == "__main__":
    main()
