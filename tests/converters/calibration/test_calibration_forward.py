"""The layer-sequential forward's compute dtype and prefetch: same amax as before, errors and cancels surface."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from safetensors.torch import load_file

from converters.artifact.layout import CALIBRATION_FILE, sha256_file
from converters.calibration.amax import record_amax
from converters.calibration.sequential import SequentialStats, calibrate_layer_by_layer, find_layer_stack
from converters.errors import ConversionCancelled
from converters.model.checkpoint import Checkpoint
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_model, model_dtype
from converters.pipeline import stages
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from tests.converters.calibration.test_layer_sequential import batches_for, matmul_paths
from tests.models import minilm_dir

# The fp32 path rounds where the bf16 model's modules round, but adds, rotary and attention internals round
# once instead of after every op: the amax stay within two bf16 ulps (2 * 2**-7 relative at the worst).
FP32_TOLERANCE = 2 * 2.0 ** -7


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    """A tiny bf16 Llama (3 layers) and the real MiniLM rounded to bf16 (real weight and activation ranges)."""
    from transformers import AutoModel, AutoTokenizer

    root = tmp_path_factory.mktemp("bf16")
    build_tiny_llama(root / "llama", hidden_size=128, layers=3)
    AutoModel.from_pretrained(minilm_dir(), dtype=torch.bfloat16).save_pretrained(root / "minilm")
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(root / "minilm")
    return root


def sequential(directory, **kwargs):
    """``(amax, stats, expected)``: layer-sequential amax with ``kwargs``, and the whole bf16 model's amax."""
    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    config = load_config(directory, sources)
    meta = build_meta_model(config, sources)
    stack, why = find_layer_stack(meta)
    assert stack is not None, why
    paths = matmul_paths(meta)
    batches = batches_for(directory, config, meta)
    checkpoint = Checkpoint(directory, meta, dtype=model_dtype(config), device="cpu")
    stats = SequentialStats()
    amax = calibrate_layer_by_layer(meta, stack, checkpoint, batches, paths, stats=stats, **kwargs)
    assert all(t.device.type == "meta" for t in meta.state_dict().values())
    assert {t.dtype for t in meta.state_dict().values() if t.is_floating_point()} <= {torch.bfloat16, torch.float32}
    return amax, stats, (meta, paths, batches)


@pytest.mark.parametrize("name", ["llama", "minilm"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_forced_bf16_is_bitwise_the_whole_bf16_model(name, prefetch, bf16_models):
    """Forcing bf16 reproduces the code before the compute-dtype change (itself bitwise the whole model)."""
    directory = bf16_models / name
    got, stats, (_, paths, batches) = sequential(directory, compute_dtype=torch.bfloat16, prefetch=prefetch)
    whole = load_model(directory, ModelSourceOptions(allowed_roots=(directory.parent,)))
    assert next(whole.parameters()).dtype == torch.bfloat16
    expected = record_amax(whole, paths, batches)
    assert stats.compute_dtype == "bfloat16" and stats.prefetch is prefetch
    assert sorted(got) == sorted(expected)
    for path in expected:
        assert torch.equal(got[path].forward, expected[path].forward), path


@pytest.mark.parametrize("name", ["llama", "minilm"])
def test_fp32_compute_gives_the_bf16_amax_within_two_ulps(name, bf16_models):
    bf16, _, _ = sequential(bf16_models / name, compute_dtype=torch.bfloat16)
    fp32, stats, _ = sequential(bf16_models / name, compute_dtype=torch.float32)
    assert (stats.compute_dtype, stats.checkpoint_dtype) == ("float32", "bfloat16")
    assert sorted(fp32) == sorted(bf16)
    worst = 0.0
    for path, layer in bf16.items():
        assert torch.equal(fp32[path].forward[:, 1], layer.forward[:, 1]), path  # weights: upcast exactly
        # Recorded on rounded tensors: every amax is a bf16 value, as the bf16 model's are.
        assert torch.equal(fp32[path].forward, fp32[path].forward.bfloat16().float()), path
        worst = max(worst, ((fp32[path].forward - layer.forward).abs() / layer.forward.abs()).max().item())
    assert worst <= FP32_TOLERANCE


def test_prefetch_gives_the_same_amax_in_fp32(bf16_models):
    with_prefetch, _, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=True)
    without, _, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=False)
    assert all(torch.equal(with_prefetch[p].forward, without[p].forward) for p in without)


def test_auto_keeps_a_float32_checkpoint_in_float32(models_root):
    _, stats, _ = sequential(models_root / "llama")
    assert (stats.compute_dtype, stats.checkpoint_dtype) == ("float32", "float32")


def test_auto_says_what_it_chose_and_why(bf16_models):
    _, stats, _ = sequential(bf16_models / "llama")
    assert stats.compute_dtype in ("bfloat16", "float32")
    assert "dot products" in stats.compute_reason and len(stats.layers) == 3
    assert stats.to_dict()["compute_dtype"] == stats.compute_dtype
    # the choice is the CPU's, not the machine's load: the same every time
    assert sequential(bf16_models / "llama")[1].compute_dtype == stats.compute_dtype


