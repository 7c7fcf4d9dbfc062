"""An export read back as vLLM loads it: fused q/k/v and gate/up share their largest weight scale (per-tensor FP8
weights quantized again with it) and their largest static input scale; NVFP4 inputs use the stored global scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from converters.model.demo import build_tiny_llama
from converters.quality import ExportFiles, export_layer_casts, load_source
from converters.quality.engine_load import fused_groups, requantize_with_max_scale
from tests.converters.serving.exports import export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("engine-load") / "llama")
    return export(model_dir, ("compressed-tensors-fp8", "nvfp4")) / "serving", load_source(model_dir)


def _casts(exported, fmt, input_cast):
    serving, source = exported
    paths = [name for name, module in source.model.named_modules()
             if isinstance(module, nn.Linear) and name != "lm_head"]
    files = ExportFiles(serving / fmt)
    casts = export_layer_casts(serving / fmt, paths, source.checkpoint.on_disk_name, input_cast=input_cast,
                               files=files)
    return casts, files


def test_fused_groups_are_whole_sibling_groups_only():
    paths = ["m.0.self_attn.q_proj", "m.0.self_attn.k_proj", "m.0.self_attn.v_proj", "m.0.self_attn.o_proj",
             "m.0.mlp.gate_proj", "m.0.mlp.up_proj", "m.0.mlp.down_proj", "m.1.self_attn.k_proj",
             "m.1.self_attn.v_proj"]
    assert fused_groups(paths) == [["m.0.mlp.gate_proj", "m.0.mlp.up_proj"],
                                   ["m.0.self_attn.q_proj", "m.0.self_attn.k_proj", "m.0.self_attn.v_proj"]]


def test_a_fused_group_s_fp8_weights_share_the_largest_scale_and_its_own_shard_is_unchanged(exported):
    casts, files = _casts(exported, "compressed-tensors-fp8", "e4m3_tensor")
    group = [path for path in casts if path.endswith(("q_proj", "k_proj", "v_proj")) and ".1." in path]
    assert len(group) == 3
    scales = {path: float(files.read(f"{path}.weight_scale")) for path in group}
    largest = max(scales.values())
    assert len(set(scales.values())) > 1  # the shards were written with scales of their own
    for path in group:
        weight = casts[path].read_weight(torch.float32)
        codes = files.read(f"{path}.weight")
        # every value is an E4M3 value times the group's one scale
        assert torch.equal((weight / largest).to(torch.float8_e4m3fn).float() * largest, weight)
        direct = codes.float() * scales[path]
        if scales[path] == largest:
            assert torch.equal(weight, direct)
        else:  # quantized again on a coarser grid: close to the stored weight, not equal to it
            assert not torch.equal(weight, direct)
            assert (weight - direct).abs().max() <= 16.5 * largest  # half the grid step at 448 (32), plus fp16
    # the static input scale is the shards' largest, the same for all three
    inputs = {casts[path].input_scale for path in group}
    assert inputs == {1.0 / max(float(files.read(f"{path}.input_scale")) for path in group)}


def test_requantizing_with_the_shard_s_own_scale_gives_its_values_back():
    codes = torch.linspace(-448, 448, 1001).to(torch.float8_e4m3fn)
    assert torch.equal(requantize_with_max_scale(codes, 0.01, 0.01), codes.float() * torch.tensor(0.01))


def test_nvfp4_inputs_use_the_stored_global_scale_not_each_call_s_amax(exported):
    casts, files = _casts(exported, "nvfp4", "nvfp4_block16")
    path = next(path for path in casts if path.endswith("o_proj"))
    stored = float(files.read(f"{path}.input_global_scale"))
    assert casts[path].input_amax == pytest.approx(448 * 6 / stored, rel=1e-6)
    # a call whose own amax is far below the calibrated one is cast on the calibrated grid
    x = torch.randn(4, 64) * casts[path].input_amax / 100
    from converters.quality.casts import _cast_input, input_amax

    static = _cast_input(x, casts[path].input, None, input_amax(casts[path]))
    dynamic = _cast_input(x, casts[path].input, None)
    assert not torch.equal(static, dynamic)
    assert (static - x).abs().mean() > (dynamic - x).abs().mean()
