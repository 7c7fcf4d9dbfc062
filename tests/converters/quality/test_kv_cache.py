"""The FP8 KV cache in the quality pass: keys after RoPE and values stored as E4M3 with the export's k/v scales.

On the tiny random Llama: the kernel sees exactly a direct E4M3 round trip of the keys and values the model
computed; a job with ``kv_cache: "fp8"`` reports its exports with and without the FP8 KV cache. On the real
SmolLM2: FP8 KV costs perplexity, and an export whose KV scales are 100 times too small reports a large cost.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.artifact.layout import REPORT_FILE
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from converters.quality import (
    KV_ROUNDING_NEAREST,
    KV_ROUNDING_TRUNCATE,
    ExportFiles,
    KvCast,
    export_kv_casts,
    export_layer_casts,
    fake_quantize_kv,
    load_source,
    measure_qualities,
    quantizing_kv_cache,
)
from converters.quality.kv_cache import attention_paths
from tests.converters.serving.exports import export

TEXT = "The harbor town woke slowly on the first cold morning of autumn, and the gulls argued over the boats."


def _recorded_kernel_inputs(model, ids, casts, monkeypatch):
    """The keys and values each attention module's kernel (sdpa) received, per module."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen, real = {}, ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, *args, **kwargs):
        seen[module] = (key.clone(), value.clone())
        return real(module, query, key, value, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recording)
        with torch.no_grad(), quantizing_kv_cache(model, casts):
            model(input_ids=ids)
    return seen


