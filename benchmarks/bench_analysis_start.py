"""An analysis process of the API (``service/api/analyze_pool.py``): spawned (a fresh interpreter importing torch,
transformers and the analysis, as every analysis process did before) against a fork of the API process's fork
server (``service/workers/task_server.py``), on the same analysis, interleaved in one run.

Each round starts the real analysis child (``analyze_pool._child_main``) both ways and has it answer
``POST /v1/analyze``'s call (``service.api.operations._analysis_report`` through ``as_json``) for a two-layer
Llama config, from ``Process.start()`` to the answer: what a replacement costs after an analysis died or ran past
its bound, or what a second analysis worker costs. The first fork waits for the server's imports (the API's first
analysis) and is shown apart. Wall seconds, and each child's own CPU seconds (its ``getrusage``, sent with the
answer).

    TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 .venv/bin/python benchmarks/bench_analysis_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from measure import print_start_table  # the script's own directory is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 1024, "torch_dtype": "bfloat16"}


def analysis_with_cpu(sources, options) -> tuple[bytes, float]:
    """The API's analysis call, and the CPU seconds this child has used by its end."""
    from service.api.analyze_pool import as_json
    from service.api.operations import _analysis_report

    answer = as_json(_analysis_report, sources, options, None)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return answer, usage.ru_utime + usage.ru_stime


def one_child(context, sources, options) -> tuple[float, float]:
    """Start an analysis child in ``context``, have it answer one analysis; its wall and its own CPU seconds."""
    from service.api.analyze_pool import _child_main

    started = time.perf_counter()
    conn, theirs = context.Pipe()
    process = context.Process(target=_child_main, args=(theirs, os.getpid(), 1, True), daemon=True)
    process.start()
    theirs.close()
    assert conn.recv() == "ready"
    conn.send((analysis_with_cpu, (sources, options)))
    status, (answer, cpu) = conn.recv()
    wall = time.perf_counter() - started
    if status != "ok" or json.loads(answer)["totals"]["linear_layers"] != 2 * 7 + 1:
        raise SystemExit(f"the analysis failed: {status} {answer!r:.300}")
    conn.close()
    process.kill()
    process.join()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="analysis children each way (default 5)")
    args = parser.parse_args()

    from converters.model.sources import ModelSourceOptions
    from service.workers.task_server import task_context

    with tempfile.TemporaryDirectory() as root:
        model = Path(root) / "tiny-llama"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))
        sources = ModelSourceOptions(allowed_roots=(Path(root),), offline=True)
        options = {"ref": str(model), "backend": "ao", "include": (), "exclude": (), "skip_first_last": True,
                   "convert_router_gates": False, "recipe": None}
        spawn = mp.get_context("spawn")
        started = time.perf_counter()
        first_wall, first_cpu = one_child(task_context(conversions=True), sources, options)
        print(f"fork server: first analysis {first_wall:.2f} s (the server's imports included, "
              f"{time.perf_counter() - started:.2f} s from its start); the child's own CPU {first_cpu:.2f} s")
        spawned, forked = [], []
        for _ in range(args.rounds):
            spawned.append(one_child(spawn, sources, options))
            forked.append(one_child(task_context(conversions=True), sources, options))
    before, after = print_start_table("analysis child, start to answer", ("spawned (before)", [w for w, _ in spawned]),
                                      ("fork server child (after)", [w for w, _ in forked]))
    cpu_before, cpu_after = (sorted(cpu for _, cpu in runs)[len(runs) // 2] for runs in (spawned, forked))
    print(f"ratio forked / spawned (medians): wall {after / before:.2f}, the child's own CPU "
          f"{cpu_after / cpu_before:.2f} ({cpu_before:.2f} -> {cpu_after:.2f} s); load average "
          f"{os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")


if __name__ == "__main__":
    main()
