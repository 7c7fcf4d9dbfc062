"""The quality pass computes in the serving engine's dtypes: activations in the checkpoint's bf16 between the
GEMMs, GEMMs in fp32 rounded to bf16, logits in bf16, an FP8 Linear as vLLM's per-token kernel.

The reference here is the whole bf16 model as vLLM runs it, written out independently of the pass: every Linear
``F.linear`` of the fp32-upcast operands rounded to bf16 (a bf16 GEMM accumulating in fp32), each quantized one
vLLM's ``ChannelWiseTorchFP8ScaledMMLinearKernel`` (each token cast to E4M3 with its amax / 448, an fp32 GEMM of
the dequantized operands, rounded to bf16; the kernel's own order of fp32 roundings is test_engine_arithmetic.py's
subject), the head's logits
bf16, log-probabilities in fp32. Calibration's fp32 emulation of a bf16 model (fp32 between the leaf modules)
gives other figures on the same model (the last test): a pass that went back to it fails here.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from converters.calibration.compute import emulating
from converters.casts.emulation import cast_spec, fake_quantize
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from converters.quality import LayerCast, load_source, measure_qualities
from converters.quality.arithmetic import engine_arithmetic

E4M3_MAX = 448.0
PER_TOKEN = cast_spec("e4m3_row")
TEXTS = ["The harbor town woke slowly on the first cold morning of autumn, and the gulls argued over the boats.",
         "Delayed scaling derives the scale of this step from the amax history of earlier steps, one per tensor."]


def _per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A compressed-tensors FP8_DYNAMIC weight: E4M3 codes and a bf16 scale per output channel (amax / 448)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    codes = (weight.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def _quantized(directory, paths):
    model = load_model(directory, ModelSourceOptions())
    return {path: _per_channel(model.get_submodule(path).weight.detach()) for path in paths}


class _EngineLinear:
    """A Linear as the engine runs it on bf16 activations (``fp8``: the codes and scales of the per-token kernel)."""

    def __init__(self, module: nn.Linear, fp8: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.module, self.fp8 = module, fp8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.module.bias.float() if self.module.bias is not None else None
        if self.fp8 is None:
            return nn.functional.linear(x.float(), self.module.weight.float(), bias).to(x.dtype)
        codes, w_scale = self.fp8
        # the per-token cast and the fp32 GEMM of the dequantized operands: vLLM's kernel up to fp32 roundings (its
        # scales are applied after the GEMM, x / (amax / 448) where the cast multiplies by 448 / amax), which
        # test_engine_arithmetic.py bounds; a bf16 output shows them in about one element in 10^4, and this tiny
        # random model (hidden states of ~0.02 between its norms) amplifies them, so they are left out here
        flat = fake_quantize(x.reshape(-1, x.shape[-1]).float(), PER_TOKEN)
        out = nn.functional.linear(flat, codes.float() * w_scale.float(), bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])


def _engine_nll(directory, quantized, texts, *, fp32_between: bool = False):
    """The per-position NLL of the reference and of the quantized model, whole-model forwards as the engine
    computes them (``fp32_between``: with the model in fp32 rounded at its leaf modules instead, as calibration
    emulates a bf16 model)."""
    model = load_model(directory, ModelSourceOptions())
    context = (lambda: emulating(model, torch.bfloat16, torch.float32)) if fp32_between else contextlib.nullcontext
    tokenizer = load_tokenizer(directory, ModelSourceOptions())
    linears = {path: module for path, module in model.named_modules() if isinstance(module, nn.Linear)}
    out = {"reference": [], "fp8": []}
    for name, fp8 in (("reference", {}), ("fp8", quantized)):
        for path, module in linears.items():
            module.forward = _EngineLinear(module, fp8.get(path))
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            with torch.no_grad(), context():
                logits = model(input_ids=ids).logits[0, :-1].to(torch.bfloat16)
            out[name].append(-logits.float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0])
    return {name: torch.cat(values) for name, values in out.items()}


def _pass_figures(directory, quantized, texts):
    casts = {path: LayerCast(read_weight=lambda dtype, codes=codes, scale=scale: (codes.float() * scale.float())
                             .to(dtype), input=cast_spec("e4m3_row"))
             for path, (codes, scale) in quantized.items()}
    return measure_qualities(load_source(directory), {"fp8": casts}, texts)["fp8"]


@pytest.fixture(scope="module")
def engine(llama_dir):
    source = load_source(llama_dir)
    paths = [path for path, module in source.model.named_modules()
             if isinstance(module, nn.Linear) and path != "lm_head"]
    quantized = _quantized(llama_dir, paths)
    return quantized, _engine_nll(llama_dir, quantized, TEXTS)


def test_the_pass_scores_what_the_engine_computes(llama_dir, engine):
    quantized, nll = engine
    figures = _pass_figures(llama_dir, quantized, TEXTS)
    assert figures.tokens == nll["fp8"].numel()
    # the same operations in the same dtypes: the same logits (measured: equal position by position), summed in
    # another order
    assert figures.perplexity_reference == pytest.approx(math.exp(float(nll["reference"].double().mean())), rel=1e-9)
    assert figures.perplexity == pytest.approx(math.exp(float(nll["fp8"].double().mean())), rel=1e-9)
    assert figures.perplexity != figures.perplexity_reference


def test_inside_engine_arithmetic_only_the_gemms_run_in_fp32():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.LayerNorm(32)).to(torch.bfloat16)
    seen = []
    layer[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    weight, bias = layer[0].weight.float(), layer[0].bias.float()
    with torch.no_grad(), engine_arithmetic(layer, torch.bfloat16):
        out = layer(x)
        gemm = layer[0](x)
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16 and layer[2].weight.dtype == torch.bfloat16
    assert layer[0].weight.dtype == torch.float32
    assert torch.equal(gemm, nn.functional.linear(x.float(), weight, bias).to(torch.bfloat16))


def test_fp32_between_the_gemms_is_another_model(llama_dir, engine):
    """Calibration's stand-in for a bf16 layer (the model in fp32, rounded to bf16 at each leaf module) scores
    other figures on the same casts: the first test's tolerance tells the two apart."""
    quantized, nll = engine
    emulated = _engine_nll(llama_dir, quantized, TEXTS, fp32_between=True)
    figures = _pass_figures(llama_dir, quantized, TEXTS)
    assert abs(figures.perplexity / math.exp(float(emulated["fp8"].double().mean())) - 1) > 1e-6
