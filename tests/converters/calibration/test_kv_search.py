"""The FP8 KV-cache clipping search: E4M3 storage as the engines do it, and a scale never worse than amax/448 by the
attention output's error, on constructed outliers and on the real SmolLM2-135M."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from converters.calibration.batches import calibration_batches
from converters.calibration.kv_cache import recording_kv_amax
from converters.calibration.kv_search import CLIP_RATIOS, KvStep, fake_quantize_e4m3, search_kv_scales
from converters.quality.held_out import calibration_part


def test_e4m3_storage_saturates_at_448_and_rounds_like_the_cast():
    x = torch.tensor([0.1, -3.3, 17.0, 447.0, 1000.0, -1e6, 0.0])
    stored = fake_quantize_e4m3(x, 1.0)
    assert torch.isfinite(stored).all()  # out of range saturates (vLLM's kernels do), never NaN
    assert stored[4].item() == 448.0 and stored[5].item() == -448.0
    in_range = x[:4]
    assert torch.equal(fake_quantize_e4m3(in_range, 0.5), (in_range / 0.5).to(torch.float8_e4m3fn).float() * 0.5)
    assert fake_quantize_e4m3(x.to(torch.bfloat16), 2.0).dtype == torch.bfloat16  # read back in the input's dtype


class _Module(torch.nn.Module):
    """What sdpa_attention_forward reads from an attention module."""

    is_causal = True
    num_key_value_groups = 1


def _attend(q, k, v):
    return sdpa_attention_forward(_Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5)[0]


def test_a_key_outlier_the_queries_do_not_read_is_clipped_and_the_error_drops():
    # One token's key is 1e5 in a channel every query multiplies by 0: at amax/448 the ordinary keys (about 1)
    # fall below E4M3's smallest normal and lose most of their bits; a clipped scale keeps more of them and costs
    # nothing, since no logit reads the clipped channel.
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 32, 16, generator=generator)
    query[..., 0] = 0
    key = torch.randn(2, 2, 32, 16, generator=generator)
    key[0, 0, 5, 0] = 1e5
    value = torch.randn(2, 2, 32, 16, generator=generator)
    steps = [KvStep(query, key, value, _attend)]
    found = search_kv_scales(steps, float(key.abs().max()), float(value.abs().max()))
    assert found.key_ratio < 1.0 and found.key_ratio in CLIP_RATIOS
    assert found.key_errors[CLIP_RATIOS.index(found.key_ratio)] < found.key_errors[0]
    assert found.error_chosen < found.error_at_amax
    assert found.steps == 1


def test_a_scale_that_does_not_help_is_not_taken():
    # keys and values spread over E4M3's normal range: every clipping only adds saturation error
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(3))
    key[0, 0, 3, :] = 40.0  # a token every query reads hard: clipping it moves the softmax
    found = search_kv_scales([KvStep(query, key, value, _attend)], float(key.abs().max()), float(value.abs().max()))
    assert found.error_chosen <= found.error_at_amax
    assert found.key_ratio == 1.0 or found.key_errors[CLIP_RATIOS.index(found.key_ratio)] < found.key_errors[0]


def test_the_search_refuses_no_steps_and_bad_ratios():
    with pytest.raises(ValueError, match="at least one"):
        search_kv_scales([], 1.0, 1.0)
    step = KvStep(*(torch.ones(1, 1, 2, 4) for _ in range(3)), _attend)
    with pytest.raises(ValueError, match="start at 1.0"):
        search_kv_scales([step], 1.0, 1.0, ratios=(0.5, 1.0))


@pytest.mark.slow  # the real SmolLM2-135M, every layer's KV search
def test_on_smollm2_every_layer_s_searched_scales_are_finite_positive_and_no_worse_than_amax():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.converters.quality.smollm import smollm_dir

    directory = smollm_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # float32 holds the bf16 checkpoint exactly and runs several times faster on a CPU without bf16 GEMMs
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
    # Two steps, so the ratio is fitted on one and checked on the other; 64 tokens each: the claims hold for any
    # token count, the search's cost grows with it (with batches of 2 x 128 tokens no layer clipped, with 1 x 64
    # two do, so the clipped branch of the last assertion is reached too).
    batches, _ = calibration_batches(tokenizer, vocab_size=model.config.vocab_size, texts=calibration_part(),
                                     steps=2, batch_size=1, seq_len=64)
    with torch.no_grad(), recording_kv_amax(model) as recorder:
        for batch in batches:
            model(**batch)
        results = recorder.results()
    assert len(results) == model.config.num_hidden_layers
    for path, layer in results.items():
        found = layer.search
        assert found is not None and found.steps == len(batches), path
        assert math.isfinite(layer.key_clip) and math.isfinite(layer.value_clip), path
        assert 0 < layer.key_clip <= layer.key_amax and 0 < layer.value_clip <= layer.value_amax, path
        assert 0 <= found.error_chosen <= found.error_at_amax, path
        ratios = (found.key_ratio, found.value_ratio)
        assert ratios == (1.0, 1.0) or found.error_chosen < found.error_at_amax, path  # clipped only where it helps
