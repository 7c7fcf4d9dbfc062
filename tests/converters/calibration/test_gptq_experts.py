"""GPTQ rounding of MoE expert matrices in the calibration walk: each expert's gate/up and down matrices get GPTQ's
codes from the Hessians of the tokens routed to that expert (down's from their gated activations), under the
writer's scales with the unit's shared weight amax; an expert no token reached is left to the writer's nearest
rounding; the next layer's stream comes from the rounded experts; the module's own weights stay as they were."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from converters.calibration.gptq_rounding import GptqRounding
from converters.serving.nvfp4 import NVFP4, pack_e2m1_codes, quantize_nvfp4
from converters.serving.nvfp4_gptq import ROUNDED_TENSORS, HessianAccumulator, dequantize_codes, gptq_codes
from converters.serving.selection import ServingSelection
from tests.converters.calibration.layer_walks import walk_layers

WIDTH, INTERMEDIATE, EXPERTS, TOP_K, STEPS = 32, 32, 4, 2, 3
UNREACHED = EXPERTS - 1  #: the router never picks it
FAMILY = NVFP4.rounding_family


class Experts(nn.Module):
    """Fused experts as transformers lays them out: ``gate_up_proj[e]`` is ``[2I, H]`` (gate rows, then up rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTERMEDIATE, WIDTH) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, WIDTH, INTERMEDIATE) * 0.2)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(EXPERTS):
            chosen = top_k_index == expert
            tokens = chosen.any(dim=-1)
            if tokens.any():
                activated = self._apply_gate(nn.functional.linear(hidden_states[tokens], self.gate_up_proj[expert]))
                weight = (top_k_weights * chosen).sum(dim=-1)[tokens, None]
                out[tokens] += weight * nn.functional.linear(activated, self.down_proj[expert])
        return out


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, WIDTH)
        logits = self.gate(flat)
        logits[:, UNREACHED] = float("-inf")
        weights, index = torch.topk(logits.softmax(dim=-1), TOP_K)
        return self.experts(flat, index, weights).reshape(hidden.shape)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Moe()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(hidden)


