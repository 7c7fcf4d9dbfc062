"""The fp32 emulation of a bf16 layer rounds each tensor once: the values are those of rounding at every leaf."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from converters.calibration.compute import emulating


def _round_everywhere(layer: nn.Module, storage: torch.dtype) -> list:
    """The definition: every floating-point input and output of every leaf module rounded to ``storage``."""
    def round_value(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(storage).to(value.dtype)
        if isinstance(value, tuple):
            return tuple(round_value(item) for item in value)
        return value

    handles = []
    for module in layer.modules():
        if next(module.children(), None) is None:
            handles.append(module.register_forward_pre_hook(lambda _m, args: round_value(args)))
            handles.append(module.register_forward_hook(lambda _m, _a, out: round_value(out)))
    return handles


def _linear_inputs(layer: nn.Module) -> tuple[dict[str, list[torch.Tensor]], list]:
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [module.register_forward_hook(lambda _m, args, _o, name=name: seen.setdefault(name, []).append(
        args[0].clone())) for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
    return seen, handles


def _run(layer: nn.Module, inputs: list[tuple], once: bool) -> tuple[list[torch.Tensor], dict]:
    layer = layer.float() if not once else layer
    outputs = []
    if once:
        with emulating(layer, torch.bfloat16, torch.float32):
            seen, handles = _linear_inputs(layer)
            for args, kwargs in inputs:
                outputs.append(layer(*args, **kwargs))
    else:
        rounding = _round_everywhere(layer, torch.bfloat16)
        seen, handles = _linear_inputs(layer)
        for args, kwargs in inputs:
            outputs.append(layer(*args, **kwargs))
        handles += rounding
    for handle in handles:
        handle.remove()
    return [out[0] if isinstance(out, tuple) else out for out in outputs], seen


def test_a_llama_layer_in_fp32_is_bitwise_the_round_at_every_leaf_definition():
    config = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).eval()
    for parameter in layer.parameters():  # trained-like ranges: norms away from one
        parameter.data.normal_(1.0 if parameter.dim() == 1 else 0.0, 0.3 if parameter.dim() == 1 else 0.05)
    rotary = LlamaRotaryEmbedding(config)
    inputs = []
    for step in range(3):
        hidden = (torch.randn(2, 16, 128) * (1 + step)).to(torch.bfloat16).float()
        position = rotary(hidden, torch.arange(16).unsqueeze(0))
        inputs.append(((hidden,), {"position_embeddings": position, "attention_mask": None}))
    reference = LlamaDecoderLayer(config, layer_idx=0)
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        expected, expected_inputs = _run(reference.eval(), inputs, once=False)
        got, got_inputs = _run(layer, inputs, once=True)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert set(got_inputs) == set(expected_inputs) and len(got_inputs) == 7
    for name in expected_inputs:
        assert all(torch.equal(a, b) for a, b in zip(got_inputs[name], expected_inputs[name], strict=True)), name
    # the Linears see bf16 values (the emulation rounded them), not raw fp32 ones
    assert all(torch.equal(t, t.to(torch.bfloat16).float()) for ts in got_inputs.values() for t in ts)


class _ChangesInPlace(nn.Module):
    """A leaf's output changed in place before the next leaf takes it: it must be rounded again."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 32, bias=False)
        self.second = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        y = self.first(x)
        y.mul_(1.0 + 2.0 ** -12)  # moves most values off the bf16 grid
        return self.second(y)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_in_place_change_after_rounding_is_rounded_again(seed):
    torch.manual_seed(seed)
    module = _ChangesInPlace().to(torch.bfloat16).eval()
    reference = _ChangesInPlace().eval()
    reference.load_state_dict(module.state_dict())
    inputs = [((torch.randn(8, 32).to(torch.bfloat16).float(),), {})]
    with torch.no_grad():
        expected, expected_inputs = _run(reference, inputs, once=False)
        got, got_inputs = _run(module, inputs, once=True)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got_inputs["second"][0], expected_inputs["second"][0])
    assert torch.equal(got_inputs["second"][0], got_inputs["second"][0].to(torch.bfloat16).float())
