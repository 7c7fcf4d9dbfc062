"""The one rule table, ``decide()``: each rule's reason on hand-made records, then the same rules reached through both
walks (a module tree on the meta device, and the same model's safetensors headers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from converters.analysis.decision import DecisionOptions, LayerKind, LayerRecord, decide, with_groups
from converters.analysis.eligibility import AnalysisOptions, analyze_model
from converters.analysis.patterns import PatternError
from converters.analysis.reasons import Reason
from converters.modelfree.eligibility import ModelFreeOptions, TensorInfo, report_from_headers
from converters.recipes.requirements import FP8_RULE, MXFP8_RULE
from converters.serving import serving_format


def record(name="layers.0.mlp.up_proj", shape=(64, 64), kind=LayerKind.LINEAR, **flags):
    out_features, in_features = shape
    return LayerRecord(name=name, kind=kind, shape=shape, in_features=in_features, out_features=out_features,
                       dtype="bfloat16", parameters=in_features * out_features, **flags)


def options(**overrides):
    return DecisionOptions(**{"format": "test", "shape_rule": FP8_RULE, **overrides})


@pytest.mark.parametrize(("layer", "settings", "reasons"), [
    (record(), {}, []),
    (record(shape=(40, 64)), {}, [Reason.DIM_NOT_DIVISIBLE]),
    (record(shape=(64, 8)), {}, [Reason.DIM_NOT_DIVISIBLE]),
    (record(shape=(64, 48)), {"shape_rule": MXFP8_RULE}, [Reason.DIM_NOT_DIVISIBLE_MXFP8]),
    (record(first=True), {}, [Reason.FIRST_LINEAR]),
    (record(first=True), {"skip_first_last": False}, []),
    (record(last=True), {}, [Reason.LAST_LINEAR]),
    (record(tied=True, last=True), {}, [Reason.LAST_LINEAR, Reason.TIED_HEAD]),
    (record(tied=True, last=True), {"skip_first_last": False}, [Reason.TIED_HEAD]),
    (record(router=True), {}, [Reason.ROUTER_GATE]),
    (record(router=True), {"convert_router_gates": True}, []),
    (record(), {"include": ("self_attn",)}, [Reason.NOT_INCLUDED]),
    (record(), {"include": ("layers.0",)}, []),
    (record(), {"exclude": ("mlp",)}, [Reason.EXCLUDED]),
    (record(), {"exclude": ("mlp.up",)}, []),  # a pattern matches whole segments only
    (record(kind=LayerKind.CONV1D, shape=(8, 8), first=True), {"exclude": ("mlp",)}, [Reason.NOT_LINEAR]),
    (record(kind=LayerKind.EXPERT, layout_supported=False), {}, [Reason.EXPERT_LAYOUT]),
    (record(shape=(10, 64), last=True, router=True), {"include": ("attn",), "exclude": ("up_proj",)},
     [Reason.DIM_NOT_DIVISIBLE, Reason.LAST_LINEAR, Reason.ROUTER_GATE, Reason.NOT_INCLUDED, Reason.EXCLUDED]),
    (record(shape=(64, 96)), {"format_rule": serving_format("fp8-block").layer_rule}, [Reason.SERVING_BLOCK]),
    # the format's own rule only speaks for a layer the other rules let through
    (record(shape=(64, 96), first=True), {"format_rule": serving_format("fp8-block").layer_rule},
     [Reason.FIRST_LINEAR]),
])
def test_each_rule_gives_its_reason_in_the_tables_order(layer, settings, reasons):
    (decision,) = decide([layer], options(**settings))
    assert list(decision.reasons) == reasons
    assert decision.eligible is (not reasons)
    assert decision.scale_group == (None if reasons else layer.name)


def qkv(k_shape=(40, 64)):
    records, groups = with_groups([record("attn.q_proj"), record("attn.k_proj", shape=k_shape), record("attn.v_proj"),
                                   record("attn.o_proj")])
    assert groups == {"attn.qkv": ["attn.q_proj", "attn.k_proj", "attn.v_proj"]}
    return records


def test_a_partly_eligible_group_is_listed_or_held_back_whole():
    listed = {d.name: d for d in decide(qkv(), options())}
    assert listed["attn.q_proj"].eligible and listed["attn.q_proj"].scale_group == "attn.q_proj"
    held = {d.name: d for d in decide(qkv(), options(whole_groups=True))}
    assert held["attn.k_proj"].reason_codes() == ["dim_not_divisible_by_16"]
    assert held["attn.q_proj"].reason_codes() == held["attn.v_proj"].reason_codes() == [
        "fused_group_not_fully_eligible:attn.qkv"]
    assert held["attn.o_proj"].eligible and held["attn.o_proj"].scale_group == "attn.o_proj"
    whole = {d.name: d for d in decide(qkv(k_shape=(32, 64)), options(whole_groups=True))}
    assert {d.scale_group for name, d in whole.items() if name != "attn.o_proj"} == {"attn.qkv"}


def test_an_experts_module_converts_whole_naming_the_failing_gemm():
    experts = [record(f"moe.experts.{e}.{leaf}", kind=LayerKind.EXPERT, experts="moe.experts",
                      shape=(40, 64) if (e, leaf) == (1, "w2") else (64, 64))
               for e in range(2) for leaf in ("w1", "w2")]
    held = decide(experts, options(whole_groups=True))
    assert [d.reason_codes() for d in held] == [["fused_group_not_fully_eligible:moe.experts.w2"]] * 3 + [
        ["dim_not_divisible_by_16"]]
    assert [d.eligible for d in decide(experts, options())] == [True, True, True, False]


@pytest.mark.parametrize(("bad", "error"), [
    ({"shape_rule": 16}, ValueError), ({"skip_first_last": "yes"}, ValueError), ({"format_rule": "fp8"}, ValueError),
    ({"exclude": ("a b",)}, PatternError)])
def test_bad_settings_are_refused_naming_the_field(bad, error):
    with pytest.raises(error, match=next(iter(bad))):
        options(**bad)


# Both walks: a decoder named as Hugging Face names one, analysed on the meta device and read from its headers.
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(64, 64) for _ in range(4))


class Mlp(nn.Module):
    def __init__(self, down_out):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 128), nn.Linear(64, 128), nn.Linear(128, down_out)


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 16)
        self.experts = nn.ModuleList(Expert() for _ in range(2))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 128)


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.self_attn, self.mlp = Attention(), mlp


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(256, 64)
        self.layers = nn.ModuleList([Layer(Mlp(down_out=40)), Layer(Moe())])
        self.norm = nn.LayerNorm(64)


class ToyForCausalLM(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.model, self.lm_head = Decoder(), nn.Linear(64, 256, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self):
        return self.model.embed_tokens


def both_walks(settings, *, tied=False, head_stored=True):
    """Each layer's reasons from the analysis of the module tree and from the model-free walk of its headers."""
    with torch.device("meta"):
        model = ToyForCausalLM(tied)
    analysis = analyze_model(model, AnalysisOptions(**settings))
    headers = [TensorInfo(key=name, shard="model.safetensors", dtype="F32", shape=tuple(tensor.shape))
               for name, tensor in model.state_dict(keep_vars=True).items() if head_stored or "lm_head" not in name]
    config = {"architectures": ["ToyForCausalLM"], "tie_word_embeddings": tied}
    stored = report_from_headers(headers, config, ModelFreeOptions(**settings),
                                 serving_format("compressed-tensors-fp8-dynamic"))
    return ({row["path"]: row["reasons"] for row in analysis["layers"]},
            {row["module"]: row["reasons"] for row in stored["layers"]})


