"""``nvfp4_smoothing: awq`` on ranks: how the search's time divides when the ranks share its steps and candidates.

The same smoothing job (the real SmolLM2-135M by default, an ``nvfp4`` export, ``--steps`` calibration windows of
128 tokens) run through ``python -m converters.distributed``:

* ``1 rank``: one process, one intra-op thread (the baseline);
* ``2 ranks``: two processes on this host, one thread each, as torchrun starts them (gloo), sharing the walk's steps
  and each mapping's candidates (docs/distributed.md);
* ``1 rank, 2 threads``: one process with both of a 2-core machine's threads (what the cores give one process).

Printed per run: the report's search and copy seconds (rank 0's ``calibration.nvfp4_smoothing.seconds``), the job's
wall seconds, the ratio of each to the baseline's, and whether the artifact's weights and export equal the
baseline's byte for byte. Figures only, nothing asserted.

Run:  .venv/bin/python benchmarks/bench_smoothing_ranks.py [--steps 8] [--model DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from tests.service_helpers import free_port  # noqa: E402

FILES = ("model.safetensors", "serving/nvfp4/model.safetensors")
RUNS = (("1 rank", 1, 1), ("2 ranks", 2, 1), ("1 rank, 2 threads", 1, 2))  #: (label, ranks, threads per rank)


def write_request(model: Path, steps: int, path: Path) -> None:
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    request = ConversionRequest(model=str(model), recipe={"backend": "ao", "nvfp4_smoothing": "awq"},
                                calibration=CalibrationSettings(steps=steps, batch_size=1, seq_len=128),
                                serving_formats=("nvfp4",))
    path.write_text(json.dumps(request.to_dict()), encoding="utf-8")


def run_job(request: Path, model: Path, out: Path, ranks: int, threads: int) -> float:
    """The job on ``ranks`` processes of ``threads`` threads each; its wall seconds."""
    port = str(free_port())
    base = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
            "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "converters.distributed", "--request", str(request), "--out", str(out),
               "--allow-root", str(model.parent), "--no-resume"]
    started = time.perf_counter()
    processes = []
    for rank in range(ranks):
        env = dict(base) if ranks == 1 else {**base, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                                             "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        log = open(out.parent / f"{out.name}.rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
        processes.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for process, log in processes:
        codes.append(process.wait())
        log.close()
    if codes != [0] * ranks:
        raise SystemExit(f"{out.name}: exit codes {codes}; see {out.parent}/{out.name}.rank*.log")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="calibration windows of 128 tokens (default 8)")
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: the real SmolLM2-135M)")
    parser.add_argument("--keep", type=Path, help="write the runs here and keep them")
    args = parser.parse_args()
    if args.model is None:
        from tests.converters.quality.smollm import smollm_dir

        args.model = smollm_dir()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-smoothing-ranks-"))
    work.mkdir(parents=True, exist_ok=True)
    request = work / "request.json"
    write_request(args.model.resolve(), args.steps, request)
    print(f"model {args.model}; {args.steps} x 128 calibration tokens; {os.cpu_count()} CPUs\n")
    print("| run | search s | copy s | job wall s | search vs 1 rank | wall vs 1 rank | bytes = 1 rank's |")
    print("|---|---:|---:|---:|---:|---:|---|")
    baseline: dict[str, float] = {}
    first: Path | None = None
    for label, ranks, threads in RUNS:
        out = work / label.replace(" ", "-").replace(",", "")
        shutil.rmtree(out, ignore_errors=True)
        wall = run_job(request, args.model.resolve(), out, ranks, threads)
        seconds = json.loads((out / "fp8_report.json").read_text())["calibration"]["nvfp4_smoothing"]["seconds"]
        if first is None:
            first, baseline = out, {"search": seconds["search"], "wall": wall}
        same = all((out / name).read_bytes() == (first / name).read_bytes() for name in FILES)
        print(f"| {label} | {seconds['search']:.1f} | {seconds['copy']:.1f} | {wall:.1f} | "
              f"{seconds['search'] / baseline['search']:.2f}x | {wall / baseline['wall']:.2f}x | {same} |")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
