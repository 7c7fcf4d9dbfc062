"""The fresh-clone ``make test`` (``.ci/run``), with every process's CPU read from ``/proc`` once a second: where two
cores' seconds go, and how a tree compares with a base tree measured in the same run.

Each tree is cloned from this repository (``--rev``, and ``--base`` first when given) into a temporary directory
and runs ``.ci/run`` there. A sampler reads every process's CPU (``/proc/<pid>/stat``) and the machine's busy cores
(``/proc/stat``) once a second: the run's own processes are the descendants of ``.ci/run`` and those whose command
line names the clone (a shell that started one may have ended before the sampler saw it); forked children keep
their server's command line, so a server's figure holds its children that lived a second or more. Every other
process that used CPU meanwhile is the machine's own. Printed per tree: wall, exit status, the suite's and the
engine tests' summary lines, busy core-seconds, the run's and the machine's CPU seconds, the run's CPU by part
(``PARTS``) and the slowest ten suite files (``build/file-seconds.json``, ``build/file-cpu.json``); with ``--base``,
the ratios. A machine's cores change speed within an hour (a neighbour's load:
docs/benchmarks/test-suite-2026-12-06c.md), so before and after each tree a probe times a fixed piece of the suite's
work, and the run's CPU is also given in probes: a rough correction for that drift, and a probe ratio far from 1
says the pair is worth running again. ``--json`` also keeps the run's CPU by command line (those of half a second or
more). ``--fresh-machine`` first removes what ``make test`` installs outside the clone (Chromium and Slurm through
apt, torch's Inductor cache, vLLM's cache), as a new machine of the kind would be: it changes this machine.

    .venv/bin/python benchmarks/bench_test_suite.py --fresh-machine --json /tmp/suite.json
    .venv/bin/python benchmarks/bench_test_suite.py --base HEAD~3 --fresh-machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
#: what --fresh-machine removes: the apt packages `make system-packages` installs, the caches a run fills
APT_PACKAGES = ("chromium", "chromium-common", "chromium-sandbox", "slurm-wlm", "slurmctld", "slurmd", "slurm-client",
                "munge")
CACHES = (Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'root')}",
          Path.home() / ".cache" / "vllm")
#: the probe's work (probe_s): what nearly every process of the suite imports first
PROBE = "import torch, transformers.modeling_utils"
#: the run's processes by part: the first pattern its command line matches (Python regex), else "other"
PARTS = (
    ("conversion fork servers and their children", r"task_server_preload"),
    ("shard-task fork servers and their children", r"shard_task_preload"),
    ("vLLM (its venv's build, the engine tests' driver)", r"\.venv-vllm|vllm_driver"),
    ("nvidia-modelopt (its venv's build, the tests' runs)", r"modelopt-venv"),
    ("test processes (pytest, xdist)", r"bin/pytest|exec\(eval\(sys\.stdin"),
    ("API servers and their spawned workers", r"fp8forge serve|multiprocessing\.spawn"),
    ("ranks (converters.distributed, Slurm ranks, torchrun)", r"converters\.distributed|slurm_rank|torchrun"),
    ("CLI commands", r"bin/fp8forge|service\.cli\.main"),
    ("Chromium", r"chrom"),
    ("Slurm and munge daemons", r"slurm|munged|srun|sbatch"),
    ("installs (venvs, apt)", r"venv_install|bin/uv |pip |apt-get|dpkg|ensurepip|apt/methods|mandb"),
    ("lint", r"ruff"),
)


@dataclass
class Process:
    command: str
    parent: int
    first_cpu: float
    cpu: float = 0.0


@dataclass
class Sampler:
    """Every process's CPU and the machine's busy core-seconds, once a second, on a thread of its own."""

    processes: dict[tuple[int, int], Process] = field(default_factory=dict)  # (pid, start time) -> process
    busy_s: float = 0.0
    wall_s: float = 0.0
    minutes: list[float] = field(default_factory=list)  #: busy cores in each minute
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start_busy = last_minute_busy = _busy_ticks() / TICK
        started = last_minute = time.monotonic()
        while not self._stop.wait(1.0):
            self._read_processes()
            now, busy = time.monotonic(), _busy_ticks() / TICK
            self.busy_s = busy - start_busy
            if now - last_minute >= 60:
                self.minutes.append((busy - last_minute_busy) / (now - last_minute))
                last_minute, last_minute_busy = now, busy
        self._read_processes()
        self.wall_s = time.monotonic() - started

    def _read_processes(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                key = (int(entry.name), int(fields[19]))
                cpu = (int(fields[11]) + int(fields[12])) / TICK
                if key not in self.processes:
                    command = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    name = stat[stat.index("(") + 1:stat.rindex(")")]
                    self.processes[key] = Process(command.strip() or f"[{name}]", int(fields[1]), cpu)
                self.processes[key].cpu = cpu
            except (OSError, ValueError, IndexError):  # it ended between the listing and the read
                continue


def _busy_ticks() -> int:
    values = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


def descendants(processes: dict[tuple[int, int], Process], root: int) -> set[tuple[int, int]]:
    """``root`` and the processes below it as first seen (a parent seen after its child still counts)."""
    by_pid: dict[int, list[tuple[int, int]]] = {}
    for key, process in processes.items():
        by_pid.setdefault(process.parent, []).append(key)
    found, pending = {key for key in processes if key[0] == root}, [root]
    while pending:
        for key in by_pid.get(pending.pop(), []):
            if key not in found:
                found.add(key)
                pending.append(key[0])
    return found


def part_of(command: str) -> str:
    return next((name for name, pattern in PARTS if re.search(pattern, command)), "other")


def fresh_machine() -> None:
    subprocess.run(["apt-get", "remove", "-y", "-q", *APT_PACKAGES], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    for daemon in ("slurmctld", "slurmd", "munged"):  # a test's that outlived it
        subprocess.run(["pkill", "-9", "-x", daemon], check=False)
    for cache in CACHES:
        shutil.rmtree(cache, ignore_errors=True)


def probe_s() -> float:
    """The machine's speed now: CPU seconds of a fixed piece of the suite's work (``PROBE``: this repository's venv
    importing torch and transformers' model code, most of what its processes start with), the median of three."""
    env = {**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "PYTHONDONTWRITEBYTECODE": ""}
    runs = []
    for _ in range(3):
        before = os.times()
        subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", PROBE], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = os.times()
        runs.append(after.children_user + after.children_system - before.children_user - before.children_system)
    return sorted(runs)[1]


def run_tree(rev: str, work: Path, *, fresh: bool) -> dict:
    """Clone ``rev`` into ``work`` and run its ``.ci/run`` under the sampler, the probe before and after; what it
    measured."""
    if fresh:
        fresh_machine()
    probe_before = probe_s()
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "checkout", "-q", rev], check=True)
    sampler = Sampler()
    sampler.start()
    log = work.with_name(work.name + ".log")
    with log.open("w") as out:
        run = subprocess.Popen([".ci/run"], cwd=work, stdout=out, stderr=subprocess.STDOUT)
        status = run.wait()
    sampler.stop()
    ours = descendants(sampler.processes, run.pid) | {
        key for key, process in sampler.processes.items() if str(work) in process.command}
    parts, machine, commands = Counter(), Counter(), Counter()
    for key, process in sampler.processes.items():
        used = process.cpu - (0.0 if key in ours else process.first_cpu)
        if key in ours:
            parts[part_of(process.command)] += process.cpu
            commands[process.command[:200]] += process.cpu
        elif used > 0 and key[0] != os.getpid():  # not this benchmark (its sampler)
            machine[process.command[:60]] += used
    probe = (probe_before + probe_s()) / 2
    text = log.read_text(errors="replace")
    summaries = re.findall(r"^\d+ passed.*? in [\d.]+s.*$", text, flags=re.MULTILINE)
    seconds = _json(work / "build" / "file-seconds.json")
    cpu = _json(work / "build" / "file-cpu.json")
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:10]
    return {"rev": subprocess.run(["git", "-C", str(work), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip(),
            "exit_status": status, "wall_s": sampler.wall_s, "summaries": summaries, "busy_core_s": sampler.busy_s,
            "run_cpu_s": sum(parts.values()), "machine_cpu_s": sum(machine.values()), "probe_s": probe,
            "run_cpu_probes": sum(parts.values()) / probe,
            "busy_cores_per_minute": [round(value, 2) for value in sampler.minutes],
            "parts": dict(parts.most_common()), "machine_top": dict(machine.most_common(8)),
            "commands": {command: round(cpu, 2) for command, cpu in commands.most_common() if cpu >= 0.5},
            "slowest_files": [(name, wall, cpu.get(name, 0.0)) for name, wall in slowest], "log": str(log)}


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def report(result: dict) -> None:
    minutes, seconds = divmod(result["wall_s"], 60)
    print(f"\n== {result['rev']}: {int(minutes)}:{seconds:04.1f}, exit status {result['exit_status']} "
          f"(log: {result['log']})")
    for line in result["summaries"]:
        print(f"   {line}")
    print(f"   busy core-s {result['busy_core_s']:.0f}; the run's CPU s {result['run_cpu_s']:.0f}, the machine's own "
          f"{result['machine_cpu_s']:.0f}; busy cores per minute {result['busy_cores_per_minute']}")
    print(f"   probe {result['probe_s']:.2f} CPU s (before and after, mean): the run's CPU is "
          f"{result['run_cpu_probes']:.0f} probes")
    for name, value in result["parts"].items():
        print(f"   {value:8.1f}  {name}")
    print("   the machine's own, most CPU first: " +
          ", ".join(f"{name.split()[0] if name else '?'} {value:.0f}" for name, value in result["machine_top"].items()))
    print("   slowest suite files (wall s, CPU s):")
    for name, wall, cpu in result["slowest_files"]:
        print(f"   {wall:6.0f} {cpu:6.0f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="the tree to measure (default HEAD)")
    parser.add_argument("--base", help="a tree to measure first, in the same run, for the ratios")
    parser.add_argument("--fresh-machine", action="store_true",
                        help="before each tree, remove Chromium, Slurm and the caches a run fills "
                             "(changes this machine)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fp8forge-suite",
                        help="where the clones go (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not Path("/proc/stat").exists():
        raise SystemExit("bench_test_suite.py reads /proc: it runs on Linux only")
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    flags = sorted(set(re.findall(r"\b(amx_\w+|avx512_bf16|avx512_fp16|avx2)\b", Path("/proc/cpuinfo").read_text())))
    print(f"machine: {model}, {os.cpu_count()} cores, {' '.join(flags)}", flush=True)
    results = []
    for index, rev in enumerate([rev for rev in (args.base, args.rev) if rev]):
        results.append(run_tree(rev, args.work / f"tree-{index}", fresh=args.fresh_machine))
        report(results[-1])
    if len(results) == 2:
        base, tree = results
        ratio = {key: tree[key] / base[key] for key in ("wall_s", "run_cpu_s", "busy_core_s", "run_cpu_probes",
                                                          "probe_s")}
        print(f"\n{tree['rev']} / {base['rev']}: wall {ratio['wall_s']:.2f}x, the run's CPU {ratio['run_cpu_s']:.2f}x, "
              f"busy core-s {ratio['busy_core_s']:.2f}x; the machine's speed moved (probe {ratio['probe_s']:.2f}x): "
              f"the run's CPU in probes {ratio['run_cpu_probes']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    sys.exit(max(result["exit_status"] for result in results))


if __name__ == "__main__":
    main()