@pytest.mark.parametrize(("settings", "model", "layer", "reasons"), [
    ({}, {}, "model.layers.0.self_attn.q_proj", [Reason.FIRST_LINEAR]),
    ({"skip_first_last": False}, {}, "model.layers.0.self_attn.q_proj", []),
    ({}, {}, "lm_head", [Reason.LAST_LINEAR]),
    ({}, {}, "model.layers.0.self_attn.o_proj", []),
    ({}, {}, "model.layers.0.mlp.down_proj", [Reason.DIM_NOT_DIVISIBLE]),
    ({}, {}, "model.layers.1.mlp.gate", [Reason.ROUTER_GATE]),
    ({}, {}, "model.layers.1.mlp.experts.1.w2", []),
    ({"exclude": ("experts.1",)}, {}, "model.layers.1.mlp.experts.1.w2", [Reason.EXCLUDED]),
    ({"exclude": ("layers.1.self_attn",)}, {}, "model.layers.1.self_attn.o_proj", [Reason.EXCLUDED]),
    ({"include": ("mlp",)}, {}, "model.layers.1.self_attn.o_proj", [Reason.NOT_INCLUDED]),
    ({"include": ("mlp",)}, {}, "model.layers.0.mlp.up_proj", []),
    ({}, {"tied": True}, "lm_head", [Reason.LAST_LINEAR, Reason.TIED_HEAD]),
    # a tied head the files leave out is still the last Linear: no stored one is
    ({}, {"tied": True, "head_stored": False}, "model.layers.1.mlp.gate", [Reason.ROUTER_GATE]),
    ({}, {"tied": True, "head_stored": False}, "model.layers.1.mlp.experts.1.w2", []),
])
def test_both_walks_reach_the_same_reasons(settings, model, layer, reasons):
    analysis, stored = both_walks(settings, **model)
    assert stored[layer] == reasons
    if model.get("head_stored", True):
        assert analysis[layer] == reasons
    else:  # the analysis sees the head the files leave out
        assert analysis[layer] == reasons and analysis["lm_head"] == [Reason.LAST_LINEAR, Reason.TIED_HEAD]


def test_the_header_walk_holds_back_what_the_analysis_lists_as_partly_eligible():
    analysis, stored = both_walks({"exclude": ("layers.0.mlp.up_proj",)})
    assert analysis["model.layers.0.mlp.gate_proj"] == []  # the serving export drops it later, from the report
    assert stored["model.layers.0.mlp.gate_proj"] == ["fused_group_not_fully_eligible:model.layers.0.mlp.gate_up"]
    analysis, stored = both_walks({"exclude": ("experts.1.w2",)})
    assert analysis["model.layers.1.mlp.experts.0.w1"] == []
    assert stored["model.layers.1.mlp.experts.0.w1"] == ["fused_group_not_fully_eligible:model.layers.1.mlp.experts.w2"]
