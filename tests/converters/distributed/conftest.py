"""A four-layer tiny random Llama, a calibrated request for it, and a launcher that starts N ranks as torchrun and
Slurm's srun do (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in each rank's environment).

The ranks are forked from a preloaded interpreter (tests/zygote.py: the same ``python -m converters.distributed``
with the same environment, its imports done once instead of once per rank); ``fresh=True`` starts them as new
interpreters, as one test of test_data_parallel.py does (and the Slurm executor's tests do through srun)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service_helpers import free_port
from tests.zygote import ForkedProcess, Zygote

ROOT = Path(__file__).resolve().parents[3]
LAYERS = 4
STEPS = 6  #: the calibration steps of the package's job


#: what every rank and one-process run has in its environment (the zygote starts with it: OpenMP reads its thread
#: count at import); each rank: one intra-op thread, so that no rank count changes a kernel's threading
RANK_ENV = {"OMP_NUM_THREADS": "1", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "PYTHONPATH": str(ROOT)}


@dataclass
class Ranks:
    processes: list[subprocess.Popen | ForkedProcess]
    logs: list[Path]

    def wait(self, timeout: float = 240) -> list[int]:
        return [process.wait(timeout=timeout) for process in self.processes]

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(encoding="utf-8", errors="replace")


@dataclass
class Job:
    root: Path
    request: Path
    zygote: Zygote

    def start(self, world_size: int, out: Path, *, script: list[str] | None = None,
              extra_env: dict[str, str] | None = None, rank_args: dict[int, list[str]] | None = None,
              fresh: bool = False) -> Ranks:
        """``world_size`` ranks of the job writing ``out``; ``rank_args``: more arguments for some ranks;
        ``fresh``: each rank a new interpreter instead of a fork of the zygote."""
        port = str(free_port())
        processes, logs = [], []
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **RANK_ENV, **(extra_env or {})}
            log = out.parent / f"{out.name}.rank{rank}.log"
            args = [*(script or ["-m", "converters.distributed"]), "--request", str(self.request), "--out", str(out),
                    "--allow-root", str(self.root), *(rank_args or {}).get(rank, [])]
            if fresh:
                with open(log, "wb") as handle:
                    processes.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=handle,
                                                      stderr=subprocess.STDOUT))
            else:
                processes.append(self.zygote.start(args, env=env, cwd=ROOT, output=log))
            logs.append(log)
        return Ranks(processes, logs)

    def with_request(self, name: str, request: dict) -> Job:
        """This job's model root and zygote with another request (written to ``root/name``)."""
        path = self.root / name
        path.write_text(json.dumps(request), encoding="utf-8")
        return Job(root=self.root, request=path, zygote=self.zygote)

    def with_serving(self, name: str, recipe: dict, formats: list[str]) -> Job:
        """This job's model and calibration with ``recipe`` and the serving ``formats`` (request in ``root/name``)."""
        request = json.loads(self.request.read_text())
        request["recipe"], request["serving_formats"] = recipe, formats
        return self.with_request(name, request)

    def killed_after_layer_1(self, out: Path, record: Path, *, rank_args: dict[int, list[str]] | None = None,
                             timeout: float = 600) -> None:
        """Two ranks of the job, rank 1 killed with SIGKILL once layer 1 is recorded in ``record``
        (tests/converters/distributed/killed_rank.py): rank 0 loses its peer at layer 2 and fails."""
        ranks = self.start(2, out, script=["tests/converters/distributed/killed_rank.py"],
                           extra_env={"KILL_AFTER_LAYER": "1"}, rank_args=rank_args)
        codes = ranks.wait(timeout=timeout)
        assert codes[1] == -signal.SIGKILL and codes[0] != 0, ranks.log(0)[-2000:]
        assert sorted(path.name for path in record.glob("layer-*.safetensors")) == \
            ["layer-0.safetensors", "layer-1.safetensors"]


@pytest.fixture(scope="package")
def zygote():
    started = Zygote({**os.environ, **RANK_ENV})
    yield started
    started.close()


@pytest.fixture(scope="package")
def job(tmp_path_factory, zygote) -> Job:
    """The request every test of the package converts: TE delayed scaling (scales and amax history from the
    per-step amax), the SQNR meter on (sampling token rows, 64 a call, and the channels of gate/up: the choices a
    rank must make as the one process does), and a compressed-tensors serving export."""
    import torch
    from transformers import AutoModelForCausalLM

    from converters.pipeline.request import CalibrationSettings, ConversionRequest
    from tests.models import tiny_config

    root = tmp_path_factory.mktemp("distributed")
    config = tiny_config("llama")
    config.num_hidden_layers = LAYERS
    config.intermediate_size = 2304  # gate/up wider than 4 x 512: the SQNR meter samples their channels
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama4")
    request = ConversionRequest(model=str(root / "llama4"), recipe={"backend": "te"},
                                calibration=CalibrationSettings(steps=STEPS, batch_size=2, seq_len=32),
                                serving_formats=("compressed-tensors-fp8",))
    path = root / "request.json"
    path.write_text(json.dumps(request.to_dict()), encoding="utf-8")
    return Job(root=root, request=path, zygote=zygote)


def digests(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (relative path) -> its sha256."""
    return {path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def run_one_process(job: Job, out: Path, *, timeout: float) -> Path:
    """``job`` run the ordinary way into ``out``: one process, no rank variables, no resume record
    (run_conversion itself)."""
    code = ("import json, sys; from pathlib import Path; from converters.model.sources import ModelSourceOptions; "
            "from converters.pipeline.driver import run_conversion; "
            "from converters.pipeline.request import ConversionRequest; "
            "request = ConversionRequest.from_dict(json.loads(Path(sys.argv[1]).read_text())); "
            "run_conversion(request, Path(sys.argv[2]), ModelSourceOptions(allowed_roots=(Path(sys.argv[3]),)))")
    log = out.parent / f"{out.name}.log"
    process = job.zygote.start(["-c", code, str(job.request), str(out), str(job.root)], env={**os.environ, **RANK_ENV},
                               cwd=ROOT, output=log)
    assert process.wait(timeout=timeout) == 0, log.read_text(errors="replace")[-3000:]
    return out


@pytest.fixture(scope="package")
def one_rank(job) -> Path:
    """The job run the ordinary way: one process, no rank variables, no resume record (run_conversion itself)."""
    return run_one_process(job, job.root / "one-rank", timeout=240)
