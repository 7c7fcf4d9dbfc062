"""Process-level measurements shared by the benchmarks: wall time and peak RSS of a fresh child process, a
sampler that splits a process's own resident memory into anonymous and file-backed pages, and the table of a
child's start measured two ways."""

from __future__ import annotations

import subprocess
import sys
import threading

# The wrapper is a small interpreter whose only child is the measured command, so RUSAGE_CHILDREN's
# ru_maxrss is that command's own peak, not the benchmark's (whose RSS a forked child would inherit).
_WRAPPER = (
    "import resource, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "out = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "elapsed = time.perf_counter() - start\n"
    "sys.stderr.write(out.stderr[-2000:] if out.returncode else '')\n"
    "print(elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, out.returncode)\n"
    "print(out.stdout)\n"
)


def print_start_table(heading: str, before: tuple[str, list[float]], after: tuple[str, list[float]]
                      ) -> tuple[float, float]:
    """Print the median, min and max seconds of two ways to start a child (each ``(name, seconds)``); returns the
    two medians."""
    print(f"{heading:28} {'median s':>9} {'min s':>7} {'max s':>7}")
    medians = []
    for name, values in (before, after):
        ordered = sorted(values)
        medians.append(ordered[len(ordered) // 2])
        print(f"{name:28} {medians[-1]:>9.2f} {ordered[0]:>7.2f} {ordered[-1]:>7.2f}")
    return medians[0], medians[1]


def child_peak_rss(argv: list[str]) -> tuple[float, int, str]:
    """Run ``argv`` in a fresh process; return its wall seconds, peak RSS in bytes and stdout.

    Raises SystemExit with the command's stderr when it fails.
    """
    result = subprocess.run([sys.executable, "-c", _WRAPPER, *argv], capture_output=True, text=True, check=True)
    first, _, rest = result.stdout.partition("\n")
    elapsed, rss_kib, code = first.split()
    if code != "0":
        raise SystemExit(f"command failed: {' '.join(argv)}\n{result.stderr}")
    return float(elapsed), int(rss_kib) * 1024, rest


class RssSampler:
    """Samples this process's resident memory from /proc/self/status in a background thread.

    ru_maxrss (what child_peak_rss reports) counts file-backed pages too: a safetensors file read through mmap
    shows up in it even though those pages are the page cache and the kernel can drop them. The sampler keeps
    the peaks of anonymous (RssAnon) and file-backed (RssFile + RssShmem) pages apart, and the ``phase`` label
    that was current at each peak. A spike shorter than ``interval_s`` can be missed; Linux only (``peaks()``
    is empty elsewhere).
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.phase = "start"
        self._peaks: dict[str, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end state, in case the work was shorter than one interval

    def peaks(self) -> dict[str, dict]:
        """``{"anon": {"bytes": ..., "phase": ...}, "file": {...}, "total": {...}}``, each peak on its own."""
        return {kind: {"bytes": value, "phase": phase} for kind, (value, phase) in self._peaks.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        fields = _proc_status_kib(("RssAnon", "RssFile", "RssShmem"))
        if not fields:
            return
        anon, file = fields["RssAnon"] * 1024, (fields["RssFile"] + fields.get("RssShmem", 0)) * 1024
        current = {"anon": anon, "file": file, "total": anon + file}
        for kind, value in current.items():
            if value > self._peaks.get(kind, (-1, ""))[0]:
                self._peaks[kind] = (value, self.phase)


def _proc_status_kib(names: tuple[str, ...]) -> dict[str, int]:
    try:
        with open("/proc/self/status") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in names:
            values[key] = int(rest.split()[0])
    return values if "RssAnon" in values and "RssFile" in values else {}
