"""The suite's layout for xdist (tests/scheduling.py): files whole and the heaviest first, every node id unique."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from _pytest.nodeid import NodeId
from pluggy import Result

from tests import conftest
from tests.scheduling import CpuSeconds, FileSeconds, heaviest_files_first, load_file_seconds, unique_ids


@dataclass
class _Item:
    """What the scheduling reads of a pytest item: its name and its id."""

    name: str
    _id: NodeId = field(default=None)

    @property
    def nodeid(self) -> str:
        return str(self._id)


def _item(nodeid: str) -> _Item:
    return _Item(name=nodeid.split("::")[-1], _id=NodeId.parse(nodeid))


def test_files_go_out_whole_heaviest_first_unknown_ones_by_their_test_count():
    ids = ["tests/a.py::one", "tests/a.py::two", "tests/b.py::one", "tests/c.py::one[x]", "tests/c.py::one[y]",
           "tests/d.py::one", "tests/d.py::two", "tests/d.py::three"]
    ordered = heaviest_files_first([_item(nodeid) for nodeid in ids], {"tests/b.py": 30.0, "tests/c.py": 30.0,
                                                                         "tests/a.py": 0.1})
    # b and c tie (collection order kept); d, unknown, weighs 3 tests; a's record is below that
    assert [item.nodeid for item in ordered] == [
        "tests/b.py::one", "tests/c.py::one[x]", "tests/c.py::one[y]",
        "tests/d.py::one", "tests/d.py::two", "tests/d.py::three", "tests/a.py::one", "tests/a.py::two"]


def test_tests_that_share_an_id_get_their_name_s_brackets_and_others_stay():
    shared = [_Item(name=f"test_api[{label}]", _id=NodeId.parse("tests/s.py::test_api"))
              for label in ("GET /a", "POST /a")]
    plain = _item("tests/s.py::test_other[1]")
    assert unique_ids([*shared, plain]) == []
    assert [item.nodeid for item in (*shared, plain)] == [
        "tests/s.py::test_api[GET /a]", "tests/s.py::test_api[POST /a]", "tests/s.py::test_other[1]"]
    # nothing in a name to tell them apart: the ids stay shared, and are named
    twins = [_Item(name="test_same", _id=NodeId.parse("tests/s.py::test_same")) for _ in range(2)]
    assert unique_ids(twins) == ["tests/s.py::test_same"]


def test_a_scheduler_keyed_by_node_id_refuses_a_shared_id():
    def node(dist):
        return SimpleNamespace(config=SimpleNamespace(getoption=lambda name: dist))

    with pytest.raises(pytest.UsageError, match="share a node id"):
        conftest.pytest_xdist_node_collection_finished(node("loadfile"), ["t.py::a", "t.py::a", "t.py::b"])
    conftest.pytest_xdist_node_collection_finished(node("load"), ["t.py::a", "t.py::a"])  # load keys by index
    conftest.pytest_xdist_node_collection_finished(node("loadfile"), ["t.py::a", "t.py::b"])


def test_the_record_sums_each_file_s_phases_and_reads_back(tmp_path):
    path = tmp_path / "seconds.json"
    recorder = FileSeconds(path)
    for nodeid, duration in (("tests/a.py::x", 1.0), ("tests/a.py::x", 0.25), ("tests/b.py::y[1]", 4.0)):
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))
    recorder.pytest_sessionfinish()
    assert json.loads(path.read_text()) == {"tests/b.py": 4.0, "tests/a.py": 1.2}
    assert load_file_seconds(path) == {"tests/b.py": 4.0, "tests/a.py": 1.2}
    assert load_file_seconds(tmp_path / "none.json") == {}


def test_a_phase_s_cpu_seconds_count_the_children_it_waited_for(tmp_path):
    clock = CpuSeconds()
    clock.pytest_runtest_logstart()
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    report = SimpleNamespace(nodeid="tests/a.py::x", duration=0.0)
    wrapper = clock.pytest_runtest_makereport()
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(Result(report, None))
    assert report.cpu_seconds >= 0.5
    recorder = FileSeconds(tmp_path / "cpu.json", clock="cpu_seconds")
    recorder.pytest_runtest_logreport(report)
    recorder.pytest_sessionfinish()
    assert load_file_seconds(tmp_path / "cpu.json")["tests/a.py"] >= 0.5
