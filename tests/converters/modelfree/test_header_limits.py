"""A safetensors header of 1.4 million zero-size tensors (99 MB, within the format's 100 MB) is refused as bad input
(invalid_model_config, naming the file, the limit and the fix) within seconds by the plan task a requantize job's
worker runs, instead of a plan child growing to 2.4 GB until its worker was taken for lost. The index and header
readers' other bounds: an index too large or listing too many tensors, a real-sized header accepted."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from converters.errors import ModelConfigError
from converters.model.files import FileConfinement
from converters.model.limits import MAX_INDEX_ENTRIES, MAX_SHARD_TENSORS, read_index_file
from converters.model.safetensors_stream import read_tensor_index
from converters.modelfree.stored import run_stored_task
from service.workers.task_kinds import plan_payload
from tests.converters.model.test_config_limits import TINY


def write_many_tensors(path: Path, count: int) -> Path:
    """A safetensors file of ``count`` zero-size F32 tensors: a header only, written in a second or two."""
    entry = b'"layers.%d.w":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    header = b"{" + b",".join(entry % index for index in range(count)) + b"}"
    header += b" " * (-len(header) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_a_header_of_1_4_million_tensors_is_refused_by_the_plan_task_within_seconds(tmp_path: Path) -> None:
    source = tmp_path / "models" / "many"
    write_many_tensors(source / "model.safetensors", 1_400_000)
    (source / "config.json").write_text(json.dumps(TINY))
    assert 90_000_000 < (source / "model.safetensors").stat().st_size < 100_000_000  # the format's limit is 100 MB
    started = time.monotonic()
    with pytest.raises(ModelConfigError) as info:
        run_stored_task("plan", plan_payload({"model": str(source), "requantize": {"to": "fp8-block"}}), {}, source,
                        tmp_path / "out", FileConfinement(roots=(tmp_path / "models",)))
    elapsed = time.monotonic() - started
    assert info.value.code == "invalid_model_config" and info.value.field == "model"
    message = info.value.message
    assert "'model.safetensors'" in message and f"{MAX_SHARD_TENSORS:,} tensors" in message
    assert "max_shard_size" in message  # how to fix it
    # a fraction of a second on a quiet machine; the bound leaves room for a loaded host (it took minutes, 2.4 GB)
    assert elapsed < 10, elapsed


def test_a_shard_of_many_but_fewer_tensors_than_the_limit_is_read(tmp_path: Path) -> None:
    path = write_many_tensors(tmp_path / "model.safetensors", 20_000)  # beyond any real shard's few thousand
    tensors, _ = read_tensor_index(path)
    assert len(tensors) == 20_000
    over = write_many_tensors(tmp_path / "over" / "model.safetensors", MAX_SHARD_TENSORS + 1)
    with pytest.raises(ModelConfigError, match=f"holds {MAX_SHARD_TENSORS + 1:,} tensors"):
        read_tensor_index(over)


def test_an_index_too_large_or_too_long_is_refused_and_a_real_one_read(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as handle:  # 1 GiB, nearly all a hole: read whole, it took the API to 2.35 GB
        handle.write(b'{"weight_map": {"model.embed_tokens.weight": "model.safetensors"')
        handle.truncate(1 << 30)
    with pytest.raises(ModelConfigError, match="larger than 64 MiB"):
        read_index_file(sparse)
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"weight_map": {f"t{i}": "a.safetensors" for i in range(MAX_INDEX_ENTRIES + 1)}}))
    with pytest.raises(ModelConfigError, match=f"more than the {MAX_INDEX_ENTRIES:,}"):
        read_index_file(long)
    # DeepSeek-V3's index lists about 91,000 tensors in 163 shards
    real = tmp_path / "real.json"
    weight_map = {f"model.layers.{i // 1500}.mlp.experts.{i % 1500}.weight": f"model-{i // 560:05d}-of-00163"
                  ".safetensors" for i in range(91_000)}
    real.write_text(json.dumps({"metadata": {"total_size": 688_586_727_753}, "weight_map": weight_map}, indent=2))
    assert read_index_file(real)["weight_map"] == weight_map
