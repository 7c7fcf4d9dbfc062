"""The calibration walk's GPTQ rounding (``GptqRounding``, an ``after_layer``): each layer's NVFP4 weights are
GPTQ's codes under the writer's scales, with the Hessian of the inputs the already-rounded earlier layers give; a
fused group shares one Hessian and one weight amax; the layer's own weights and the calibration's stream are left as
they were; and the stored tensors are what the writer reads."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from converters.calibration.gptq_rounding import GptqRounding
from converters.serving.nvfp4 import NVFP4, quantize_nvfp4
from converters.serving.nvfp4_gptq import ROUNDED_TENSORS, HessianAccumulator, dequantize_codes, gptq_codes
from converters.serving.selection import ServingSelection
from tests.converters.calibration.layer_walks import walk_layers

WIDTH, STEPS = 32, 3
FAMILY = NVFP4.rounding_family


class Block(nn.Module):
    """A decoder-layer stand-in: a fused pair (q, k) reading one input, and an output Linear after it."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.out(torch.relu(self.q(hidden)) * self.k(hidden))


def _selection(layers: int) -> ServingSelection:
    quantized = {f"model.layers.{i}.{name}": f"model.layers.{i}.{name}.weight"
                 for i in range(layers) for name in ("q", "k", "out")}
    groups = [[f"model.layers.{i}.q", f"model.layers.{i}.k"] for i in range(layers)]
    return ServingSelection(format="nvfp4", quantized=quantized, fused_groups=groups)


def _expected(block: Block, inputs: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """What GPTQ gives each Linear of ``block`` on ``inputs``, computed here from the library functions."""
    captured: dict[str, HessianAccumulator] = {"q": HessianAccumulator(WIDTH), "out": HessianAccumulator(WIDTH)}
    handles = [getattr(block, name).register_forward_pre_hook(
        lambda _, args, name=name: captured[name].add(args[0])) for name in captured]
    with torch.no_grad():
        for hidden in inputs:
            block(hidden)
    for handle in handles:
        handle.remove()
    pair_amax = max(float(block.q.weight.detach().abs().max()), float(block.k.weight.detach().abs().max()))
    result = {}
    for name, amax, hessian in (("q", pair_amax, "q"), ("k", pair_amax, "q"),
                                ("out", float(block.out.weight.detach().abs().max()), "out")):
        weight = getattr(block, name).weight.detach()
        _, scale, scale_global = quantize_nvfp4(weight, amax, scale_search="four_over_six")
        codes = gptq_codes(weight, captured[hessian].matrix, scale, scale_global, act_order=True)
        result[name] = (codes, scale, scale_global)
    return result


@pytest.fixture
def walked(tmp_path):
    torch.manual_seed(0)
    blocks = [Block(), Block()]
    inputs = [torch.randn(4, 8, WIDTH) * torch.linspace(0.1, 3.0, WIDTH) for _ in range(STEPS)]  # uneven columns
    weights = [{name: tensor.clone() for name, tensor in block.state_dict().items()} for block in blocks]
    rounding = GptqRounding([(NVFP4.with_scale_search("four_over_six"), _selection(2))], tmp_path / "rounded",
                            torch.float32, block_scales="four_over_six")
    with torch.no_grad():
        walk_layers(blocks, inputs, rounding)
    return blocks, inputs, weights, rounding


def _stored(rounding: GptqRounding, key: str) -> list[torch.Tensor]:
    with safe_open(rounding.directory / rounding.rounded[FAMILY][key], "pt") as handle:
        return [handle.get_tensor(f"{key}:{part}") for part in ROUNDED_TENSORS]


def test_each_layer_holds_gptq_codes_on_the_stream_of_the_rounded_layers_before_it(walked):
    blocks, inputs, _, rounding = walked
    first = _expected(blocks[0], inputs)
    # the second layer's inputs: the first layer's outputs with its weights as rounded
    rounded_first = Block()
    rounded_first.load_state_dict({f"{name}.weight": dequantize_codes(*first[name]) for name in ("q", "k", "out")})
    with torch.no_grad():
        stream = [rounded_first(hidden) for hidden in inputs]
        unrounded = [blocks[0](hidden) for hidden in inputs]
    second = _expected(blocks[1], stream)
    for index, expected in enumerate((first, second)):
        for name, (codes, scale, scale_global) in expected.items():
            packed, stored_scale, stored_global = _stored(rounding, f"model.layers.{index}.{name}.weight")
            assert torch.equal(packed, _pack(codes)), (index, name)
            assert torch.equal(stored_scale.view(torch.uint8), scale.view(torch.uint8))
            assert torch.equal(stored_global, scale_global)
    # the stream matters: the second layer's codes on the high-precision outputs would be others
    assert not torch.equal(_expected(blocks[1], unrounded)["out"][0], second["out"][0])


def test_a_fused_group_shares_its_weight_amax_and_gptq_moves_codes_off_round_to_nearest(walked):
    _, _, _, rounding = walked
    q, k = (_stored(rounding, f"model.layers.0.{name}.weight") for name in ("q", "k"))
    assert torch.equal(q[2], k[2])  # one global scale for the pair, as engines require
    nearest = quantize_nvfp4(_weight(walked, 0, "q"), float(max(_weight(walked, 0, n).abs().max() for n in "qk")),
                             scale_search="four_over_six")[0]
    assert not torch.equal(q[0], nearest)


def test_the_layers_weights_are_left_as_they_were_and_every_weight_is_recorded(walked):
    blocks, _, weights, rounding = walked
    for block, before in zip(blocks, weights, strict=True):
        for name, tensor in block.state_dict().items():
            assert torch.equal(tensor, before[name])
    assert set(rounding.rounded[FAMILY]) == set(_selection(2).quantized.values())
    assert rounding.summary()["weights"] == {FAMILY: 6} and rounding.summary()["method"] == "gptq"


def test_a_layer_without_nvfp4_weights_still_carries_the_rounded_stream(tmp_path):
    torch.manual_seed(1)
    blocks = [Block(), Block()]
    inputs = [torch.randn(2, 8, WIDTH) for _ in range(STEPS)]
    selection = _selection(2)
    selection.quantized = {path: key for path, key in selection.quantized.items() if ".1." in path}
    selection.fused_groups = [group for group in selection.fused_groups if ".1." in group[0]]
    rounding = GptqRounding([(NVFP4, selection)], tmp_path, torch.float32)
    with torch.no_grad():
        walk_layers(blocks, inputs, rounding)
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"layer-00001-{FAMILY}.safetensors"]
    with torch.no_grad():
        stream = [blocks[0](hidden) for hidden in inputs]  # layer 0 unrounded: its outputs as they are
    captured = _out_hessian(blocks[1], stream)
    weight = blocks[1].out.weight.detach()
    _, scale, scale_global = quantize_nvfp4(weight, float(weight.abs().max()))
    codes = gptq_codes(weight, captured.matrix, scale, scale_global, act_order=True)
    assert torch.equal(_stored(rounding, "model.layers.1.out.weight")[0], _pack(codes))


