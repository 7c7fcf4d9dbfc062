"""tests/zygote.py starts a process as python would: its argv, environment, directory, output, exit code and signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    started = Zygote({**os.environ, "OMP_NUM_THREADS": "2"}, preload=("json", "torch"))
    yield started
    started.close()


def test_code_sees_its_arguments_environment_and_directory_and_exits_with_its_code(zygote, tmp_path):
    # gc.isenabled(): the zygote held collections off while it imported, not for what it starts
    code = ("import gc, os, sys, torch; print(sys.argv, os.environ['ASKED'], os.getcwd(), torch.get_num_threads(), "
            "gc.isenabled()); print('to stderr', file=sys.stderr); sys.exit(3)")
    log = tmp_path / "out.log"
    process = zygote.start(["-c", code, "a", "b"], env={**os.environ, "ASKED": "yes", "OMP_NUM_THREADS": "1"},
                           cwd=tmp_path, output=log)
    assert process.wait(timeout=60) == 3
    assert log.read_text().splitlines() == [f"['-c', 'a', 'b'] yes {tmp_path} 1 True", "to stderr"]
    fresh = subprocess.run([sys.executable, "-c", code, "a", "b"], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "ASKED": "yes", "OMP_NUM_THREADS": "1"}, timeout=120)
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (3, log.read_text().splitlines(True)[0], "to stderr\n")


def test_a_module_and_a_script_run_as_main_and_an_exception_exits_1_with_its_traceback(zygote, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:])\nraise ValueError('told')\n")
    log = tmp_path / "script.log"
    assert zygote.start([str(script), "x"], env=dict(os.environ), cwd=tmp_path, output=log).wait(timeout=60) == 1
    assert log.read_text().startswith("__main__ ['x']\nTraceback") and "ValueError: told" in log.read_text()
    log = tmp_path / "module.log"
    assert zygote.start(["-m", "json.tool", "--help"], env=dict(os.environ), cwd=tmp_path, output=log).wait(60) == 0
    assert "usage:" in log.read_text()


def test_a_killed_process_reports_its_signal_and_wait_times_out(zygote, tmp_path):
    process = zygote.start(["-c", "import time; time.sleep(60)"], env=dict(os.environ), cwd=tmp_path,
                           output=tmp_path / "sleep.log")
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    assert process.poll() is None
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
