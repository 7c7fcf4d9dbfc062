"""The eligibility rule table, on hand-built modules and on tiny Hugging Face architectures."""

import pytest
import torch
from torch import nn

from converters.analysis.eligibility import AnalysisOptions, analyze_model, eligible_paths
from converters.analysis.patterns import matches
from converters.analysis.reasons import Reason
from converters.errors import Fp8ForgeError
from tests.models import tiny_config


class Stack(nn.Module):
    """first (64->64), a body of the given shapes, last (64->32)."""

    def __init__(self, body_shapes):
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.body = nn.ModuleList(nn.Linear(i, o) for i, o in body_shapes)
        self.last = nn.Linear(64, 32)


def verdicts(model, **options):
    report = analyze_model(model, AnalysisOptions(**options))
    return {layer["path"]: layer["reasons"] for layer in report["layers"]}


@pytest.mark.parametrize(
    ("shape", "reasons"),
    [
        ((64, 64), []),
        ((64, 48), []),
        ((16, 16), []),
        ((64, 40), [Reason.DIM_NOT_DIVISIBLE]),
        ((40, 64), [Reason.DIM_NOT_DIVISIBLE]),
        ((8, 8), [Reason.DIM_NOT_DIVISIBLE]),
        ((64, 1), [Reason.DIM_NOT_DIVISIBLE]),
    ],
)
def test_divisibility_rule(shape, reasons):
    assert verdicts(Stack([shape]))["body.0"] == reasons


def test_first_and_last_linear_skipped_by_default_and_on_request_only():
    default = verdicts(Stack([(64, 64)]))
    assert default["first"] == [Reason.FIRST_LINEAR]
    assert default["last"] == [Reason.LAST_LINEAR]
    kept = verdicts(Stack([(64, 64)]), skip_first_last=False)
    assert kept["first"] == [] and kept["last"] == []


def test_a_layer_can_carry_several_reasons():
    model = Stack([(64, 64)])
    model.last = nn.Linear(64, 10)
    assert verdicts(model, exclude=("last",))["last"] == [
        Reason.DIM_NOT_DIVISIBLE,
        Reason.LAST_LINEAR,
        Reason.EXCLUDED,
    ]


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("layers.2", "model.layers.2.mlp.up_proj", True),
        ("layers.2", "model.layers.20.mlp.up_proj", False),
        ("layers.2*", "model.layers.20.mlp.up_proj", True),
        ("q_proj", "model.layers.0.self_attn.q_proj", True),
        ("q_pro", "model.layers.0.self_attn.q_proj", False),
        ("*.mlp.*", "model.layers.0.mlp.down_proj", True),
        ("mlp.*", "model.layers.0.self_attn.o_proj", False),
        ("model.**.down_proj", "model.layers.3.mlp.down_proj", True),
        ("lm_head", "lm_head", True),
        ("layers.[0-1].self_attn", "model.layers.1.self_attn.k_proj", True),
    ],
)
def test_patterns_match_whole_segments(pattern, path, expected):
    assert matches(pattern, path) is expected


def test_include_and_exclude_patterns():
    model = Stack([(64, 64)] * 12)
    result = verdicts(model, include=("body.1*",), exclude=("body.11",))
    assert result["body.1"] == [] and result["body.10"] == []
    assert result["body.11"] == [Reason.EXCLUDED]
    assert result["body.2"] == [Reason.NOT_INCLUDED]


@pytest.mark.parametrize("bad", ["", "layers..2", "a b", "x/y"])
def test_bad_patterns_are_rejected_with_the_field(bad):
    with pytest.raises(Fp8ForgeError) as error:
        AnalysisOptions(exclude=("ok", bad))
    assert error.value.field == "exclude[1]"


def test_unknown_backend_is_rejected():
    with pytest.raises(Fp8ForgeError, match="backend must be one of"):
        AnalysisOptions(backend="fp4")


def meta_model(name):
    from transformers import AutoModelForCausalLM, BertModel

    config = tiny_config(name)
    with torch.device("meta"):
        return BertModel(config) if name == "bert" else AutoModelForCausalLM.from_config(config)


def test_llama_first_is_q_proj_and_last_is_lm_head():
    report = analyze_model(meta_model("llama"))
    reasons = {layer["path"]: layer["reasons"] for layer in report["layers"]}
    assert reasons["model.layers.0.self_attn.q_proj"] == [Reason.FIRST_LINEAR]
    assert reasons["lm_head"] == [Reason.LAST_LINEAR]
    assert report["totals"]["linear_layers"] == 15 and report["totals"]["eligible_layers"] == 13
    assert report["layers"][0]["dtype"] == "float32" and report["layers"][0]["parameters"] == 64 * 64