def _out_hessian(block: Block, stream: list[torch.Tensor]) -> HessianAccumulator:
    """The Hessian of ``block``'s output Linear's inputs when ``stream`` runs through the block."""
    captured = HessianAccumulator(WIDTH)
    handle = block.out.register_forward_pre_hook(lambda _, args: captured.add(args[0]))
    with torch.no_grad():
        for hidden in stream:
            block(hidden)
    handle.remove()
    return captured


def _weight(walked, index: int, name: str) -> torch.Tensor:
    return getattr(walked[0][index], name).weight.detach()


def _pack(codes: torch.Tensor) -> torch.Tensor:
    from converters.serving.nvfp4 import pack_e2m1_codes

    return pack_e2m1_codes(codes)


def test_each_layout_is_rounded_on_the_stream_of_its_own_rounded_layers(tmp_path):
    """compressed-tensors and ModelOpt NVFP4 round under different steps: each family's second layer is GPTQ on
    the outputs of its own rounded first layer."""
    from converters.serving.modelopt import MODELOPT_NVFP4
    from converters.serving.nvfp4_codes import dequantize_stepped, unpack_codes
    from converters.serving.nvfp4_gptq import gptq_codes_stepped

    torch.manual_seed(2)
    blocks = [Block(), Block()]
    inputs = [torch.randn(4, 8, WIDTH) * torch.linspace(0.1, 3.0, WIDTH) for _ in range(STEPS)]
    rounding = GptqRounding([(NVFP4, _selection(2)), (MODELOPT_NVFP4, _selection(2))], tmp_path, torch.float32)
    with torch.no_grad():
        walk_layers(blocks, inputs, rounding)
    family = MODELOPT_NVFP4.rounding_family

    def stored(key: str) -> list[torch.Tensor]:
        with safe_open(tmp_path / rounding.rounded[family][key], "pt") as handle:
            return [handle.get_tensor(f"{key}:{part}") for part in ROUNDED_TENSORS]

    first = Block()
    for name in ("q", "k", "out"):
        packed, block_scale, scale_2 = stored(f"model.layers.0.{name}.weight")
        getattr(first, name).weight.data = dequantize_stepped(unpack_codes(packed), block_scale.float() * scale_2)
    with torch.no_grad():
        stream = [first(hidden) for hidden in inputs]
    captured = _out_hessian(blocks[1], stream)
    weight = blocks[1].out.weight.detach()
    step, _ = MODELOPT_NVFP4.rounding_scales(weight, float(weight.abs().max()))
    codes = gptq_codes_stepped(weight, captured.matrix, step, act_order=True)
    assert torch.equal(stored("model.layers.1.out.weight")[0], _pack(codes))
    assert rounding.summary()["weights"] == {NVFP4.rounding_family: 6, family: 6}
