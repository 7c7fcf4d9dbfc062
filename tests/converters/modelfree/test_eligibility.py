"""Model-free eligibility (from headers and config.json) against the analysis of the model built on the meta device:
the same weights quantize, for the same reasons, on tiny Llama, Qwen2 and Mixtral, for each format and option."""

from __future__ import annotations

import json

import pytest
import torch

from converters.analysis.eligibility import AnalysisOptions, analyze_model
from converters.analysis.patterns import PatternError
from converters.model.checkpoint import Checkpoint
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config
from converters.modelfree import ModelFreeOptions, plan_model_free
from converters.serving import serving_format
from converters.serving.plan import expert_disk_keys, plan_serving

FORMATS = ("compressed-tensors-fp8-dynamic", "fp8-block", "mxfp8", "nvfp4-a16")
OPTIONS = [{}, {"skip_first_last": False}, {"exclude": ("layers.1.mlp",)}, {"include": ("self_attn",)}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from converters.model.demo import build_tiny_llama
    from tests.models import save_tiny_model, save_tiny_moe

    root = tmp_path_factory.mktemp("eligibility")
    build_tiny_llama(root / "llama")
    save_tiny_model("qwen2", root / "qwen2")
    save_tiny_moe("mixtral", root / "mixtral")
    _save_tied_llama(root / "tied")  # the head is the embedding, not stored: still the last Linear of the analysis
    return root


def _save_tied_llama(directory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    assert "lm_head.weight" not in json.dumps(sorted(_names(directory)))


def _names(directory):
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as handle:
        return list(handle.keys())


def _analysis_keys(directory, fmt, options):
    """The on-disk weight keys the calibrated pipeline's serving export would quantize, and each one's reasons."""
    sources = ModelSourceOptions(allowed_roots=(directory.parent,))
    meta = build_meta_model(load_config(directory, sources), sources)
    report = analyze_model(meta, AnalysisOptions(**options))
    checkpoint = Checkpoint(directory, meta, dtype=torch.float32, device="cpu")
    plan = plan_serving(serving_format(fmt), report, checkpoint.on_disk_name,
                        expert_disk_keys(checkpoint.mapping, checkpoint.target_of, report))
    return set(plan.quantized.values()) | set(plan.experts), plan.skipped


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "no-skip", "exclude", "include"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral", "tied"])
def test_the_same_weights_quantize_as_the_analysis_says(models, name, fmt, options):
    if name == "mixtral" and "exclude" in options:
        options = {"exclude": ("layers.1.self_attn",)}  # Mixtral's experts have other names on disk than loaded
    expected, skipped = _analysis_keys(models / name, fmt, options)
    report = plan_model_free(models / name, fmt, ModelFreeOptions(**options))
    assert set(report["quantized"]) == expected
    reasons = {layer["module"]: layer["reasons"] for layer in report["layers"] if layer["kind"] == "linear"}
    for path, why in skipped.items():
        if path in reasons:  # Linears (expert units are named differently on disk)
            assert ",".join(reasons[path]) == why, path


def test_first_and_last_linear_follow_module_order(models):
    report = plan_model_free(models / "mixtral", "mxfp8", ModelFreeOptions())
    reasons = {layer["module"]: layer["reasons"] for layer in report["layers"]}
    assert reasons["model.layers.0.self_attn.q_proj"] == ["first_linear"]
    assert reasons["lm_head"] == ["last_linear"]
    assert reasons["model.layers.0.block_sparse_moe.gate"][-1] == "moe_router_gate"  # [8, 64]: also the shape rule
    assert {entry["reason"] for entry in report["other"]} == {"embedding"}


def test_an_include_that_matches_nothing_is_refused(models):
    with pytest.raises(PatternError, match="include\\[0\\]"):
        plan_model_free(models / "llama", "mxfp8", ModelFreeOptions(include=("nothing_here",)))
