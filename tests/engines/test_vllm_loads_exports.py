"""vLLM's CPU build loads every fp8forge export it can run, with and without an FP8 KV cache, and uses it as
written: it generates; every tensor of the file reaches a vLLM parameter with the file's value (FP8 weights bit for
bit, weight and input scales exactly, KV scales to bf16 rounding); every attention layer of an FP8 KV cache runs
with the file's scales; and each FP8 weight as vLLM multiplies it is the source's within FP8 rounding.

The exports: the tiny Llama of tests/conftest.py (``llama_root``, with its tokenizer), written by two conversion
jobs (without and with ``kv_cache: "fp8"``) in the formats the CPU build has kernels for (the three FP8 layouts, and
fp8-block on a CPU with AMX tiles, where vLLM's own ``CPUFp8BlockScaledMMKernel`` runs it; elsewhere those cases skip
and say why) and the three it runs with vLLM's own emulation kernels listed for the CPU (mxfp8, nvfp4,
modelopt-nvfp4); each run names the kernel class every quantized layer selected. Deliberately broken
copies show that each check catches what it is for, and that the project's load audit (headers and config only)
agrees with vLLM on whether the file loads as written. All runs share one vLLM process (tests/engines/engine.py).

vLLM runs in its own venv: ``make vllm-venv`` builds it; without it these tests skip and say so.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving.audit import Rule, audit_export
from tests.engines.engine import AMX, KV_CACHE, EngineRequest, fidelity_problems, load_problems, run_vllm, vllm_missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))]

STATIC, DYNAMIC, MODELOPT = "compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "modelopt-fp8"
MXFP8, NVFP4, MODELOPT_NVFP4 = "mxfp8", "nvfp4", "modelopt-nvfp4"
BLOCK = "fp8-block"
#: the exports vLLM's CPU build has kernels for: fp8-block on a CPU with AMX tiles only (engine.AMX)
RUNNABLE = (STATIC, DYNAMIC, MODELOPT, BLOCK)
#: the exports it runs with its own emulation kernels listed for the CPU (vllm_driver.install_stand_ins). Not
#: run: nvfp4-a16 (vLLM forces Marlin for W4A16)
EMULATED = (MXFP8, NVFP4, MODELOPT_NVFP4)
NO_BLOCK_KERNEL = ("vLLM's CPU build has FP8 block kernels only with AMX tiles (Sapphire Rapids or newer): this CPU "
                   "has none")
KV_FORMATS = (STATIC, DYNAMIC, MODELOPT, MODELOPT_NVFP4)
CASES = [(fmt, kv) for fmt in RUNNABLE + EMULATED for kv in (None, "fp8") if kv is None or fmt in KV_FORMATS]
CALIBRATION = CalibrationSettings(steps=2, seq_len=16)
#: the NVFP4 exports of a job whose recipe smooths its source (nvfp4_smoothing) and rounds by GPTQ
#: (nvfp4_weight_rounding): other norms and codes, the same layouts
GPTQ = {NVFP4: "nvfp4-gptq", MODELOPT_NVFP4: "modelopt-nvfp4-gptq"}
GPTQ_RECIPE = {"backend": "te", "nvfp4_weight_scales": "four_over_six", "nvfp4_weight_rounding": "gptq",
               "nvfp4_smoothing": "awq"}
TEXT = "The engine reads the scales the converter wrote, and the cache keeps its keys in eight bits."
GENERATED = 8


def rename_k_scale(tensors):
    """A KV scale under a name no attention layer owns: vLLM ignores it and runs that layer's keys at scale 1.0."""
    tensors["model.layers.1.mlp.k_scale"] = tensors.pop("model.layers.1.self_attn.k_scale")


def double_weight_scale(tensors):
    """A weight scale twice what the FP8 values were cast with: loads fine, multiplies the weight by 2."""
    tensors["model.layers.1.self_attn.o_proj.weight_scale"] *= 2


def raise_mx_exponent(tensors):
    """Each row's first MXFP8 block exponent one step up: the first 32 inputs of every output come out twice as
    large. vLLM loads it as written; only the source shows it."""
    tensors["model.layers.1.mlp.down_proj.weight_scale"][:, 0] += 1


