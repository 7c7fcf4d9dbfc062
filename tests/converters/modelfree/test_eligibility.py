"""Model-free eligibility on real checkpoints' headers: module order decides the first and last Linear, the router
and the embeddings stay out, an include that selects nothing is refused (the rules themselves:
tests/converters/analysis/test_decision.py, through this walk and the analysis alike)."""

from __future__ import annotations

import pytest

from converters.analysis.patterns import PatternError
from converters.modelfree import ModelFreeOptions, plan_model_free


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from converters.model.demo import build_tiny_llama
    from tests.models import save_tiny_moe

    root = tmp_path_factory.mktemp("eligibility")
    build_tiny_llama(root / "llama")
    save_tiny_moe("mixtral", root / "mixtral")
    return root


def test_first_and_last_linear_follow_module_order(models):
    report = plan_model_free(models / "mixtral", "mxfp8", ModelFreeOptions())
    reasons = {layer["module"]: layer["reasons"] for layer in report["layers"]}
    assert reasons["model.layers.0.self_attn.q_proj"] == ["first_linear"]
    assert reasons["lm_head"] == ["last_linear"]
    assert reasons["model.layers.0.block_sparse_moe.gate"][-1] == "moe_router_gate"  # [8, 64]: also the shape rule
    assert {entry["reason"] for entry in report["other"]} == {"embedding"}


def test_a_mixtral_experts_module_quantizes_whole(models):
    whole = plan_model_free(models / "mixtral", "mxfp8", ModelFreeOptions())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in whole["quantized"]
    # an expert's w1 and w3 share one weight scale (vLLM loads them as one w13)
    assert whole["quantized"]["model.layers.1.block_sparse_moe.experts.3.w1.weight"] == (
        "model.layers.1.block_sparse_moe.experts.3.w1_w3")
    partly = plan_model_free(models / "mixtral", "mxfp8", ModelFreeOptions(exclude=("layers.1.*.experts.3.w2",)))
    reasons = {layer["module"]: layer["reasons"] for layer in partly["layers"]}
    assert reasons["model.layers.1.block_sparse_moe.experts.3.w2"] == ["excluded_by_pattern"]
    assert reasons["model.layers.1.block_sparse_moe.experts.0.w1"] == [
        "fused_group_not_fully_eligible:model.layers.1.block_sparse_moe.experts.w2"]
    assert not any(".layers.1.block_sparse_moe.experts." in key for key in partly["quantized"])
    assert any(".layers.0.block_sparse_moe.experts." in key for key in partly["quantized"])


def test_an_include_that_matches_nothing_is_refused(models):
    with pytest.raises(PatternError, match="include\\[0\\]"):
        plan_model_free(models / "llama", "mxfp8", ModelFreeOptions(include=("nothing_here",)))
