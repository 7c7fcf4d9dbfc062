"""Bad sources fail ``fp8forge requantize`` and ``fp8forge convert`` naming the file, the tensor and the fix, and
publish nothing: a shard that does not hold what the index lists, a truncated shard, a tensor whose shape or dtype
contradicts config.json, a quantization fp8forge does not read."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.model.files import INDEX_NAME
from service.cli.main import main

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The tiny Llama saved in shards of 100 KB (its tokenizer files beside)."""
    from transformers import AutoModelForCausalLM

    from converters.model.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("bad_sources")
    source = build_tiny_llama(root / "one")
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(root / "llama", max_shard_size="100KB")
    return root / "llama"


def shard_of(directory, name):
    return json.loads((directory / INDEX_NAME).read_text())["weight_map"][name]


def rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def tensor_moved_to_another_shard(directory):
    here = shard_of(directory, Q_PROJ)
    there = next(shard for shard in sorted(set(json.loads((directory / INDEX_NAME).read_text())["weight_map"]
                                                   .values())) if shard != here)
    moved = load_file(directory / here)[Q_PROJ]
    rewrite(directory / here, lambda tensors: tensors.pop(Q_PROJ))
    rewrite(directory / there, lambda tensors: tensors.__setitem__(Q_PROJ, moved))
    return [INDEX_NAME, Q_PROJ, here, f"it is in {there}"]


def tensor_missing(directory):
    here = shard_of(directory, Q_PROJ)
    rewrite(directory / here, lambda tensors: tensors.pop(Q_PROJ))
    return [INDEX_NAME, Q_PROJ, here, "no shard holds it", "download the checkpoint again"]


def truncated_shard(directory):
    here = shard_of(directory, Q_PROJ)
    with open(directory / here, "r+b") as handle:
        handle.truncate(os.path.getsize(directory / here) - 100)
    return [here, "data_offsets outside", "intact copy"]


def shape_contradicts_config(directory):
    here = shard_of(directory, Q_PROJ)
    rewrite(directory / here, lambda tensors: tensors.__setitem__(Q_PROJ, torch.zeros(96, 128, dtype=torch.bfloat16)))
    return [here, Q_PROJ, "[96, 128]", "[128, 128]", "config.json saved with these weights"]


def fp8_codes_without_quantization(directory):
    here = shard_of(directory, Q_PROJ)
    rewrite(directory / here, lambda tensors: tensors.__setitem__(Q_PROJ, tensors[Q_PROJ].to(torch.float8_e4m3fn)))
    return [here, Q_PROJ, "F8_E4M3", "quantization_config"]


def _quantization(config):
    def change(directory):
        saved = json.loads((directory / "config.json").read_text())
        saved["quantization_config"] = config
        (directory / "config.json").write_text(json.dumps(saved))
        return ["config.json", repr(config.get("quant_method") if config["quant_method"] != "compressed-tensors"
                                    else "pack-quantized"), "high-precision checkpoint"]
    return change


CASES = {
    "tensor_in_another_shard": tensor_moved_to_another_shard,
    "tensor_missing": tensor_missing,
    "truncated_shard": truncated_shard,
    "shape_contradicts_config": shape_contradicts_config,
    "fp8_codes_without_quantization": fp8_codes_without_quantization,
    "gptq": _quantization({"quant_method": "gptq", "bits": 4, "group_size": 128}),
    "compressed_tensors_int4": _quantization({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                         "strategy": "group", "group_size": 128}}}}),
}


@pytest.fixture(params=list(CASES))
def bad_source(request, sharded, tmp_path):
    directory = tmp_path / "source"
    shutil.copytree(sharded, directory)
    expected = CASES[request.param](directory)
    return directory, expected


@pytest.mark.parametrize("command", ["requantize", "convert"])
def test_a_bad_source_fails_naming_the_file_and_tensor_and_publishes_nothing(bad_source, tmp_path, capsys, command):
    directory, expected = bad_source
    out = tmp_path / "published" / "out"
    out.parent.mkdir()
    options = ["--to", "fp8-block"] if command == "requantize" else ["--backend", "te", "--calib-steps", "1",
                                                                      "--calib-seq-len", "8", "--no-progress"]
    code = main([command, str(directory), "--out", str(out), *options, "--allow-root", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2, error
    for part in expected:
        assert part in error, (part, error)
    assert list(out.parent.iterdir()) == []  # neither the output nor its staging directory


def test_the_checks_pass_a_sound_source(sharded, tmp_path, capsys):
    """The same fixture untouched converts (the checks refuse the damage, not the model)."""
    out = tmp_path / "out"
    assert main(["requantize", str(sharded), "--out", str(out), "--to", "fp8-block",
                 "--allow-root", str(sharded.parent)]) == 0, capsys.readouterr().err
    assert (out / INDEX_NAME).is_file()
