"""Layer-sequential conversion: the same amax as the whole model, one layer in memory, source weights untouched."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from converters.artifact.layout import sha256_file, staging_dir_for
from converters.backends.te.runtime import te_status
from converters.calibration.amax import record_amax
from converters.calibration.batches import calibration_batches
from converters.calibration.sequential import LAYER_SEQUENTIAL, calibrate_layer_by_layer, find_layer_stack
from converters.errors import ConversionCancelled
from converters.model.checkpoint import Checkpoint
from converters.model.sources import (
    ModelSourceOptions,
    build_meta_model,
    load_config,
    load_model,
    load_tokenizer,
    model_class,
    model_dtype,
)
from converters.pipeline.driver import NullSink, run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.stages import model_inputs
from tests.models import MORE_CONFIGS, minilm_dir, save_tiny_model

TE_OK, TE_WHY = te_status()
EQUALITY_MODELS = ["llama", "qwen2", "mixtral", "gpt2", "gemma", "bert", *MORE_CONFIGS]


@pytest.fixture(scope="module")
def more_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequential")
    for name in MORE_CONFIGS:
        save_tiny_model(name, root / name)
    return root


def model_dir(name, models_root, more_root):
    if name == "minilm":
        return minilm_dir()
    return (more_root if name in MORE_CONFIGS else models_root) / name


def matmul_paths(model: nn.Module) -> list[str]:
    """Every Linear and GPT-2 Conv1D, head included: pass 3 (the head) is exercised too."""
    return [path for path, module in model.named_modules()
            if type(module).__name__ in ("Linear", "Conv1D") and module.weight.dim() == 2]


def batches_for(directory, config, model, steps=3):
    tokenizer = load_tokenizer(directory, ModelSourceOptions())
    batches, _ = calibration_batches(tokenizer, vocab_size=config.vocab_size, steps=steps, batch_size=2, seq_len=16)
    return [model_inputs(model, config, batch) for batch in batches]


def both_modes(directory):
    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    config = load_config(directory, sources)
    whole = load_model(directory, sources)
    paths = matmul_paths(whole)
    batches = batches_for(directory, config, whole)
    expected = record_amax(whole, paths, batches)
    meta = build_meta_model(config, sources)
    stack, why = find_layer_stack(meta)
    assert stack is not None, why
    checkpoint = Checkpoint(directory, meta, dtype=model_dtype(config), device="cpu")
    return expected, calibrate_layer_by_layer(meta, stack, checkpoint, batches, paths,
                                                compute_dtype=checkpoint.dtype), meta  # the whole model's dtype


@pytest.mark.parametrize("name", [*EQUALITY_MODELS, "minilm"])
def test_layer_by_layer_amax_equals_whole_model_bitwise(name, models_root, more_root):
    expected, got, meta = both_modes(model_dir(name, models_root, more_root))
    assert sorted(got) == sorted(expected)
    for path in expected:
        assert torch.equal(got[path].forward, expected[path].forward), path
        assert bool((got[path].forward[:, 0] > 0).all()), f"{path} saw no input"  # every layer really ran
    assert all(tensor.device.type == "meta" for tensor in [*meta.parameters(), *meta.buffers()])


def test_bf16_checkpoint_gives_the_same_amax_too(tmp_path):
    """bf16 on CPU: the same kernels in the same order, so equality is bitwise here as well."""
    from converters.model.demo import build_tiny_llama

    expected, got, _ = both_modes(build_tiny_llama(tmp_path / "llama"))
    assert all(torch.equal(got[path].forward, expected[path].forward) for path in expected)


def test_only_one_layer_is_in_memory_at_a_time(models_root):
    directory = models_root / "llama"
    sources = ModelSourceOptions(allowed_roots=(models_root,))
    config = load_config(directory, sources)
    meta = build_meta_model(config, sources)
    stack, _ = find_layer_stack(meta)
    seen = []

    def after_layer(layer_pass):
        real = {name for name, p in meta.named_parameters(remove_duplicate=False) if p.device.type != "meta"}
        inside = {name for name in real if name.startswith(f"{layer_pass.path}.")}
        outside = real - inside
        seen.append((layer_pass.index, len(inside), sorted(outside)))

    checkpoint = Checkpoint(directory, meta, dtype=model_dtype(config), device="cpu")
    batches = batches_for(directory, config, meta, steps=2)
    calibrate_layer_by_layer(meta, stack, checkpoint, batches, ["model.layers.0.mlp.up_proj"],
                             after_layer=after_layer)
    per_layer = sum(1 for name, _ in meta.named_parameters() if name.startswith("model.layers.0."))
    # Each layer is fully there while it runs; outside it only the final norm stays (embedding, head released).
    assert seen == [(0, per_layer, ["model.norm.weight"]), (1, per_layer, ["model.norm.weight"])]


class StopAfterFirstLayer(NullSink):
    def __init__(self):
        super().__init__()
        self.current = None
        self.events = []

    def stage(self, name):
        self.current = name

    def progress(self, done, total, unit="step", **detail):
        self.events.append((self.current, done, total))

    def should_stop(self):
        return ("calibrate", 1, 2) in self.events


def test_a_cancelled_layer_sequential_job_leaves_nothing_behind(models_root, tmp_path):
    out = tmp_path / "out"
    sink = StopAfterFirstLayer()
    request = ConversionRequest(model=str(models_root / "llama"), recipe={"backend": "te"},
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    with pytest.raises(ConversionCancelled, match="before layer 1 of 2"):
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(models_root,)), sink)
    assert not out.exists() and not staging_dir_for(out).exists()
    assert list(tmp_path.iterdir()) == []


def test_progress_is_reported_per_layer(models_root, tmp_path):
    sink = StopAfterFirstLayer()
    sink.should_stop = lambda: False
    request = ConversionRequest(model=str(models_root / "llama"), recipe={"backend": "te"}, skip_first_last=False,
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(models_root,)), sink)
    # Two layers, then the head pass (lm_head is eligible once the first/last rule is off).
    assert [event for event in sink.events if event[0] == "calibrate"] == [
        ("calibrate", 1, 3), ("calibrate", 2, 3), ("calibrate", 3, 3)]


ARTIFACT_CASES = [(name, "te") for name in ("llama", "qwen2", "mixtral", "gemma", "bert", "gpt_neox", "qwen2_moe")]
ARTIFACT_CASES += [("mixtral", "ao"), ("gpt_neox", "ao")]


@pytest.mark.parametrize(("name", "backend"), ARTIFACT_CASES)
def test_artifact_weights_are_the_source_files_and_load_plainly(name, backend, models_root, more_root, tmp_path):
    directory = model_dir(name, models_root, more_root)
    out = tmp_path / "out"
    request = ConversionRequest(model=str(directory), recipe={"backend": backend}, skip_first_last=False,
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(directory.parent,)))
    assert sha256_file(out / "model.safetensors") == sha256_file(directory / "model.safetensors")
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["pipeline"]["mode"] == LAYER_SEQUENTIAL

    config = load_config(out, ModelSourceOptions())
    loaded, info = model_class(config, ModelSourceOptions()).from_pretrained(out, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    source = load_model(directory, ModelSourceOptions())
    assert all(torch.equal(value, loaded.state_dict()[key]) for key, value in source.state_dict().items())


def test_checkpoint_names_are_kept_and_renames_recorded(more_root, models_root, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "neox"
    request = ConversionRequest(model=str(more_root / "gpt_neox"), recipe={"backend": "te"}, skip_first_last=False,
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(more_root,)))
    block = json.loads((out / "config.json").read_text())["fp8"]
    assert "lm_head" in block["converted_modules"]
    assert block["converted_weights_on_disk"] == {"lm_head": "embed_out.weight"}
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert "embed_out.weight" in handle.keys() and "lm_head.weight" not in handle.keys()

    out = tmp_path / "mixtral"
    run_conversion(ConversionRequest(model=str(models_root / "mixtral"), recipe={"backend": "ao"},
                                     calibration=CalibrationSettings(steps=2, seq_len=16)),
                   out, ModelSourceOptions(allowed_roots=(models_root,)))
    with safe_open(out / "model.safetensors", "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys
    assert not any("gate_up_proj" in key for key in keys)


# --- CUDA + TransformerEngine ------------------------------------------------------------------------------

@pytest.mark.skipif(not TE_OK, reason=f"needs CUDA and TransformerEngine: {TE_WHY}")
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_te_checks_every_converted_layer_on_its_cached_inputs(name, models_root, tmp_path):
    from converters.backends.loaders import load_te

    out = tmp_path / "out"
    # BERT with the first/last rule off puts its pooler ([batch, hidden], 2 rows) in FP8: rows are padded.
    request = ConversionRequest(model=str(models_root / name), recipe={"backend": "te", "amax_history_len": 16},
                                skip_first_last=name != "bert", calibration=CalibrationSettings(steps=2, seq_len=16))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(models_root,)))
    report = json.loads((out / "fp8_report.json").read_text())
    check = report["calibration"]["te_check"]
    assert report["pipeline"]["mode"] == LAYER_SEQUENTIAL and check["ran"] and check["mode"] == "per layer"
    assert len(check["layers"]) == 2 and check["min_cosine"] >= 0.95
    model = load_te(out)
    assert model.fp8_recipe.amax_history_len == 16
