"""NVFP4 scales chosen per fused group by the W4A4 output error on calibration inputs (nvfp4_search): never worse
than round to nearest on the tokens it scored, the error it reports is the written tensors' own, and the input
global scale moves off the calibrated amax where that lowers the error."""

from __future__ import annotations

import pytest
import torch

from converters.serving.nvfp4 import global_scale, quantize_nvfp4
from converters.serving.nvfp4_search import dequantize_nvfp4, group_output_error, search_group
from tests.converters.serving.test_nvfp4_scale_search import decompressed, trained_like_weight


def sink_inputs(tokens: int = 96, columns: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations whose first token of each 32 is 40x the rest in a few channels, as SmolLM2's first positions."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, columns, generator=generator)
    x[::32, :8] *= 40
    return x.to(torch.bfloat16)


def test_dequantize_reads_back_what_compressed_tensors_reads():
    weight = trained_like_weight(rows=32, columns=128)
    packed, scale, gparam = quantize_nvfp4(weight, float(weight.float().abs().max()), scale_search="mse")
    # compressed-tensors reads back in the weight's dtype (bf16): the fp32 values here round to its values
    torch.testing.assert_close(dequantize_nvfp4(packed, scale, gparam), decompressed(weight, packed, scale, gparam),
                               rtol=2**-8, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_choice_is_never_worse_and_its_error_is_the_written_tensors(seed):
    weights = [trained_like_weight(rows=rows, columns=128, seed=seed + rows) for rows in (48, 16, 16)]  # q/k/v
    x = sink_inputs(seed=seed)
    amax = max(float(w.float().abs().max()) for w in weights)
    input_amax = float(x.float().abs().max())
    choice = search_group(weights, x, amax, input_amax)
    written = [dequantize_nvfp4(*quantize_nvfp4(w, choice.weight_amax, scale_search=choice.method)) for w in weights]
    rtn = [dequantize_nvfp4(*quantize_nvfp4(w, amax)) for w in weights]
    assert choice.error == pytest.approx(group_output_error(x, weights, written, choice.input_amax), rel=1e-6)
    assert choice.rtn_error == pytest.approx(group_output_error(x, weights, rtn, input_amax), rel=1e-6)
    assert choice.error <= choice.rtn_error and choice.relative_error <= 1.0
    # the input global scale a file stores for the choice is compressed-tensors' arithmetic on the chosen amax
    assert global_scale(torch.tensor([choice.input_amax])).item() == pytest.approx(2688 / choice.input_amax)


def test_the_input_scale_moves_off_the_amax_where_that_lowers_the_output_error():
    weights = [trained_like_weight(rows=64, columns=128)]
    x = sink_inputs()
    input_amax = float(x.float().abs().max())
    choice = search_group(weights, x, float(weights[0].float().abs().max()), input_amax, methods=("rtn",),
                          weight_ratios=(1.0,))
    # measured: 1.1x the amax, 0.965 of RTN's error (a squared error protects the outlier tokens: no clipping)
    assert choice.method == "rtn" and choice.input_amax != input_amax
    assert choice.relative_error < 0.99


def test_weight_only_nvfp4_searches_no_input_scale():
    weights = [trained_like_weight(rows=32, columns=128)]
    choice = search_group(weights, sink_inputs(), float(weights[0].float().abs().max()), None)
    assert choice.input_amax == 0.0 and choice.method in ("rtn", "mse", "four_over_six")
    assert choice.error <= choice.rtn_error


@pytest.mark.parametrize("weights, options, message", [
    ([], {}, "at least one weight"),
    ([torch.zeros(16, 64)], {}, "in = x's 128"),
    ([torch.zeros(16, 128)], {"input_ratios": (1.0, 0.0)}, "ratios must be positive"),
    ([torch.zeros(16, 128)], {"methods": ("gptq",)}, "scale_search must be one of"),
])
def test_bad_input_is_refused(weights, options, message):
    with pytest.raises(ValueError, match=message):
        search_group(weights, torch.randn(8, 128), 1.0, 1.0, **options)


def test_weights_the_caller_already_quantized_give_the_same_choice():
    weights = [trained_like_weight(rows=32, columns=128, seed=3)]
    x, amax = sink_inputs(seed=3), float(weights[0].float().abs().max())
    known = {(method, 1.0): [dequantize_nvfp4(*quantize_nvfp4(weights[0], amax, scale_search=method))]
             for method in ("rtn", "mse")}
    assert search_group(weights, x, amax, 50.0, known=known) == search_group(weights, x, amax, 50.0)