@pytest.mark.parametrize(("flags", "env", "native"), [
    ("fpu avx2 avx512f avx512_bf16", {}, True),
    ("fpu avx2 amx_bf16", {}, True),
    ("fpu avx2 fma", {}, False),
    ("fpu avx2 avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
    ("fpu avx2 avx512_bf16", {"ATEN_CPU_CAPABILITY": "avx2"}, False),
])
def test_native_bf16_follows_the_cpu_flags_and_kernel_caps(tmp_path, monkeypatch, flags, env, native):
    from converters.calibration.compute import choose_compute_dtype, native_half_kernels

    for variable in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert native_half_kernels(torch.bfloat16, cpuinfo) is native
    assert native_half_kernels(torch.bfloat16, tmp_path / "missing") is (False if env else None)
    monkeypatch.setattr("converters.calibration.compute.native_half_kernels", lambda dtype: native)
    dtype, _ = choose_compute_dtype(None, torch.bfloat16, torch.device("cpu"))
    assert dtype == (torch.bfloat16 if native else torch.float32)


def test_another_compute_dtype_is_refused(bf16_models):
    with pytest.raises(ValueError, match="compute_dtype"):
        sequential(bf16_models / "llama", compute_dtype=torch.float16)


def test_a_failed_prefetch_read_is_the_jobs_error(bf16_models, monkeypatch):
    real_read_ahead = Checkpoint.read_ahead

    def read_ahead(self, keys):
        if any(".layers.1." in key for key in keys):
            raise OSError("disk gone while reading layer 1")
        return real_read_ahead(self, keys)

    monkeypatch.setattr(Checkpoint, "read_ahead", read_ahead)
    with pytest.raises(OSError, match="disk gone"):
        sequential(bf16_models / "llama")
    assert not [t for t in threading.enumerate() if t.name.startswith("fp8forge-prefetch")]


def test_cancel_stops_before_the_next_layer_and_ends_the_prefetch(bf16_models):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(ConversionCancelled, match="before layer 1 of 3"):
        sequential(bf16_models / "llama", should_stop=should_stop)
    assert not [t for t in threading.enumerate() if t.name.startswith("fp8forge-prefetch")]


def test_minilm_pipeline_fp32_amax_and_scales_match_bf16(bf16_models, tmp_path, monkeypatch):
    """The whole pipeline (backend ao) on bf16 MiniLM: forced fp32 vs forced bf16 calibration."""
    directory = bf16_models / "minilm"
    amax = {}
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(stages, "calibrate_layer_by_layer",
                            functools.partial(calibrate_layer_by_layer, compute_dtype=dtype))
        out = tmp_path / str(dtype)
        request = ConversionRequest(model=str(directory), recipe={"backend": "ao"},
                                    calibration=CalibrationSettings(steps=2, seq_len=16))
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(directory.parent,)))
        # The source weights are written back untouched: the fp32 compute leaves no fp32 tensor in the model.
        assert sha256_file(out / "model.safetensors") == sha256_file(directory / "model.safetensors")
        amax[dtype] = load_file(out / CALIBRATION_FILE)
    bf16, fp32 = amax[torch.bfloat16], amax[torch.float32]
    assert sorted(bf16) == sorted(fp32) and bf16
    for key, value in bf16.items():
        assert ((fp32[key] - value).abs() / value.abs().clamp_min(1e-30)).max() <= FP32_TOLERANCE, key


def test_a_plain_source_is_read_ahead_by_the_kernel_and_loads_the_same_bytes(bf16_models, monkeypatch):
    """The prefetch of a plain source hands its byte ranges to the kernel and returns nothing to place: the load
    then reads them itself (no second copy on the forward's cores), and the amax are those without a prefetch."""
    import os

    advised = []
    real_fadvise = os.posix_fadvise

    def fadvise(descriptor, offset, length, advice):
        advised.append((offset, length, advice))
        return real_fadvise(descriptor, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    read = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, keys: read.append(keys) or real_read(self, keys))
    with_prefetch, stats, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=True)
    without, _, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=False)
    assert all(torch.equal(with_prefetch[p].forward, without[p].forward) for p in without)
    assert not read and stats.prefetch is True
    assert advised and all(advice == os.POSIX_FADV_WILLNEED and length > 0 for _, length, advice in advised)


def test_a_file_system_that_refuses_the_readahead_loses_only_the_hint(bf16_models, monkeypatch):
    """posix_fadvise is advice: where the file system refuses it (EINVAL), the layers still load and the amax are
    those without a prefetch."""
    import errno
    import os

    def refuse(descriptor, offset, length, advice):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    refused, _, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=True)
    without, _, _ = sequential(bf16_models / "llama", compute_dtype=torch.float32, prefetch=False)
    assert all(torch.equal(refused[p].forward, without[p].forward) for p in without)
