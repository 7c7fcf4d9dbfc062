"""Task children start as forks of the worker's task server (``service.workers.task_server``): each starts from
the server's clean image (what one task changes never reaches the next), and a kill -9 of the worker takes its
task children with it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from service.workers.procs import die_with_worker, is_alive
from service.workers.task_server import task_context
from tests.service_helpers import wait_for

ROOT = Path(__file__).resolve().parents[3]


def leave_traces(conn: Connection, worker_pid: int) -> None:
    """A task that changes its process: a module's state, the environment, torch's thread count."""
    import torch

    import converters.modelfree.stored as stored

    die_with_worker(worker_pid)
    stored.LEFT_BY_AN_EARLIER_TASK = True
    os.environ["FP8FORGE_LEFT_BY_AN_EARLIER_TASK"] = "1"
    torch.set_num_threads(1)
    conn.send(os.getpid())
    conn.close()


def look_for_traces(conn: Connection, worker_pid: int) -> None:
    import torch

    import converters.modelfree.stored as stored

    die_with_worker(worker_pid)
    conn.send({"pid": os.getpid(), "module": hasattr(stored, "LEFT_BY_AN_EARLIER_TASK"),
               "environment": "FP8FORGE_LEFT_BY_AN_EARLIER_TASK" in os.environ,
               "torch_loaded_before": "torch" in _modules_at_start, "threads": torch.get_num_threads()})
    conn.close()


def sleep_until_killed(pid_file: str, worker_pid: int) -> None:
    die_with_worker(worker_pid)
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def report_server(conn: Connection, worker_pid: int) -> None:
    die_with_worker(worker_pid)
    conn.send({"server": os.getppid(), "torch": "torch" in _modules_at_start,
               "transformers": "transformers" in _modules_at_start,
               "model_code": "transformers.modeling_utils" in _modules_at_start,
               "frozen": gc.get_freeze_count(), "collecting": gc.isenabled(),
               "tracked": len(gc.get_objects())})
    conn.close()


_modules_at_start = set(sys.modules)  # in a task child: what the server had imported before this module


def _run(target, context) -> object:
    receiver, sender = context.Pipe(duplex=False)
    proc = context.Process(target=target, args=(sender, os.getpid()))
    proc.start()
    sender.close()
    try:
        return receiver.recv()
    finally:
        proc.join(30)


def test_a_task_child_starts_from_the_server_s_image_not_from_the_task_before() -> None:
    context = task_context(conversions=False)
    first = _run(leave_traces, context)
    second = _run(look_for_traces, context)
    assert second["pid"] != first
    assert second["torch_loaded_before"], "the server imports torch before it forks"
    assert (second["module"], second["environment"]) == (False, False)
    assert second["threads"] != 1 or (os.cpu_count() or 1) == 1


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "stopped"])
def test_kill_9_of_the_worker_ends_its_task_children(tmp_path: Path, frozen: bool) -> None:
    """A running child's watcher sees its worker go; a stopped one (SIGSTOP) cannot, and is ended by the kernel when
    its fork server exits, which it does once the worker is gone (the children hold no copy of its pipe)."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, time
        from service.workers.task_server import task_context
        from tests.service.workers.test_task_server import sleep_until_killed
        proc = task_context(conversions=False).Process(target=sleep_until_killed, args=({str(pid_file)!r}, os.getpid()))
        proc.start()
        time.sleep(3600)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        child = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text(), timeout=120,
                             what="the task child to start"))
        assert is_alive(child)
        if frozen:
            os.kill(child, signal.SIGSTOP)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        assert wait_for(lambda: not is_alive(child), timeout=15, what="the task child to die with its worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_server_that_forked_tasks_only_gives_way_to_one_with_the_conversion_imports() -> None:
    """Tasks only: torch and the task functions, not transformers; a conversion then gets a server that imported
    the pipeline and transformers' model code (the first one gone), and the tasks after it are forked from that
    one. Each server's imports reach its children frozen (out of the cyclic collector's reach), the conversion
    server's more of them, and each child collects its own garbage."""
    script = textwrap.dedent("""
        import json
        from service.workers.procs import is_alive
        from service.workers.task_server import task_context
        from tests.service.workers.test_task_server import _run, report_server
        seen = [_run(report_server, task_context(conversions=kind)) for kind in (False, True, False)]
        print(json.dumps({"seen": seen, "first_alive": is_alive(seen[0]["server"])}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    tasks, conversion, task_after = answer["seen"]
    assert tasks["torch"] and not tasks["transformers"]
    assert conversion["transformers"] and conversion["server"] != tasks["server"]
    assert conversion["model_code"]  # what every model class imports: not each conversion child again
    assert not answer["first_alive"]
    assert task_after["server"] == conversion["server"]
    for child in (tasks, conversion):
        assert child["frozen"] > 4 * child["tracked"], child
        assert child["collecting"]  # the server held collections off while it imported, not for its children
    assert conversion["frozen"] > tasks["frozen"]