def _keys(layer: int, expert: int) -> dict[str, list[str]]:
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    return {f"{prefix}.gate_up_proj": [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"],
            f"{prefix}.down_proj": [f"{prefix}.down_proj.weight"]}


def _selection(layers: int) -> ServingSelection:
    experts = {key: unit for layer in range(layers) for expert in range(EXPERTS)
               for unit, keys in _keys(layer, expert).items() for key in keys}
    return ServingSelection(format="nvfp4", experts=experts)


def _routed(layer: Layer, inputs: list[torch.Tensor], expert: int) -> torch.Tensor:
    flat = torch.cat([hidden.reshape(-1, WIDTH) for hidden in inputs])
    logits = layer.mlp.gate(flat)
    logits[:, UNREACHED] = float("-inf")
    _, index = torch.topk(logits.softmax(dim=-1), TOP_K)
    return flat[(index == expert).any(dim=-1)]


def _expected(layer: Layer, inputs: list[torch.Tensor]) -> dict[int, dict[str, tuple[torch.Tensor, ...]]]:
    """Each reached expert's matrices as GPTQ rounds them on ``inputs``, from the library functions."""
    experts = layer.mlp.experts
    result = {}
    for expert in range(EXPERTS):
        x = _routed(layer, inputs, expert)
        if not len(x):
            continue
        gate_up, down = experts.gate_up_proj[expert].detach(), experts.down_proj[expert].detach()
        activated = experts._apply_gate(nn.functional.linear(x, gate_up))
        result[expert] = {}
        for names, weight, rows in ((("gate_proj", "up_proj"), gate_up, x), (("down_proj",), down, activated)):
            hessian = HessianAccumulator(weight.shape[1])
            hessian.add(rows)
            amax = float(weight.abs().max())
            for name, part in zip(names, weight.chunk(len(names)), strict=True):
                _, scale, scale_global = quantize_nvfp4(part, amax, scale_search="four_over_six")
                codes = gptq_codes(part, hessian.matrix, scale, scale_global, act_order=True)
                result[expert][name] = (codes, scale, scale_global)
    return result


def _stored(rounding: GptqRounding, key: str) -> list[torch.Tensor]:
    with safe_open(rounding.directory / rounding.rounded[FAMILY][key], "pt") as handle:
        return [handle.get_tensor(f"{key}:{part}") for part in ROUNDED_TENSORS]


@pytest.fixture
def walked(tmp_path):
    torch.manual_seed(0)
    layers = [Layer(), Layer()]
    inputs = [torch.randn(4, 16, WIDTH) * torch.linspace(0.1, 3.0, WIDTH) for _ in range(STEPS)]
    weights = [{name: tensor.clone() for name, tensor in layer.state_dict().items()} for layer in layers]
    rounding = GptqRounding([(NVFP4.with_scale_search("four_over_six"), _selection(2))], tmp_path / "rounded",
                            torch.float32, block_scales="four_over_six")
    with torch.no_grad():
        walk_layers(layers, inputs, rounding)
    return layers, inputs, weights, rounding


def _rounded_copy(layer: Layer, expected: dict[int, dict[str, tuple[torch.Tensor, ...]]]) -> Layer:
    """``layer`` with its reached experts' matrices as rounded (an unreached one as it is: not seen by the stream)."""
    copy = Layer()
    copy.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for expert, matrices in expected.items():
            copy.mlp.experts.gate_up_proj[expert] = torch.cat(
                [dequantize_codes(*matrices[name]) for name in ("gate_proj", "up_proj")])
            copy.mlp.experts.down_proj[expert] = dequantize_codes(*matrices["down_proj"])
    return copy


def test_each_reached_expert_holds_gptq_codes_from_its_own_tokens_on_the_rounded_stream(walked):
    layers, inputs, _, rounding = walked
    with torch.no_grad():
        first = _expected(layers[0], inputs)
        stream = [_rounded_copy(layers[0], first)(hidden) for hidden in inputs]
        second = _expected(layers[1], stream)
    assert sorted(first) == sorted(second) == [e for e in range(EXPERTS) if e != UNREACHED]
    for index, expected in enumerate((first, second)):
        for expert, matrices in expected.items():
            for name, (codes, scale, scale_global) in matrices.items():
                key = f"model.layers.{index}.mlp.experts.{expert}.{name}.weight"
                packed, stored_scale, stored_global = _stored(rounding, key)
                assert torch.equal(packed, pack_e2m1_codes(codes)), key
                assert torch.equal(stored_scale.view(torch.uint8), scale.view(torch.uint8)), key
                assert torch.equal(stored_global, scale_global), key
    # gate and up share the unit's global scale; GPTQ moved codes off nearest rounding
    gate, up = (_stored(rounding, f"model.layers.0.mlp.experts.0.{name}.weight") for name in ("gate_proj", "up_proj"))
    assert torch.equal(gate[2], up[2])
    weight = layers[0].mlp.experts.gate_up_proj[0].detach()
    assert not torch.equal(gate[0], quantize_nvfp4(weight.chunk(2)[0], float(weight.abs().max()),
                                                   scale_search="four_over_six")[0])


def test_an_unreached_expert_is_left_to_nearest_rounding_and_the_weights_stay(walked):
    layers, _, weights, rounding = walked
    stored = set(rounding.rounded[FAMILY])
    unreached = {key for layer in range(2) for keys in _keys(layer, UNREACHED).values() for key in keys}
    assert stored == set(_selection(2).experts) - unreached
    assert rounding.summary()["weights"] == {FAMILY: len(stored)}
    for layer, before in zip(layers, weights, strict=True):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, before[name]), name


def test_an_experts_module_min_sqnr_db_keeps_is_left_out_whole(tmp_path):
    torch.manual_seed(0)
    layer = Layer()
    inputs = [torch.randn(4, 16, WIDTH) for _ in range(STEPS)]
    kept = "model.layers.0.mlp.experts.1.down_proj"
    rounding = GptqRounding([(NVFP4, _selection(1))], tmp_path / "rounded", torch.float32,
                            stays_high_precision=lambda path: path == kept)
    with torch.no_grad():
        walk_layers([layer], inputs, rounding)
    assert rounding.rounded[FAMILY] == {}