def double_block_scale(tensors):
    """One FP8 block's scale twice what its values were cast with: loads fine, doubles that 128 x 128 block."""
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"][0, 0] *= 2


def drop_modelopt_v_scale(tensors):
    """One layer's v_scale missing: vLLM's BaseKVCacheMethod.process_weights_after_loading (kv_cache.py) then runs
    that layer's values with its k_scale (it duplicates a lone scale), silently."""
    del tensors["model.layers.1.self_attn.v_proj.v_scale"]


#: name -> (export it breaks, KV cache, edit, the rules the audit fires (an empty set: it passes
#: the export), the engine check that must catch it)
BROKEN = {
    # layer 1 is left with its v_scale alone: dropped and missing
    "kv-scale-renamed": (STATIC, "fp8", rename_k_scale, {Rule.SCALE_DROPPED, Rule.MISSING_SCALE}, "load"),
    "weight-scale-doubled": (STATIC, None, double_weight_scale, set(), "fidelity"),
    "modelopt-v-scale-dropped": (MODELOPT, "fp8", drop_modelopt_v_scale, {Rule.MISSING_SCALE}, "load"),
    "mx-exponents-raised": (MXFP8, None, raise_mx_exponent, set(), "fidelity"),
    "block-scale-doubled": (BLOCK, None, double_block_scale, set(), "fidelity"),
}


def runs_here(key) -> bool:
    """Whether vLLM's CPU build can run the export ``key`` (a CASES entry or a BROKEN name) on this CPU."""
    fmt = BROKEN[key][0] if key in BROKEN else key[0]
    return fmt != BLOCK or AMX


def only_where_it_runs(key) -> None:
    if not runs_here(key):
        pytest.skip(NO_BLOCK_KERNEL)


@pytest.fixture(scope="module")
def exports(llama_root):
    """(format, kv_cache) -> the export directory, and the broken copies by name."""
    done = {}
    for kv in (None, "fp8"):
        formats = tuple(fmt for fmt, case_kv in CASES if case_kv == kv)
        request = ConversionRequest(model=str(llama_root / "llama"), recipe={"backend": "te"}, calibration=CALIBRATION,
                                    serving_formats=formats, kv_cache=kv)
        out = llama_root / f"out-{kv or 'no-kv'}"
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_root,)))
        done.update({(fmt, kv): out / "serving" / fmt for fmt in formats})
    request = ConversionRequest(model=str(llama_root / "llama"), recipe=GPTQ_RECIPE, calibration=CALIBRATION,
                                serving_formats=tuple(GPTQ))
    run_conversion(request, llama_root / "out-gptq", ModelSourceOptions(allowed_roots=(llama_root,)))
    done.update({key: llama_root / "out-gptq" / "serving" / fmt for fmt, key in GPTQ.items()})
    for name, (fmt, kv, edit, _, _) in BROKEN.items():
        broken = shutil.copytree(done[(fmt, kv)], llama_root / "broken" / name)
        tensors = load_file(broken / "model.safetensors")
        edit(tensors)
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        done[name] = broken
    return done


@pytest.fixture(scope="module")
def tokens(llama_root):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(llama_root / "llama")(TEXT)["input_ids"]
    assert len(ids) > 8
    return ids


@pytest.fixture(scope="module")
def engine(llama_root, exports, tokens, tmp_path_factory):
    """Key (a CASES entry, a BROKEN name or "source") -> vLLM's run of it; one vLLM process for all."""
    keys = ["source", *filter(runs_here, CASES), *filter(runs_here, BROKEN), *GPTQ.values()]
    requests = []
    for key in keys:
        if key == "source":
            model, kv = llama_root / "llama", None
        elif key in GPTQ.values():
            model, kv = exports[key], None
        elif key in BROKEN:
            model, kv = exports[key], BROKEN[key][1]
        else:
            model, kv = exports[key], key[1]
        requests.append(EngineRequest(model=model, kv_cache_dtype=KV_CACHE if kv else "auto", generate=[tokens[:4]],
                                      max_tokens=GENERATED, score=[tokens]))
    runs = run_vllm(requests, tmp_path_factory.mktemp("vllm"))
    return dict(zip(keys, runs, strict=True))


