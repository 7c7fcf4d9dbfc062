"""The rank variables, each rank's share of the steps, and the resume record's files (no process group here)."""

from __future__ import annotations

import json

import pytest
import torch

from converters.calibration.kv_cache import KvAmax
from converters.calibration.kv_search import KvSearch
from converters.calibration.sequential import LayerStack
from converters.distributed.job import DistributedJob
from converters.distributed.ranks import RankInfo, rank_from_environment, steps_of_rank
from converters.distributed.resume import LayerRecord, ResumeStore, fingerprint
from converters.errors import Fp8ForgeError

FULL = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_no_rank_variables_is_one_rank_of_one():
    assert rank_from_environment({}) == RankInfo()
    assert RankInfo().leader


def test_the_launcher_variables_name_the_rank():
    info = rank_from_environment(FULL)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port) == \
        (1, 3, 1, "10.0.0.1", 29500)
    assert not info.leader


@pytest.mark.parametrize(("change", "named", "words"), [
    ({"MASTER_ADDR": ""}, "MASTER_ADDR", "is not"),
    ({"RANK": "3"}, "RANK", "not below WORLD_SIZE=3"),
    ({"RANK": "one"}, "RANK", "not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE", "at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT", "TCP port"),
])
def test_a_wrong_rank_variable_is_named_with_the_fix(change, named, words):
    with pytest.raises(Fp8ForgeError) as raised:
        rank_from_environment({**FULL, **change})
    assert raised.value.field == named and words in str(raised.value)


@pytest.mark.parametrize(("world", "total"), [(1, 6), (2, 6), (3, 6), (4, 6), (3, 7), (5, 16)])
def test_the_ranks_share_every_step_once_in_order(world, total):
    shares = [steps_of_rank(rank, world, total) for rank in range(world)]
    assert [step for share in shares for step in share] == list(range(total))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_more_ranks_than_steps_is_refused():
    with pytest.raises(Fp8ForgeError, match="at most 4 ranks or raise calibration.steps"):
        steps_of_rank(0, 5, 4)


_SEARCH = KvSearch(key_ratio=0.85, value_ratio=1.0, error_at_amax=0.1 + 0.2, error_chosen=1e-300,
                   key_errors=(0.3, 0.1), value_errors=(0.2, 0.25), steps=3)


def _record(index: int) -> LayerRecord:
    forward = torch.rand(6, 3)
    return LayerRecord(index=index, amax={"model.layers.0.mlp.up_proj": {"forward": forward},
                                          "model.layers.0.mlp.experts.1.down": {"forward": forward * 2,
                                                                                "tokens": torch.arange(6)}},
                       kv={"model.layers.0.self_attn": KvAmax(key=torch.rand(2), value=torch.rand(2),
                                                              dtype=torch.bfloat16, search=_SEARCH)},
                       sqnr=[("model.layers.0.mlp.up_proj", "te", "output", 0.1 + 0.2, 1e-300)],
                       rounded={"compressed-tensors-nvfp4": {"model.layers.0.mlp.up_proj.weight":
                                                             f"layer-{index:05d}-compressed-tensors-nvfp4.safetensors"}})


def test_a_layer_record_reads_back_exactly(tmp_path):
    store = ResumeStore(tmp_path / "record", "job-a")
    assert not store.open(writer=True)  # nothing to resume: a fresh record
    record = _record(0)
    store.save_layer(record)
    (back,) = store.finished(4)
    assert list(back.amax) == list(record.amax)  # the order of a whole run's result
    for path, parts in record.amax.items():
        assert all(torch.equal(back.amax[path][name], tensor) for name, tensor in parts.items())
    assert back.sqnr == record.sqnr  # floats through JSON, bit for bit
    kv = back.kv["model.layers.0.self_attn"]
    assert kv.dtype == torch.bfloat16 and torch.equal(kv.key, record.kv["model.layers.0.self_attn"].key)
    assert kv.search == _SEARCH  # the chosen clipping and its error figures, floats bit for bit
    assert back.rounded == record.rounded
    assert not list(tmp_path.rglob("*.tmp"))  # written through a temporary name, renamed


