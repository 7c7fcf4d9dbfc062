"""A mixture-of-experts model in vLLM's CPU build: a tiny Qwen2-MoE (tests/models.py, heads of 64: the smallest
vLLM's CPU attention takes) in bf16 runs there through vLLM's own fused MoE kernel, and each FP8 / FP4 export of
one conversion job (experts quantized, ``kv_cache: "fp8"``) is loaded by vLLM's own loaders: every tensor of the
file, the per-expert weights, weight scales and input scales among them, reaches vLLM's stacked expert parameters
(``experts...w13_weight[expert, rows]``, gate and up stacked) with the file's value, and each FP8 expert weight as
vLLM would multiply it is the source's within FP8 rounding.

What vLLM's CPU build cannot do with them: it has no CPU kernel for per-tensor or per-channel FP8 experts
(``Fp8MoeBackend.CPU`` is block-scaled W8A16 and needs AMX tiles, ``CPU_W8A8`` AMX-FP8), and its MXFP8 and NVFP4
expert paths are GPU code (Triton, FlashInfer). The FP8 and MXFP8 runs stop in ``process_weights_after_loading``,
after the loaders: the driver keeps what the loaders filled (vllm_driver.py), and the test asserts that the stop is
that missing kernel and nothing else. The NVFP4 runs stop earlier, while vLLM builds the model (no weight is loaded):
for those the audit is the only check here. Where a later vLLM CPU build runs one, the test requires its generation.

A deliberately broken copy (one expert's up_proj weight scale doubled) loads as written and passes the audit; the
fidelity check catches it.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving.audit import audit_export
from tests.engines.engine import KV_CACHE, EngineRequest, fidelity_problems, load_problems, run_vllm, vllm_missing
from tests.models import save_tiny_moe

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))]

FP8 = ("compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "modelopt-fp8", "mxfp8")
FP4 = ("nvfp4", "modelopt-nvfp4")
FORMATS = FP8 + FP4
#: what vLLM raises when its CPU build has no expert kernel for the export's scheme, by format
NO_CPU_KERNEL = {**dict.fromkeys(FP8[:3], "Unsupported FP8 MoE backend: NONE"),
                 "mxfp8": "module 'triton.language' has no attribute",  # its MXFP8 MoE emulation is Triton code
                 **dict.fromkeys(FP4, "No NvFp4 MoE backend supports the deployment configuration")}
BROKEN = "expert-scale-doubled"
CALIBRATION = CalibrationSettings(steps=2, seq_len=24)
EXPERTS = 8  # tests/models.py MOE_CONFIGS["qwen2_moe"]
GENERATED = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_moe("qwen2_moe", tmp_path_factory.mktemp("moe") / "qwen2-moe", dtype="bfloat16", hidden_size=256)


@pytest.fixture(scope="module")
def exports(model_dir):
    request = ConversionRequest(model=str(model_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                serving_formats=FORMATS, kv_cache="fp8", measure=False)
    out = model_dir.parent / "out"
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(model_dir.parent,)))
    done = {fmt: out / "serving" / fmt for fmt in FORMATS}
    broken = shutil.copytree(done[FP8[0]], model_dir.parent / BROKEN)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale"] *= 2
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    done[BROKEN] = broken
    return done


@pytest.fixture(scope="module")
def engine(model_dir, exports, tmp_path_factory):
    prompt = list(range(5, 21))
    names = ["source", *FORMATS, BROKEN]
    requests = [EngineRequest(model=model_dir, generate=[prompt], max_tokens=GENERATED, score=[prompt], dump=False)]
    requests += [EngineRequest(model=exports[name], kv_cache_dtype=KV_CACHE, generate=[prompt], max_tokens=GENERATED)
                 for name in names[1:]]
    return dict(zip(names, run_vllm(requests, tmp_path_factory.mktemp("vllm")), strict=True))


def test_the_bf16_moe_source_runs_in_vllm_through_its_fused_moe_kernel(engine):
    run = engine["source"]
    assert run.error is None
    assert "UnquantizedFusedMoEMethod" in run.raw["quant_methods"]
    assert len(run.generated[0]) == GENERATED and run.perplexity > 1


@pytest.mark.parametrize("fmt", FP8)
def test_vllm_loads_every_expert_tensor_as_written(model_dir, exports, engine, fmt):
    run = engine[fmt]
    if run.error is None:  # a CPU kernel for this scheme: it generates
        assert len(run.generated[0]) == GENERATED
    else:  # stopped once the loaders had filled the model (the dump is taken then), for the one reason
        assert NO_CPU_KERNEL[fmt] in run.error and "dump" in run.raw, run.raw.get("traceback")
    loaded = run.loaded()
    stacked = [name for name in loaded if name.endswith((".w13_weight", ".w2_weight"))]
    assert len(stacked) == 4 and all(loaded[name].shape[0] == EXPERTS for name in stacked)
    assert load_problems(exports[fmt], run) == []
    assert fidelity_problems(model_dir, run) == []
    assert audit_export(exports[fmt]).ok


@pytest.mark.parametrize("fmt", FP4)
def test_vllm_cpu_refuses_nvfp4_experts_before_loading_them(exports, engine, fmt):
    """No expert kernel for NVFP4 on a CPU: vLLM says so while it builds the model, before any weight loads (the
    audit, headers and config only, is the check of these files here)."""
    run = engine[fmt]
    if run.error is None:
        assert len(run.generated[0]) == GENERATED
    else:
        assert NO_CPU_KERNEL[fmt] in run.error and "dump" not in run.raw
    assert audit_export(exports[fmt]).ok


def test_a_doubled_expert_scale_loads_as_written_passes_the_audit_and_fails_the_fidelity_check(model_dir, exports,
                                                                                             engine):
    run = engine[BROKEN]
    assert load_problems(exports[BROKEN], run) == []
    assert audit_export(exports[BROKEN]).ok
    assert fidelity_problems(model_dir, run) == [
        "model.layers.1.mlp.experts.3.up_proj: the weight vLLM multiplies is 100% off the source's"]