def test_the_kernel_sees_a_direct_e4m3_round_trip_of_the_keys_after_rope_and_the_values(llama_dir, monkeypatch):
    model = load_model(llama_dir, ModelSourceOptions())
    ids = torch.tensor([load_tokenizer(llama_dir, ModelSourceOptions())(TEXT)["input_ids"]])
    first = model.get_submodule(attention_paths(model)[0])
    plain = _recorded_kernel_inputs(model, ids, {}, monkeypatch)[first]
    k_scale, v_scale = float(plain[0].abs().max()) / 448 * 0.5, float(plain[1].abs().max()) / 448  # k clips
    cast = KvCast(k_scale=k_scale, v_scale=v_scale)
    quantized = _recorded_kernel_inputs(model, ids, {attention_paths(model)[0]: cast}, monkeypatch)[first]
    for raw, got, scale in ((plain[0], quantized[0], k_scale), (plain[1], quantized[1], v_scale)):
        assert raw.dtype == got.dtype == torch.bfloat16 and raw.shape == got.shape
        direct = (raw.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        assert torch.equal(got, direct.to(torch.bfloat16))
        assert not torch.equal(got, raw)
    # the module's own config is back after the block: the next forward is the plain model's
    assert _recorded_kernel_inputs(model, ids, {}, monkeypatch)[first][0].equal(plain[0])


def test_the_cpu_cast_attends_over_exact_fp32_keys_and_values_as_vllm_s_cpu_kernel(llama_dir, monkeypatch):
    """vLLM's CPU attention reads the cache's codes in fp32 (scales folded into the logits and the output): the CPU
    cast's emulation keeps ``code x scale`` exact in fp32 instead of rounding it to the model's bf16, which put the
    report's FP8-KV perplexities 0.7% below the engine's (docs/benchmarks/engine-lean-2026-12-04.md)."""
    model = load_model(llama_dir, ModelSourceOptions())
    ids = torch.tensor([load_tokenizer(llama_dir, ModelSourceOptions())(TEXT)["input_ids"]])
    path = attention_paths(model)[0]
    first = model.get_submodule(path)
    plain = _recorded_kernel_inputs(model, ids, {}, monkeypatch)[first]
    # scales of a long mantissa (an export's are bf16 amax / 448): code x scale then never fits bf16
    k_scale, v_scale = (float(tensor.abs().max()) / 448 * 1.0123457 for tensor in plain)
    truncated = _recorded_kernel_inputs(
        model, ids, {path: KvCast(k_scale=k_scale, v_scale=v_scale, rounding=KV_ROUNDING_TRUNCATE)}, monkeypatch)[first]
    for raw, got, scale in ((plain[0], truncated[0], k_scale), (plain[1], truncated[1], v_scale)):
        assert got.dtype == torch.float32
        assert torch.equal(got, fake_quantize_kv(raw.float(), scale, KV_ROUNDING_TRUNCATE))
        assert not torch.equal(got, got.to(torch.bfloat16).float())  # exact values bf16 would have rounded
    # the CUDA cast stays in the model's dtype: CUDA's kernels dequantize the cache to the query's dtype
    nearest = _recorded_kernel_inputs(model, ids, {path: KvCast(k_scale=k_scale, v_scale=v_scale)}, monkeypatch)[first]
    assert nearest[0].dtype == torch.bfloat16
    with torch.no_grad(), quantizing_kv_cache(
            model, {path: KvCast(k_scale=k_scale, v_scale=v_scale, rounding=KV_ROUNDING_TRUNCATE)}):
        assert model(input_ids=ids).logits.dtype == torch.bfloat16  # the attention's output is back in bf16


def test_the_cpu_build_s_truncating_cast_rounds_toward_zero_and_nearest_rounds_half_to_even():
    scale = 0.5
    # 448 and beyond saturate; 2^-9 steps below 2^-6 (subnormals); 3 mantissa bits above
    x = torch.tensor([1000.0, -1000.0, 1.2, -1.2, 1.0625, 1.1875, 2 ** -8 * 1.9, -(2 ** -8) * 1.9, 0.0]) * scale
    truncated = fake_quantize_kv(x, scale, KV_ROUNDING_TRUNCATE) / scale
    nearest = fake_quantize_kv(x, scale, KV_ROUNDING_NEAREST) / scale
    # 1.9 * 2^-8 is 3.8 subnormal steps of 2^-9: 3 truncated, 4 to nearest
    assert truncated.tolist() == [448.0, -448.0, 1.125, -1.125, 1.0, 1.125, 3 * 2 ** -9, -3 * 2 ** -9, 0.0]
    assert nearest.tolist() == [448.0, -448.0, 1.25, -1.25, 1.0, 1.25, 2 ** -8 * 2.0, -(2 ** -8) * 2.0, 0.0]


def test_a_kv_cast_refuses_a_scale_the_engine_would_not_load():
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        KvCast(k_scale=0.0, v_scale=1.0)
    with pytest.raises(ValueError, match="rounding must be one of nearest, truncate"):
        KvCast(k_scale=1.0, v_scale=1.0, rounding="stochastic")


def test_a_kv_cast_on_a_module_that_is_not_attention_is_refused(llama_dir):
    source = load_source(llama_dir)
    with pytest.raises(ValueError, match="not attention modules"):
        measure_qualities(source, {"bad": {"model.layers.0.mlp": KvCast(k_scale=1.0, v_scale=1.0)}}, [TEXT])


def test_a_job_with_fp8_kv_reports_each_export_with_and_without_it(llama_dir):
    out = export(llama_dir, ("compressed-tensors-fp8", "modelopt-fp8", "nvfp4"), kv_cache="fp8")
    serving = json.loads((out / REPORT_FILE).read_text())["quality"]["serving"]
    for fmt in ("compressed-tensors-fp8", "modelopt-fp8"):
        kv = serving[fmt]["kv_cache"]
        assert kv["rounding"] == KV_ROUNDING_NEAREST and kv["keys"] == "after RoPE"
        # the same weights and activations, plus the FP8 cache: the KL to the source grows
        assert serving[fmt]["kl_mean"] > kv["without_fp8_kv"]["kl_mean"] > 0
        assert kv["kl_mean_increase"] == pytest.approx(serving[fmt]["kl_mean"] - kv["without_fp8_kv"]["kl_mean"])
        # vLLM's CPU build truncates: every key and value moves toward zero, a larger error than rounding
        truncated = kv["truncated_as_vllm_cpu"]
        assert truncated["rounding"] == KV_ROUNDING_TRUNCATE and truncated["kl_mean_increase"] > kv["kl_mean_increase"]
    assert "kv_cache" not in serving["nvfp4"]  # the NVFP4 compressed-tensors export writes no KV scales


# ---- the real SmolLM2 ----

@pytest.fixture(scope="module")
def smollm_kv_export(tmp_path_factory):
    """SmolLM2 converted to compressed-tensors-fp8 with an FP8 KV cache, scored on the first held-out text cut to
    64 tokens (as tests/converters/quality/test_real_decoder.py: affordable in CI); the export, its source, the
    text."""
    from converters.api import local_sources
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest
    from converters.quality import held_out_part
    from converters.recipes.presets import RECIPE_NAMES
    from tests.converters.quality.smollm import smollm_dir

    model_dir = smollm_dir()
    source = load_source(model_dir)
    ids = source.tokenizer(held_out_part()[0], add_special_tokens=True)["input_ids"][:65]
    texts = [source.tokenizer.decode(ids, skip_special_tokens=True)]
    work = tmp_path_factory.mktemp("smollm-kv")
    request = ConversionRequest(model=str(model_dir), recipe=RECIPE_NAMES["te-current"],
                                calibration=CalibrationSettings(steps=2, batch_size=1, seq_len=64),
                                serving_formats=("compressed-tensors-fp8",), kv_cache="fp8", quality_texts=tuple(texts))
    result = run_conversion(request, work / "out", local_sources(model_dir.parent, work))
    return result.out_dir, source, texts


def _casts(source, directory):
    files = ExportFiles(directory)
    linears = [name for name, module in source.model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    on_disk = source.checkpoint.on_disk_name
    layers = export_layer_casts(directory, linears, on_disk, input_cast="e4m3_tensor", files=files)
    kv = export_kv_casts(directory, source.model, on_disk, files.read, files.file_of, source.checkpoint.dtype)
    return layers, kv


@pytest.mark.slow  # the real SmolLM2-135M: a conversion job and its quality pass
def test_smollm_fp8_kv_costs_and_kv_scales_100_times_too_small_cost_much_more(smollm_kv_export, tmp_path):
    out, source, texts = smollm_kv_export
    serving = json.loads((out / REPORT_FILE).read_text())["quality"]["serving"]["compressed-tensors-fp8"]
    print(serving)  # with -s: the figures
    assert serving["kv_cache"]["kl_mean_increase"] > 0

    exported = out / "serving" / "compressed-tensors-fp8"
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    for file in broken.glob("*.safetensors"):
        tensors = load_file(file)
        tensors.update({name: tensor / 100 for name, tensor in tensors.items()
                        if name.endswith(("k_scale", "v_scale"))})
        save_file(tensors, file, metadata={"format": "pt"})
    layers, good_kv = _casts(source, exported)
    _, broken_kv = _casts(source, broken)
    assert len(good_kv) == 30 and all(broken_kv[p].k_scale == pytest.approx(good_kv[p].k_scale / 100, rel=1e-2)
                                      for p in good_kv)
    figures = measure_qualities(source, {"good": {**layers, **good_kv}, "broken": {**layers, **broken_kv}}, texts)
    # the job's own figure, from the same casts read back from the files
    assert figures["good"].perplexity == pytest.approx(serving["perplexity"], rel=1e-4)
    without = serving["kv_cache"]["without_fp8_kv"]
    wrong_ppl = figures["broken"].perplexity / without["perplexity"] - 1
    wrong_kl = figures["broken"].kl_mean - without["kl_mean"]
    print(f"FP8 KV: perplexity +{serving['kv_cache']['perplexity_increase']:.4f} as exported, +{wrong_ppl:.4f} with "
          f"scales /100; KL +{serving['kv_cache']['kl_mean_increase']:.4f} and +{wrong_kl:.4f}")
    # Scales 100x too large hide among 48 positions' noise (E4M3's range absorbs most of it: one run measured +14.5%,
    # another -1%); 100x too small clip every key and value above amax / 100 at 448 x scale, which no text survives.
    assert wrong_ppl > 0.10 and wrong_ppl > serving["kv_cache"]["perplexity_increase"] + 0.05
    assert wrong_kl > 1.25 * serving["kv_cache"]["kl_mean_increase"]