def test_gptq_streams_and_rounded_files_are_kept_beside_the_layer(tmp_path):
    store = ResumeStore(tmp_path / "record", "job-a")
    store.open(writer=True)
    stream = [torch.rand(2, 4, 8, dtype=torch.bfloat16) for _ in range(2)]
    store.save_outputs(0, [0, 1], stream, stream="compressed-tensors-nvfp4")
    rounded = tmp_path / "run" / "layer-00000-compressed-tensors-nvfp4.safetensors"
    rounded.parent.mkdir()
    rounded.write_bytes(b"the layer's rounded weights")
    store.save_rounded([rounded])
    store.save_layer(_record(0))
    assert all(torch.equal(a, b) for a, b in
               zip(store.load_outputs(0, [0, 1], stream="compressed-tensors-nvfp4"), stream, strict=True))
    restarted = tmp_path / "restarted-run"  # a restart's rounded-weights directory, made anew
    store.restore_rounded(store.finished(4), restarted)
    assert (restarted / rounded.name).read_bytes() == b"the layer's rounded weights"
    (store.directory / "rounded" / rounded.name).unlink()
    with pytest.raises(Fp8ForgeError, match="lacks the rounded weights layer-00000"):
        store.restore_rounded(store.finished(4), restarted)
    # a record whose layer names a path, not a file of its own, is refused before anything is read or written
    for hostile in ("../../model.safetensors", "/etc/passwd", ".."):
        record = _record(1)
        store.save_layer(LayerRecord(index=1, amax=record.amax, kv=record.kv, sqnr=record.sqnr,
                                     rounded={"compressed-tensors-nvfp4": {"w": hostile}}))
        with pytest.raises(Fp8ForgeError, match="not a file name of its own"):
            store.restore_rounded(store.finished(4)[1:], restarted)


def test_only_the_finished_prefix_of_layers_is_resumed(tmp_path):
    store = ResumeStore(tmp_path / "record", "job-a")
    store.open(writer=True)
    store.save_layer(_record(0))
    store.save_layer(_record(2))  # layer 1 never finished: layer 2's record cannot be used
    assert [record.index for record in store.finished(4)] == [0]


def test_outputs_are_saved_per_step_and_the_previous_layers_dropped(tmp_path):
    store = ResumeStore(tmp_path / "record", "job-a")
    store.open(writer=True)
    outputs = [torch.rand(2, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    store.save_outputs(0, [3, 4, 5], outputs)
    store.save_layer(_record(0))
    store.save_outputs(1, [3, 4, 5], outputs)
    store.save_layer(_record(1))
    assert sorted(path.name for path in store.hidden_dir.iterdir()) == \
        [f"layer-1-step-{step}.safetensors" for step in (3, 4, 5)]
    assert all(torch.equal(a, b) for a, b in zip(store.load_outputs(1, [3, 4, 5]), outputs, strict=True))
    with pytest.raises(Fp8ForgeError, match="lacks its output for step 0"):
        store.load_outputs(1, [0])


def test_a_record_left_by_another_job_is_started_over(tmp_path):
    first = ResumeStore(tmp_path / "record", fingerprint([{"steps": 6}, torch.arange(4)]))
    first.open(writer=True)
    first.save_layer(_record(0))
    same = ResumeStore(tmp_path / "record", fingerprint([{"steps": 6}, torch.arange(4)]))
    assert same.open(writer=False) and len(same.finished(4)) == 1
    other = ResumeStore(tmp_path / "record", fingerprint([{"steps": 6}, torch.arange(5)]))
    assert not other.open(writer=True)
    assert other.finished(4) == []
    assert json.loads((tmp_path / "record" / "job.json").read_text())["job"] == other.job


def test_a_kv_cache_job_keeps_a_record_on_any_rank_count(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    stack = LayerStack(path="model.layers", count=4, layer_class="LlamaDecoderLayer")
    for info in (RankInfo(), rank_from_environment(FULL)):
        job = DistributedJob(info=info, resume_dir=tmp_path / "record")
        assert job.layer_boundary({}, tmp_path, stack, [], [], kv=object(), meter=None).store is not None
