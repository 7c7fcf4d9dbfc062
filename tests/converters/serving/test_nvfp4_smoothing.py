"""NVFP4 W4A4 smoothing scales (nvfp4_smoothing): chosen by the output error they leave, never worse than no scaling,
lower where a few input channels dominate, and folded so that the high-precision model computes the same function."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from converters.casts.emulation import cast_spec, fake_quantize
from converters.serving.nvfp4 import quantize_nvfp4
from converters.serving.nvfp4_search import dequantize_nvfp4
from converters.serving.nvfp4_smoothing import SearchShare, candidate_scales, fold_scales, search_smoothing
from tests.converters.serving.test_nvfp4_scale_search import trained_like_weight


def outlier_channels(tokens: int = 256, columns: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations with a few channels 30x the others on every token, as a trained model's norm outputs have."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, columns, generator=generator)
    x[:, [3, 40, 77, 101]] *= 30
    return x.to(torch.bfloat16)


def w4a4_error(x: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor | None) -> float:
    """The group's W4A4 output error computed here from the pieces: each weight scaled, rounded to bf16 and to
    NVFP4 under the group's global scale; the input divided and cast per 16-block under its own amax."""
    x = x.float()
    scaled_x = x if scales is None else x / scales
    scaled = [w if scales is None else (w.float() * scales).to(w.dtype) for w in weights]
    amax = max(float(w.float().abs().max()) for w in scaled)
    cast = fake_quantize(scaled_x, cast_spec("nvfp4_block16"), tensor_amax=scaled_x.abs().max())
    return sum(float((x @ w.float().T - cast @ dequantize_nvfp4(*quantize_nvfp4(s, amax)).T).square().sum())
               for w, s in zip(weights, scaled, strict=True))


@pytest.mark.parametrize("seed", [0, 1])
def test_outlier_channels_are_smoothed_and_the_reported_errors_are_the_tensors_own(seed):
    weights = [trained_like_weight(rows=rows, columns=128, seed=seed + rows) for rows in (64, 32, 32)]  # q/k/v
    x = outlier_channels(seed=seed)
    choice = search_smoothing(weights, x)
    assert choice.scales is not None and 0 <= choice.ratio < 1
    assert choice.plain_error == pytest.approx(w4a4_error(x, weights, None), rel=1e-5)
    assert choice.error == pytest.approx(w4a4_error(x, weights, choice.scales), rel=1e-5)
    assert choice.relative_error < 0.9
    # the outlier channels are divided down the most
    assert set(choice.scales.topk(4).indices.tolist()) == {3, 40, 77, 101}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_sharing_the_candidates_choose_what_one_process_chooses(world_size):
    weights = [trained_like_weight(rows=rows, columns=128, seed=7 + rows) for rows in (64, 32)]
    x = outlier_channels(seed=2)
    alone = search_smoothing(weights, x)
    scored: dict[int, dict[int, float]] = {}

    class Scored(Exception):
        pass

    def keep(rank):  # a rank other than the last: its scores kept, its search stopped there
        def combine(errors):
            scored[rank] = errors
            raise Scored
        return combine

    for rank in range(1, world_size):
        with pytest.raises(Scored):
            search_smoothing(weights, x, share=SearchShare(rank=rank, world_size=world_size, combine=keep(rank)))
    seen = []

    def merged(errors):
        seen.append(sorted(errors))
        return {k: error for part in (errors, *scored.values()) for k, error in part.items()}

    shared = search_smoothing(weights, x, share=SearchShare(rank=0, world_size=world_size, combine=merged))
    assert seen == [list(range(-1, 20))[::world_size]]  # rank 0 scored its share alone: "no scaling" among it
    assert sorted(k for part in scored.values() for k in part) == sorted(set(range(-1, 20)) - set(seen[0]))
    assert (shared.ratio, shared.error, shared.plain_error) == (alone.ratio, alone.error, alone.plain_error)
    assert shared.scales is not None and torch.equal(shared.scales, alone.scales)


def test_scaling_is_kept_off_where_no_ratio_lowers_the_error():
    # every channel alike on both sides: each candidate is s = 1 again, which is not strictly better
    weights = [(torch.randn(32, 128, generator=torch.Generator().manual_seed(5)).sign() * 0.01).to(torch.bfloat16)]
    choice = search_smoothing(weights, torch.ones(64, 128, dtype=torch.bfloat16), steps=4)
    assert choice.scales is None and choice.ratio is None
    assert choice.error == choice.plain_error > 0 and choice.relative_error == 1.0


def test_candidate_scales_are_awq_s_and_centred():
    x_mean, w_mean = torch.tensor([1.0, 4.0, 16.0]), torch.tensor([0.5, 0.5, 2.0])
    scales = candidate_scales(x_mean, w_mean, 0.5)
    raw = x_mean.sqrt() / w_mean.sqrt()
    torch.testing.assert_close(scales, raw / (raw.max() * raw.min()).sqrt())
    assert float(scales.max() * scales.min()) == pytest.approx(1.0)
    torch.testing.assert_close(candidate_scales(x_mean, torch.ones(3), 0.0), torch.ones(3))


def test_folded_scales_leave_a_llama_layer_s_function_unchanged():
    """A decoder layer in fp32 with the norms' and up's scales folded in gives the same output (fp32 rounding)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=32)
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 2.0)
    hidden = torch.randn(1, 8, 64)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(8)[None]
    embeddings = rotary(hidden, positions)

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = layer(hidden, position_embeddings=embeddings, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    before = run()
    generator = torch.Generator().manual_seed(1)
    attention, mlp = layer.self_attn, layer.mlp
    for feeder, linears in ((layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                            (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
                            (mlp.up_proj, (mlp.down_proj,))):
        scales = torch.rand(linears[0].in_features, generator=generator) * 3 + 0.25
        folded_feeder, folded = fold_scales(feeder.weight.data, [linear.weight.data for linear in linears], scales)
        feeder.weight.data = folded_feeder
        for linear, weight in zip(linears, folded, strict=True):
            linear.weight.data = weight
    torch.testing.assert_close(run(), before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda: search_smoothing([], torch.randn(8, 128)), "at least one weight"),
    (lambda: search_smoothing([torch.zeros(16, 64)], torch.randn(8, 128)), "in = x's 128"),
    (lambda: search_smoothing([torch.zeros(16, 128)], torch.randn(8, 128), steps=0), "steps must be at least 1"),
    (lambda: fold_scales(torch.ones(192, 64), [torch.ones(64, 576)], torch.ones(576)), "grouped-query attention"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