@pytest.mark.parametrize("fmt", list(GPTQ))
def test_vllm_runs_a_gptq_rounded_nvfp4_export_as_written(exports, engine, fmt):
    """Smoothing and GPTQ change norms and codes, not the layout: vLLM loads every tensor with the file's value (the
    smoothed norms included), generates, and the codes and the smoothed norms differ from the plain export's."""
    key = GPTQ[fmt]
    run = engine[key]
    assert load_problems(exports[key], run) == []
    assert audit_export(exports[key]).ok
    assert len(run.generated[0]) == GENERATED
    assert run.perplexity == pytest.approx(engine["source"].perplexity, rel=0.1)
    rounded, nearest = (load_file(exports[at] / "model.safetensors") for at in (key, (fmt, None)))
    packed = "model.layers.1.mlp.down_proj." + ("weight_packed" if fmt == NVFP4 else "weight")
    assert rounded[packed].shape == nearest[packed].shape and not rounded[packed].equal(nearest[packed])
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert not rounded[norm].equal(nearest[norm])


def test_the_bf16_source_runs_in_vllm(engine):
    run = engine["source"]
    assert run.error is None
    assert len(run.generated[0]) == GENERATED and run.perplexity > 1


@pytest.mark.parametrize("fmt, kv", CASES, ids=[f"{fmt}-{kv or 'no-kv'}" for fmt, kv in CASES])
def test_vllm_runs_the_export_as_written(llama_root, exports, engine, fmt, kv):
    only_where_it_runs((fmt, kv))
    run = engine[(fmt, kv)]
    # vLLM's own kernel for what its CPU build runs, its emulation kernel (registered for the CPU) for the rest
    assert run.kernels and all(name.startswith("Emulation") == (fmt in EMULATED) for name in run.kernels)
    if fmt == BLOCK:
        assert set(run.kernels) == {"CPUFp8BlockScaledMMKernel"}
    assert load_problems(exports[(fmt, kv)], run) == []
    assert fidelity_problems(llama_root / "llama", run) == []
    assert audit_export(exports[(fmt, kv)]).ok
    assert len(run.generated[0]) == GENERATED
    # random weights predict near-uniformly: FP8 weights (and keys/values) move the perplexity by a few percent
    assert run.perplexity == pytest.approx(engine["source"].perplexity, rel=0.1)
    kv_dtypes = {scales["kv_cache_dtype"] for scales in run.attention.values()}
    assert kv_dtypes == ({KV_CACHE} if kv else {"auto"})


def only_with_an_fp8_cache(name):
    """A lone KV scale is only ever read by an FP8 KV cache, which vLLM's CPU build keeps only with AVX-512 or AMX."""
    if name == "modelopt-v-scale-dropped" and KV_CACHE != "fp8":
        pytest.skip("vLLM's CPU build runs no FP8 KV cache on this CPU (AVX2 only): the missing v_scale is never read")


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_export_fails_the_engine_check(llama_root, exports, engine, name):
    only_with_an_fp8_cache(name)
    only_where_it_runs(name)
    caught_by = BROKEN[name][4]
    run = engine[name]
    problems = (load_problems(exports[name], run) if caught_by == "load"
                else fidelity_problems(llama_root / "llama", run))
    assert problems, f"{name} passed the {caught_by} check"


@pytest.mark.parametrize("name", BROKEN)
def test_the_audit_agrees_with_vllm_on_a_broken_export(exports, engine, name):
    """The audit reads headers and config only: it says whether vLLM loads every tensor as written (a dropped or
    renamed scale: no), not whether a value is right (a doubled scale loads as written; only the source shows it)."""
    result = audit_export(exports[name])
    assert result.rules() == BROKEN[name][3]
    only_with_an_fp8_cache(name)
    only_where_it_runs(name)
    assert (not load_problems(exports[name], engine[name])) == result.ok
