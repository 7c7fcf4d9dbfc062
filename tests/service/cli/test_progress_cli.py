"""What `fp8forge` prints while long work runs (issue 35, item 4), through the real command in a subprocess.

A requantize over several shards prints each shard done and the bytes written; a conversion shows what resolve is
doing, counts calibration in layers, and shows the quality pass as a stage of its own. Every line is the one
formatter's (:mod:`converters.pipeline.progress`), so it reads as the API's progress events do.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from converters.pipeline.progress import progress_text
from tests.service_helpers import fp8forge_command


def _cli(*argv: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FP8FORGE_")}
    env.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", HF_HUB_OFFLINE="1", COLUMNS="200")
    return subprocess.run([*fp8forge_command(), *(str(arg) for arg in argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _bar_texts(stderr: str) -> list[str]:
    """Each state a progress bar showed (tqdm redraws a bar in place with a carriage return)."""
    return [part.strip() for line in stderr.split("\n") for part in line.split("\r") if part.strip()]


def test_requantize_prints_each_shard_and_the_bytes_written(sharded_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _cli("requantize", sharded_llama, "--out", out, "--to", "compressed-tensors-fp8-dynamic",
                "--allow-root", sharded_llama.parent, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shards = len(list(sharded_llama.glob("*.safetensors")))
    total = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    shown = _bar_texts(done.stderr)
    # the plan, then one line per shard written (bytes so far of the total), then the finish
    first = {"stage": "analyze", "done": 1, "total": 1, "unit": "task", "shards_done": 0, "shards_total": shards,
             "bytes_done": 0, "bytes_total": total}  # the plan done: what is to be written
    assert any(text.startswith(progress_text(first)) for text in shown), done.stderr
    for count in range(1, shards + 1):
        assert any(text.startswith(f"convert: {count}/{shards} shards, ") for text in shown), (count, done.stderr)
    last = {"stage": "convert", "done": shards, "total": shards, "unit": "task", "shards_done": shards,
            "shards_total": shards, "bytes_done": total, "bytes_total": total}
    assert any(text.startswith(progress_text(last)) for text in shown), done.stderr
    assert any(text.startswith("export: 1/1 task, ") for text in shown), done.stderr
    assert "wrote " in done.stdout


def test_requantize_no_progress_prints_no_bar(sharded_llama: Path, tmp_path: Path) -> None:
    done = _cli("requantize", sharded_llama, "--out", tmp_path / "out", "--to", "compressed-tensors-fp8-dynamic",
                "--allow-root", sharded_llama.parent, "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "shards" not in done.stderr and "convert:" not in done.stderr


def test_convert_shows_resolve_steps_layers_and_the_quality_stage(llama_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _cli("convert", llama_root / "llama", "--out", out, "--backend", "ao", "--calib-steps", "1",
                "--calib-batch-size", "1", "--calib-seq-len", "16", "--allow-root", llama_root, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shown = _bar_texts(done.stderr)
    # resolve says which of its steps runs (reading config.json is where transformers' model code is imported)
    assert any(text.startswith("resolve: 1/4 steps, now reading config.json") for text in shown), done.stderr
    assert any(text.startswith("resolve: 4/4 steps") for text in shown), done.stderr
    # layer-by-layer calibration counts layers, and says so (the two decoder layers: lm_head is left out)
    calibrate = [text for text in shown if text.startswith("calibrate: ") and "/" in text]  # its counts
    assert calibrate and all(" layer" in text and "step" not in text for text in calibrate), calibrate
    assert any(text.startswith("calibrate: 2/2 layers") for text in calibrate), calibrate
    # the end-to-end quality pass after export is a stage of its own, counted in layers too (and the head pass)
    assert any(text.startswith("quality: 3/3 layers") for text in shown), done.stderr
    report = json.loads((out / "fp8_report.json").read_text())
    assert list(report["stage_seconds"]) == ["resolve", "analyze", "calibrate", "convert", "export", "quality"]
    assert report["stage_seconds"]["quality"] > 0 and report["quality"]["measured"]


@pytest.mark.parametrize(("event", "text"), [
    ({"stage": "resolve", "done": 1, "total": 4, "unit": "step", "step": "reading config.json"},
     "resolve: 1/4 steps, now reading config.json"),
    ({"stage": "calibrate", "done": 1, "total": 3, "unit": "layer"}, "calibrate: 1/3 layers"),
    ({"stage": "calibrate", "done": 1, "total": 1, "unit": "step"}, "calibrate: 1/1 step"),
    ({"stage": "convert", "done": 2, "total": 5, "unit": "task", "shards_done": 2, "shards_total": 5,
      "bytes_done": 1536, "bytes_total": 4096}, "convert: 2/5 shards, 1.5 KiB of 4.0 KiB written"),
    # a format that reads each weight's amax first: its amax tasks count in the stage beside the shard writes
    ({"stage": "convert", "done": 7, "total": 10, "unit": "task", "shards_done": 2, "shards_total": 5,
      "bytes_done": 1536, "bytes_total": 4096}, "convert: 7/10 tasks, 2/5 shards, 1.5 KiB of 4.0 KiB written"),
    ({"stage": "export", "done": 0, "total": 1, "unit": "task", "shards_done": 5, "shards_total": 5},
     "export: 0/1 task, 5/5 shards"),
])
def test_one_formatter_words_every_progress_event(event: dict, text: str) -> None:
    assert progress_text(event) == text
