"""The real trained SmolLM2-135M-Instruct (tests/converters/quality/smollm.py) in vLLM's CPU build: one conversion
job with ``kv_cache: "fp8"`` writes the three formats the CPU build runs; vLLM loads each as written (the checks
of tests/engines/engine.py: every tensor at its parameter, every attention layer's KV scales from the file, each
FP8 weight the source's within FP8 rounding), the audit passes it, and its perplexity on held-out text stays near
the bf16 source's in the same engine (benchmarks/bench_engine.py measures it on more tokens).

A deliberately broken copy of the static export, every KV scale written as its inverse (448 / amax, the classic slip),
loads as written and passes the audit (neither reads values); with an FP8 cache only the engine's perplexity shows it
(NaN on an AMX CPU).

vLLM's CPU attention keeps an FP8 KV cache only on x86 with AVX-512 or AMX (``cpu_attn._get_attn_isa`` raises
"FP8 KV cache on CPU requires x86 with AVX-512 or AMX"; the AVX2 build of its kernels has no FP8 cache case): on
an AVX2-only CPU the exports run with ``kv_cache_dtype="bfloat16"`` (their KV scales loaded, unused; "auto" would
take the export's kv_cache_scheme and ask for the FP8 cache).

vLLM runs in its own venv: ``make vllm-venv`` builds it; without it these tests skip and say so.
"""

from __future__ import annotations

import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from converters.api import local_sources
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.quality import held_out_part
from converters.serving.audit import audit_export
from tests.converters.quality.smollm import smollm_dir
from tests.engines.engine import KV_CACHE, EngineRequest, fidelity_problems, load_problems, run_vllm, vllm_missing

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))

RUNNABLE = ("compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "modelopt-fp8")
CALIBRATION = CalibrationSettings(steps=2, batch_size=1, seq_len=64)
TOKENS = 128
#: the most a trained 135M model's perplexity may grow with FP8 weights, activations and KV cache on 128 tokens:
#: vLLM measured at most +11.5% on 512 positions (fp8forge static + FP8 KV); a scale off by
#: 2x or a dropped KV scale costs far more
MAX_RATIO = 1.25
BROKEN = "kv-scales-inverted"
#: tokens generated after the 16-token prompt: the prompt pass fills the KV cache and each later step reads it back
GENERATED = 2


def invert_kv_scales(export, into):
    """A copy of ``export`` whose every k/v scale is 1 / its value: keys and values land on E4M3's subnormals."""
    broken = shutil.copytree(export, into)
    tensors = load_file(broken / "model.safetensors")
    for name in [name for name in tensors if name.endswith(("k_scale", "v_scale"))]:
        tensors[name] = 1 / tensors[name]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


@pytest.fixture(scope="module")
def model_dir():
    return smollm_dir()


@pytest.fixture(scope="module")
def exports(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm-engine")
    request = ConversionRequest(model=str(model_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                serving_formats=RUNNABLE, kv_cache="fp8", measure=False)
    result = run_conversion(request, work / "out", local_sources(model_dir.parent, work))
    exports = {fmt: result.out_dir / "serving" / fmt for fmt in RUNNABLE}
    exports[BROKEN] = invert_kv_scales(exports[RUNNABLE[0]], work / BROKEN)
    return exports


@pytest.fixture(scope="module")
def engine(model_dir, exports, tmp_path_factory):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(held_out_part()[0])["input_ids"][:TOKENS + 1]
    prompt = {"generate": [ids[:16]], "max_tokens": GENERATED}
    requests = [EngineRequest(model=model_dir, score=[ids], dump=False, **prompt)]
    requests += [EngineRequest(model=exports[fmt], kv_cache_dtype=KV_CACHE, score=[ids], **prompt) for fmt in RUNNABLE]
    names = ["source", *RUNNABLE]
    if KV_CACHE == "fp8":  # only an FP8 cache reads the inverted scales (the test below skips without one)
        requests.append(EngineRequest(model=exports[BROKEN], kv_cache_dtype=KV_CACHE, score=[ids]))
        names.append(BROKEN)
    runs = run_vllm(requests, tmp_path_factory.mktemp("vllm"))
    return dict(zip(names, runs, strict=True))


@pytest.mark.parametrize("fmt", RUNNABLE)
def test_vllm_runs_the_real_model_export_as_written(model_dir, exports, engine, fmt):
    run, source = engine[fmt], engine["source"]
    assert source.error is None and run.error is None
    assert load_problems(exports[fmt], run) == []
    assert fidelity_problems(model_dir, run) == []
    assert audit_export(exports[fmt]).ok
    assert len(run.generated[0]) == GENERATED
    assert {scales["kv_cache_dtype"] for scales in run.attention.values()} == {KV_CACHE}
    assert len(run.attention) == 30
    # a trained model: the source predicts held-out text (a random one scores ~49152) and FP8 stays near it
    assert 5 < source.perplexity < 100
    assert 1 / MAX_RATIO < run.perplexity / source.perplexity < MAX_RATIO


def test_inverted_kv_scales_load_as_written_and_only_the_fp8_cache_shows_them(exports, engine):
    if KV_CACHE != "fp8":
        pytest.skip("vLLM's CPU build runs no FP8 KV cache on this CPU (AVX2 only): the KV scales are never read")
    run, source = engine[BROKEN], engine["source"]
    assert run.error is None
    assert load_problems(exports[BROKEN], run) == []
    assert audit_export(exports[BROKEN]).ok
    # NaN on an AMX CPU: the inverted v_scales exceed 256 and the amx kernel's folded 2^120 * v_scale overflows fp32
    # (tests/engines/test_vllm_kv_cache.py); elsewhere every value lands on E4M3's subnormals
    ratio = run.perplexity / source.perplexity
    assert math.isnan(ratio) or ratio > MAX_RATIO
