"""Process-level measurements shared by the benchmarks: wall time and peak RSS of a fresh child process."""

from __future__ import annotations

import subprocess
import sys

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
