"""A job whose recipe asks ``nvfp4_weight_scales`` writes the NVFP4 exports with those block scales: the bytes are
``quantize_nvfp4``'s for that method (global scales still shared per fused group), the report says which method
and what it gained, and the export's weights read back closer to the source than round to nearest's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from converters.serving.nvfp4 import GROUP, block_errors, quantize_nvfp4
from tests.converters.serving.exports import export, tiny_llama

W4A4, A16 = "nvfp4", "nvfp4-a16"
QKV = [f"model.layers.1.self_attn.{name}_proj" for name in "qkv"]
DOWN = ["model.layers.1.mlp.down_proj"]


@pytest.fixture(scope="module", params=["mse", "four_over_six"])
def searched(request, tmp_path_factory):
    model_dir = tiny_llama(tmp_path_factory, f"nvfp4-{request.param}")
    out = export(model_dir, (W4A4, A16), recipe={"backend": "ao", "nvfp4_weight_scales": request.param},
                 measure=False)
    return request.param, model_dir, out


def test_the_export_holds_the_recipes_block_scales(searched):
    method, model_dir, out = searched
    with safe_open(out / "serving" / W4A4 / "model.safetensors", "pt") as served, \
            safe_open(model_dir / "model.safetensors", "pt") as source:
        for group in (QKV, DOWN):
            amax = max(float(source.get_tensor(f"{path}.weight").float().abs().max()) for path in group)
            for path in group:
                weight = source.get_tensor(f"{path}.weight")
                packed, scale, gparam = quantize_nvfp4(weight, amax, scale_search=method)
                rtn_scale = quantize_nvfp4(weight, amax)[1]
                written = served.get_tensor(f"{path}.weight_scale")
                assert torch.equal(written.view(torch.uint8), scale.view(torch.uint8))
                assert torch.equal(served.get_tensor(f"{path}.weight_packed"), packed)
                assert torch.equal(served.get_tensor(f"{path}.weight_global_scale"), gparam)  # shared: RTN's
                assert not torch.equal(written.view(torch.uint8), rtn_scale.view(torch.uint8))
                blocks = weight.unflatten(-1, (-1, GROUP))
                assert float(block_errors(blocks, written.float(), gparam).sum()) < float(
                    block_errors(blocks, rtn_scale.float(), gparam).sum())


def test_the_report_and_the_recorded_recipe_name_the_method(searched):
    method, _, out = searched
    report = json.loads((out / "fp8_report.json").read_text())
    for name in (W4A4, A16):
        stats = report["serving"][name]["layer_stats"]["model.layers.1.mlp.down_proj"]
        assert stats["scale_search"] == method
        assert stats["weight_sqnr_db"] > stats["rtn_weight_sqnr_db"]
    config = json.loads((out / "serving" / W4A4 / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["observer"] == "memoryless_mse"
    assert method in json.dumps(report)
