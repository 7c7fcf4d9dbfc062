import os
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The wait policy the service's conversion children set (service/workers/child.py limit_threads), here for the test
# processes and every process they start: under xdist the suite's processes outnumber the cores, and libgomp's
# threads spinning at each barrier of torch's intra-op pool burn the time slices the other thread of the op needs.
# Only how a waiting thread waits changes: the same threads, the same reduction order, the same bits. libgomp reads
# it when torch is imported, so it is set before anything here imports torch; a run may set its own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from converters.frozen_imports import imports_frozen  # noqa: E402
from tests.models import MOE_CONFIGS, TINY_CONFIGS, save_tiny_model, save_tiny_moe  # noqa: E402
from tests.scheduling import CpuSeconds, FileSeconds, heaviest_files_first, load_file_seconds, unique_ids  # noqa: E402

#: xdist schedulers that key their work by node id: two tests of one id would run as one
_BY_NODE_ID = ("loadfile", "loadscope", "loadgroup")


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default=None,
                     help="write each test file's seconds (setup + call + teardown) to PATH as JSON at the end: "
                          "tests/file_seconds.json orders the files for xdist (tests/scheduling.py)")
    parser.addoption("--record-file-cpu", metavar="PATH", default=None,
                     help="write each test file's CPU seconds (its processes and the children they waited for) to "
                          "PATH as JSON at the end: what a change costs, apart from the machine's load")


def pytest_configure(config):
    reporting = not hasattr(config, "workerinput")  # the reports of every xdist process reach the controller
    path = config.getoption("--record-file-seconds")
    if path and reporting:
        config.pluginmanager.register(FileSeconds(Path(path)), "file-seconds")
    cpu_path = config.getoption("--record-file-cpu")
    if cpu_path:
        config.pluginmanager.register(CpuSeconds(), "cpu-seconds")
        if reporting:
            config.pluginmanager.register(FileSeconds(Path(cpu_path), clock="cpu_seconds"), "file-cpu")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection imports every test module and what they import (torch, transformers, the project): with
    collections held off meanwhile, then everything alive frozen (``imports_frozen``, as the CLI and the fork servers
    import), every full collection while the tests run skips those objects instead of walking them again. Each
    xdist process collects the whole suite."""
    with imports_frozen():
        return (yield)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture parameters) and any deselection
def pytest_collection_modifyitems(config, items):
    unique_ids(items)
    # xdist's file schedulers hand out files in this order (xdist's plain load sends runs of consecutive tests:
    # the heaviest files first would all land in the first process's run)
    if getattr(config, "workerinput", {}).get("fp8forge_dist") in ("loadfile", "loadscope"):
        items[:] = heaviest_files_first(items, load_file_seconds())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """In xdist's controller: tell each process the scheduler (xdist sets its own --dist to "no")."""
    node.workerinput["fp8forge_dist"] = node.config.getoption("dist")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """In xdist's controller: refuse to run when a scheduler that keys its work by node id meets a shared one."""
    dist = node.config.getoption("dist")
    shared = sorted(nodeid for nodeid, count in Counter(ids).items() if count > 1)
    if shared and dist in _BY_NODE_ID:
        raise pytest.UsageError(f"--dist {dist} would run the tests that share a node id as one test: {shared[:5]}")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    """An allowed local root holding every tiny test model, saved once per session."""
    root = tmp_path_factory.mktemp("models")
    for name in TINY_CONFIGS:
        save_tiny_model(name, root / name)
    return root


@pytest.fixture(scope="session")
def sources(models_root):
    from converters.model.sources import ModelSourceOptions

    return ModelSourceOptions(allowed_roots=(models_root,), offline=True)


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    """An allowed local root holding every tiny MoE test model (Mixtral, Qwen2-MoE, ...); one per test module, whose
    tests may write their artifacts beside the models."""
    root = tmp_path_factory.mktemp("moe")
    for name in MOE_CONFIGS:
        save_tiny_moe(name, root / name)
    return root


@pytest.fixture(scope="module")
def llama_root(tmp_path_factory) -> Path:
    """An allowed local root holding the tiny bf16 Llama with a tokenizer (``llama``: dims 128, 256, 64); one per test
    module, whose tests may write their artifacts beside it."""
    from converters.model.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("llama")
    build_tiny_llama(root / "llama")
    return root


@pytest.fixture(scope="module")
def llama_dir(llama_root) -> Path:
    """The tiny bf16 Llama with a tokenizer of ``llama_root``; its parent is the module's allowed root, where its
    tests write their artifacts (``llama_dir.parent / "out"``)."""
    return llama_root / "llama"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A live server (real uvicorn on loopback) whose jobs stay queued: no workers, no API keys, an empty model root;
    one per test module, shared by its tests."""
    from tests.service_helpers import live_app, queue_only_settings

    with live_app(queue_only_settings(tmp_path_factory.mktemp("queued"))) as served:
        yield served


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> Path:
    """The tiny test Llama (``TINY_CONFIGS["llama"]``) saved in several weight files, alone under an allowed root of
    its own (its parent); one per test module."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config

    directory = tmp_path_factory.mktemp("sharded") / "llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) >= 4
    return directory