def test_partly_eligible_fused_group_is_flagged():
    report = analyze_model(meta_model("llama"))
    groups = {group["name"]: group for group in report["fused_groups"]}
    assert groups["model.layers.0.self_attn.qkv"]["partly_eligible"] is True
    assert groups["model.layers.1.self_attn.qkv"]["partly_eligible"] is False
    assert groups["model.layers.1.mlp.gate_up"]["eligible_members"] == [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert report["totals"]["partly_eligible_groups"] == 1


def test_mixtral_experts_are_units_per_expert_gemm_and_the_router_stays_out():
    report = analyze_model(meta_model("mixtral"))
    other = {entry["path"]: entry for entry in report["other_weights"]}
    assert not any("experts" in path for path in other)  # listed per expert GEMM among the layers instead
    assert other["model.layers.0.mlp.gate.weight"]["reason"] == Reason.ROUTER_WEIGHT
    units = {layer["path"]: layer for layer in report["layers"] if "expert" in layer}
    assert len(units) == 2 * 4 * 2  # layers x experts x (gate_up, down)
    gate_up, down = units["model.layers.1.mlp.experts.3.gate_up_proj"], units["model.layers.1.mlp.experts.3.down_proj"]
    assert (gate_up["in_features"], gate_up["out_features"], down["in_features"], down["out_features"]) == (
        64, 256, 128, 64)
    assert gate_up["eligible"] and gate_up["group"] == "model.layers.1.mlp.experts.gate_up_proj"
    totals = report["totals"]
    assert totals["expert_parameters"] == 2 * 4 * (64 * 256 + 128 * 64) and totals["eligible_expert_units"] == 16
    excluded = analyze_model(meta_model("mixtral"), AnalysisOptions(exclude=("experts",)))
    assert not any(layer["eligible"] for layer in excluded["layers"] if "expert" in layer)
    assert excluded["totals"]["fp8_share_of_all_matmul_parameters"] < totals["fp8_share_of_all_matmul_parameters"]


class MoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 16)
        self.experts = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.shared_expert_gate = nn.Linear(64, 16)


def test_router_gates_skipped_by_default():
    model = nn.Sequential(nn.Linear(64, 64), MoeBlock(), nn.Linear(64, 64))
    result = verdicts(model)
    assert result["1.gate"] == [Reason.ROUTER_GATE]
    assert result["1.shared_expert_gate"] == [Reason.ROUTER_GATE]
    assert result["1.experts.0"] == []
    assert verdicts(model, convert_router_gates=True)["1.gate"] == []


def test_tied_head_is_reported_as_tied():
    report = analyze_model(meta_model("gemma"))
    head = next(layer for layer in report["layers"] if layer["path"] == "lm_head")
    assert Reason.TIED_HEAD in head["reasons"]
    untied = analyze_model(meta_model("qwen2"))
    assert Reason.TIED_HEAD not in next(layer for layer in untied["layers"] if layer["path"] == "lm_head")["reasons"]


def test_gpt2_conv1d_listed_as_not_a_linear():
    report = analyze_model(meta_model("gpt2"))
    conv = [layer for layer in report["layers"] if layer["class"] == "Conv1D"]
    assert len(conv) == 8 and all(layer["reasons"] == [Reason.NOT_LINEAR] for layer in conv)
    attn = next(layer for layer in conv if layer["path"] == "transformer.h.0.attn.c_attn")
    assert (attn["in_features"], attn["out_features"]) == (64, 192)
    assert report["totals"]["eligible_layers"] == 0


def test_analysis_does_not_mutate_the_model():
    model = meta_model("llama")
    before = [(name, type(module)) for name, module in model.named_modules()]
    analyze_model(model, AnalysisOptions(exclude=("mlp",)))
    assert [(name, type(module)) for name, module in model.named_modules()] == before


def test_eligible_paths_follow_model_order():
    report = analyze_model(meta_model("llama"))
    paths = eligible_paths(report)
    assert paths[0] == "model.layers.0.self_attn.k_proj" and paths[-1] == "model.layers.1.mlp.down_proj"


def test_weight_byte_estimate():
    report = analyze_model(Stack([(64, 64)]))
    totals = report["totals"]
    assert totals["weight_bytes_bf16"] == 2 * totals["model_parameters"]
    assert totals["weight_bytes_fp8"] == totals["weight_bytes_bf16"] - 64 * 64
