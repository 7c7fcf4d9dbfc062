"""vLLM's CPU FP8 KV cache is the quality pass's ``truncate`` emulation, and nothing more: its attention kernels
(``amx`` on a CPU with AMX tiles, ``vec`` on AVX-512), fed a prompt's queries, keys and values, give the output that
the keys and values cast by ``converters.quality.kv_cache.fake_quantize_kv(..., TRUNCATE)`` give in a plain fp32
attention, to the kernels' own bf16 noise; the CUDA rounding (``NEAREST``) is measurably further from them.

What this pins (read in vLLM's csrc/cpu/cpu_attn_fp8.hpp and cpu_attn_amx.hpp, measured here): the cache stores
``x * (1 / scale)`` clamped to 448 with the mantissa truncated; the query stays in 16 bits (no FP8 query); the
AMX kernel dequantizes codes to bf16 as ``code * 2^-120`` and folds ``2^120 * k_scale`` into the logits' scale and
``v_scale`` into the output; the softmax is fp32. If the emulation dropped the truncation, or the kernel began to
do more (an FP8 query, FP8 probabilities, scales applied as their inverse), the first assertion fails.

vLLM runs in its own venv (``make vllm-venv``); without it, or on a CPU whose vLLM build keeps no FP8 cache (AVX2
only), these tests skip and say so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from converters.quality import KV_ROUNDING_NEAREST, KV_ROUNDING_TRUNCATE
from converters.quality.kv_cache import fake_quantize_kv
from tests.engines.engine import KV_CACHE, attend_in_vllm, vllm_missing

pytestmark = [pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
              pytest.mark.skipif(KV_CACHE != "fp8", reason="vLLM's CPU build keeps an FP8 KV cache only with AVX-512 "
                                                           "or AMX; this CPU has neither")]

#: the kernel families this CPU runs (vLLM picks amx where it can; vec is what an AVX-512 CPU without AMX runs)
ISAS = tuple(isa for isa, present in (("amx", torch.cpu._is_amx_tile_supported()),
                                      ("vec", torch.cpu._is_avx512_supported())) if present)
#: SmolLM2-135M's attention shape: 9 query heads over 3 KV heads of 64; one prompt of 96 tokens (one cache block)
TOKENS, HEADS, KV_HEADS, HEAD_DIM = 96, 9, 3, 64
#: the kernels' own noise against fp32 attention over the same inputs (bf16 operands and output): ~0.2%
KERNEL_NOISE = 0.01


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found.float() - expected).norm() / expected.norm())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention, ``[tokens, heads, head_dim]`` in and out, GQA as vLLM groups heads."""
    q, k, v = (x.float().transpose(0, 1)[None] for x in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


@pytest.fixture(scope="module")
def prompt():
    """Queries, keys and values shaped like a trained model's: a few key channels far larger than the rest (what
    RoPE'd keys look like), values small; scales amax / 448 in bf16, as an export writes them."""
    generator = torch.Generator().manual_seed(0)
    channel_size = torch.rand(HEAD_DIM, generator=generator) * 3 + 0.2
    channel_size[:4] = 12.0
    query = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=generator) * channel_size / 4
    key = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator) * channel_size
    value = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator) * 0.3
    query, key, value = (x.bfloat16() for x in (query, key, value))
    k_scale, v_scale = (float((x.float().abs().amax() / 448).bfloat16()) for x in (key, value))
    return query, key, value, k_scale, v_scale


#: both kernel families present: the amx kernels' behaviour at scales an export would only write by mistake is shown
AMX_AND_VEC = {"amx", "vec"} <= set(ISAS)


def subnormal_v_scale(prompt) -> float:
    """A v_scale that makes every value's code subnormal (at most 2^-7)."""
    return float(prompt[2].float().abs().amax()) * 128


@pytest.fixture(scope="module")
def engine(prompt, tmp_path_factory):
    """(case, isa) -> the kernel's output, every case in one vLLM process: ``written``, the prompt's own scales, on
    every kernel family of this CPU; with AMX and AVX-512, ``subnormal`` (v_scale = subnormal_v_scale) on both and
    ``overflow`` (v_scale = 256) on amx."""
    query, key, value, k_scale, v_scale = prompt
    cases = {"written": (k_scale, v_scale, ISAS)}
    if AMX_AND_VEC:
        cases["subnormal"] = (k_scale, subnormal_v_scale(prompt), ("amx", "vec"))
        cases["overflow"] = (k_scale, 256.0, ("amx",))
    return attend_in_vllm(query, key, value, cases=cases, work=tmp_path_factory.mktemp("vllm-attention"))


def emulated(prompt, rounding: str) -> torch.Tensor:
    query, key, value, k_scale, v_scale = prompt
    # read back in fp32, as the quality pass runs a layer: the kernel multiplies the codes and folds the scales in
    # later, so a bf16 ``code * scale`` would add a rounding it does not do
    return attention(query, fake_quantize_kv(key.float(), k_scale, rounding),
                     fake_quantize_kv(value.float(), v_scale, rounding))


@pytest.mark.parametrize("isa", ISAS)
def test_the_cpu_fp8_cache_is_the_truncating_emulation(prompt, engine, isa):
    output = engine["written", isa]
    truncated = relative_error(output, emulated(prompt, KV_ROUNDING_TRUNCATE))
    nearest = relative_error(output, emulated(prompt, KV_ROUNDING_NEAREST))
    unquantized = relative_error(output, attention(*prompt[:3]))
    assert truncated < KERNEL_NOISE, f"{isa}: the emulation is {truncated:.2%} from the kernel"
    # the test can tell: neither the CUDA rounding nor no FP8 at all is within the kernel's noise
    assert nearest > 3 * truncated and nearest > KERNEL_NOISE
    assert unquantized > 3 * truncated and unquantized > KERNEL_NOISE


@pytest.mark.skipif(not AMX_AND_VEC, reason="needs a CPU with AMX (vLLM's amx kernels) and AVX-512")
def test_the_amx_kernel_reads_subnormal_codes_as_zero_and_overflows_on_scales_of_256(prompt, engine):
    """What the amx kernels do beyond the truncating cast, at scales an export would only write by mistake: they
    hand AMX each code as bf16 ``code * 2^-120``, so E4M3's subnormal codes become bf16 subnormals, which AMX's bf16
    dot product reads as zero; and the ``2^120 * scale`` they fold back overflows fp32 from a scale of 256 up (NaN).
    The vec kernels read both right. At amax / 448 the subnormal codes are the values below amax / 28672: no
    measurable effect on SmolLM2 (docs/benchmarks/engine-2026-12-03d.md)."""
    query, key, value, k_scale, _ = prompt
    assert float(engine["subnormal", "amx"].float().abs().max()) == 0
    truncated = attention(query, fake_quantize_kv(key.float(), k_scale, KV_ROUNDING_TRUNCATE),
                          fake_quantize_kv(value.float(), subnormal_v_scale(prompt), KV_ROUNDING_TRUNCATE))
    assert relative_error(engine["subnormal", "vec"], truncated) < KERNEL_NOISE
    assert engine["overflow", "amx"].isnan().any()
