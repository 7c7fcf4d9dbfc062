"""``fp8forge convert`` of the built-in demo model (a tiny Llama: the command's own start dominates), with the model
stack imported as shipped (``converters.frozen_imports.import_model_stack``: collections held off while torch,
transformers and the pipeline import, then those objects frozen out of the collector's reach) against the same
command with ``imports_frozen`` made a no-op (the imports and every full collection after them as before),
interleaved in one run. CPU seconds of each command's process (user + system), wall seconds.

``--rank``: the same for one rank of one (``python -m converters.distributed``, no launcher variables) converting
a two-layer Llama saved beside it (ao tensorwise, 2 calibration steps). ``--analyze``: ``fp8forge analyze`` of the
demo model (no calibration: transformers' model code for the meta model, its own ``imports_frozen``).

    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_cli_start.py --rounds 5
    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_cli_start.py --rounds 5 --rank
    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_cli_start.py --rounds 5 --analyze
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the command as the console script runs it; "before": imports_frozen replaced by a context that does nothing,
# before the CLI imports it
_COMMAND = """
import contextlib, sys
if sys.argv.pop(1) == "before":
    import converters.frozen_imports
    converters.frozen_imports.imports_frozen = contextlib.nullcontext
if sys.argv[1] == "rank":
    import runpy
    sys.argv[:2] = ["converters.distributed"]
    runpy.run_module("converters.distributed", run_name="__main__", alter_sys=True)
from service.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def one_run(way: str, workdir: Path, kind: str = "convert") -> tuple[float, float]:
    """Wall and CPU seconds of one ``fp8forge convert`` of the demo model (``kind`` "rank": one rank of one
    converting ``workdir``'s tiny Llama; "analyze": ``fp8forge analyze`` of the demo model), ``way`` "before" or
    "after"."""
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(workdir / ".out.resume", ignore_errors=True)
    command = {"rank": ["rank", "--request", str(workdir / "request.json"), "--out", str(out), "--allow-root",
                        str(workdir), "--offline", "--no-resume"],
               "convert": ["convert", "demo/tiny-llama", "--out", str(out), "--backend", "ao", "--no-progress"],
               "analyze": ["analyze", "demo/tiny-llama"]}[kind]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", _COMMAND, way, *command], cwd=workdir, check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="commands each way (default 5)")
    parser.add_argument("--rank", action="store_true", help="one rank of python -m converters.distributed instead")
    parser.add_argument("--analyze", action="store_true", help="fp8forge analyze (no calibration) instead")
    args = parser.parse_args()
    kind = "rank" if args.rank else "analyze" if args.analyze else "convert"
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        if args.rank:
            from bench_job_start import tiny_model  # the script's own directory is on sys.path

            request = {"model": str(tiny_model(workdir)), "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
                       "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}
            (workdir / "request.json").write_text(json.dumps(request))
        one_run("after", workdir, kind)  # the demo model is built on first use: not in any round
        seen: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for way in seen:
                seen[way].append(one_run(way, workdir, kind))
    what = {"rank": "python -m converters.distributed (1 rank)", "convert": "fp8forge convert demo/tiny-llama",
            "analyze": "fp8forge analyze demo/tiny-llama"}[kind]
    print(f"{what:44} {'median CPU s':>13} {'min':>6} {'max':>6} {'median wall s':>14}")
    medians = {}
    for way, name in (("before", "imports and collections as before"), ("after", "model stack frozen (as shipped)")):
        cpus, walls = sorted(cpu for _, cpu in seen[way]), sorted(wall for wall, _ in seen[way])
        medians[way] = (cpus[len(cpus) // 2], walls[len(walls) // 2])
        print(f"{name:44} {medians[way][0]:>13.2f} {cpus[0]:>6.2f} {cpus[-1]:>6.2f} {medians[way][1]:>14.2f}")
    print(f"ratio shipped / before (medians): CPU {medians['after'][0] / medians['before'][0]:.2f}, wall "
          f"{medians['after'][1] / medians['before'][1]:.2f}; load average {os.getloadavg()[0]:.2f}, "
          f"cpus {os.cpu_count()}")


if __name__ == "__main__":
    main()
