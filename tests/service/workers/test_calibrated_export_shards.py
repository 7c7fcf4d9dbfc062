"""A calibrated job's serving export written one weight file at a time from plain-data tasks, once calibration has
set its scales: the files are byte for byte those of the one-process export (``write_serving_exports``).

Each task goes through JSON (as it would through the job store) before it runs. The formats cover static input
scales from calibration, FP8 KV-cache scales (tensors the plan adds), a weight amax shared over a fused group
whose members lie in different weight files, and a format's side file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from converters.errors import ConversionError
from converters.model.sources import ModelSourceOptions, confinement_for
from converters.pipeline.driver import run_stages
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.serving_export import run_serving_write, serving_shard_tasks, write_serving_exports
from converters.pipeline.state import NullSink, Run, Stage
from service.workers.task_kinds import ShardTask, run_task

FORMATS = ("compressed-tensors-fp8", "modelopt-nvfp4", "fp8-block")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A three-layer Llama in many small weight files (q, k and v of a layer land in different ones)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("models") / "tiny-llama-sharded"
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="300KB")
    assert len(list(directory.glob("*.safetensors"))) >= 6
    return directory


@pytest.fixture(scope="module")
def calibrated(model_dir: Path) -> Run:
    request = ConversionRequest(model=str(model_dir), recipe={"backend": "ao"}, serving_formats=FORMATS,
                                kv_cache="fp8",
                                calibration=CalibrationSettings(steps=1, batch_size=1, seq_len=16))
    run = Run(request=request, sources=ModelSourceOptions(allowed_roots=(model_dir.parent,)), sink=NullSink())
    run_stages(run, stop_after=Stage.CONVERT)
    return run


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


def test_a_shard_task_refuses_a_directory_that_is_not_there(tmp_path: Path, model_dir: Path,
                                                            calibrated: Run) -> None:
    calibrated.serving = copy.deepcopy(calibrated.serving)
    task = serving_shard_tasks(calibrated, tmp_path)[0]
    with pytest.raises(ConversionError, match=f"serving task for {task['shard']}: the run's output directory is "
                                              "not on this machine"):
        run_serving_write(task["shard"], task["payload"], model_dir, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()


class _ThroughJson:
    """Runs the serving_write tasks here through a worker's dispatcher, each through JSON both ways (as through the
    job store)."""

    def __init__(self, model_dir: Path, staging: Path, confinement) -> None:
        self.model_dir, self.staging, self.confinement, self.ran = model_dir, staging, confinement, 0

    def wanted(self, weight_files: int) -> bool:
        return weight_files > 1

    def run(self, tasks: list[dict]) -> list[dict]:
        results = []
        for task in json.loads(json.dumps(tasks)):
            assert task["kind"] == "serving_write"
            results.append(json.loads(json.dumps(run_task(ShardTask.from_dict(task), {}, self.model_dir,
                                                          self.staging, self.confinement))))
        self.ran += len(tasks)
        return results


def test_a_runner_given_to_the_export_writes_its_shards_and_the_run_the_rest(tmp_path: Path, model_dir: Path,
                                                                             calibrated: Run) -> None:
    plans = copy.deepcopy(calibrated.serving)
    whole = tmp_path / "whole"
    whole.mkdir()
    written_whole = write_serving_exports(calibrated, whole)
    reports_whole = {name: plan.report() for name, plan in calibrated.serving.items()}
    calibrated.serving = plans
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    runner = _ThroughJson(model_dir, sharded, confinement_for(calibrated.sources))
    written = write_serving_exports(calibrated, sharded, runner)

    assert runner.ran == len(list(model_dir.glob("*.safetensors"))) * len(FORMATS)
    assert sorted(written) == sorted(written_whole)
    expected, got = _tree(whole), _tree(sharded)
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if got[name] != expected[name]] == []
    # the report's serving block (layer figures, load audit) is the one the one-process export gives
    assert {name: plan.report() for name, plan in calibrated.serving.items()} == reports_whole
    # what the test means to cover is there: static input scales, KV-cache scales, a side file
    ct_config = json.loads(expected["serving/compressed-tensors-fp8/config.json"])
    assert ct_config["quantization_config"]["kv_cache_scheme"] is not None
    assert any(name.startswith("serving/modelopt-nvfp4/") and name.endswith("hf_quant_config.json")
               for name in expected)
