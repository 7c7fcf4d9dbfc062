"""The decision table's ``trained`` option (a training artifact's serving export, converters.sync): rows for its
reasons and their place after the others, the whole-group rule it adds, and the same rows reached through sync's
report of stored headers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from converters.analysis.decision import DecisionOptions, LayerKind, LayerRecord, decide, with_groups
from converters.analysis.reasons import Reason
from converters.modelfree.targets import model_free_target
from converters.recipes.requirements import FP8_RULE
from converters.sync.driver import _decide as sync_decide


def record(name="layers.0.mlp.up_proj", shape=(64, 64), kind=LayerKind.LINEAR, **flags):
    out_features, in_features = shape
    return LayerRecord(name=name, kind=kind, shape=shape, in_features=in_features, out_features=out_features,
                       dtype="bfloat16", parameters=in_features * out_features, **flags)


def options(**overrides):
    return DecisionOptions(**{"format": "test", "shape_rule": FP8_RULE, "whole_groups": True, **overrides})


@pytest.mark.parametrize(("layer", "trained", "reasons"), [
    (record(), {"layers.0.mlp.up_proj"}, []),
    (record(), set(), [Reason.NOT_CONVERTED_IN_TRAINING]),
    (record(), {"layers.0.mlp.down_proj"}, [Reason.NOT_CONVERTED_IN_TRAINING]),
    # an expert is never synced, whether training listed it or not
    (record("moe.experts.0.w1", kind=LayerKind.EXPERT), {"moe.experts.0.w1"}, [Reason.EXPERTS_NOT_SYNCED]),
    (record("moe.experts.0.w1", kind=LayerKind.EXPERT), set(), [Reason.EXPERTS_NOT_SYNCED]),
    # the training reasons come after the table's own
    (record(shape=(40, 64)), set(), [Reason.DIM_NOT_DIVISIBLE, Reason.NOT_CONVERTED_IN_TRAINING]),
    (record(shape=(40, 64)), {"layers.0.mlp.up_proj"}, [Reason.DIM_NOT_DIVISIBLE]),
    (record(router=True), set(), [Reason.ROUTER_GATE, Reason.NOT_CONVERTED_IN_TRAINING]),
    (record(kind=LayerKind.CONV1D), set(), [Reason.NOT_LINEAR, Reason.NOT_CONVERTED_IN_TRAINING]),
    (record(first=True), {"layers.0.mlp.up_proj"}, [Reason.FIRST_LINEAR]),
])
def test_the_training_reasons_follow_the_tables_own(layer, trained, reasons):
    (decision,) = decide([layer], options(trained=trained))
    assert list(decision.reasons) == reasons
    assert decision.eligible is (not reasons)
    (untrained,) = decide([layer], options())  # without the option the table is unchanged
    assert Reason.NOT_CONVERTED_IN_TRAINING not in untrained.reasons
    assert Reason.EXPERTS_NOT_SYNCED not in untrained.reasons


def qkv(k_shape=(64, 64)):
    records, _ = with_groups([record("attn.q_proj"), record("attn.k_proj", shape=k_shape), record("attn.v_proj"),
                              record("attn.o_proj")])
    return records


def test_a_group_training_converted_in_part_is_held_back_whole_naming_it():
    decisions = {d.name: d for d in decide(qkv(), options(trained={"attn.k_proj", "attn.v_proj", "attn.o_proj"}))}
    assert decisions["attn.q_proj"].reason_codes() == ["not_converted_in_training"]
    assert decisions["attn.k_proj"].reason_codes() == decisions["attn.v_proj"].reason_codes() == [
        "fused_group_not_fully_converted:attn.qkv"]
    assert decisions["attn.o_proj"].eligible and decisions["attn.o_proj"].scale_group == "attn.o_proj"
    whole = decide(qkv(), options(trained={"attn.q_proj", "attn.k_proj", "attn.v_proj"}))
    assert [d.scale_group for d in whole] == ["attn.qkv"] * 3 + [None]


def test_a_group_held_back_by_a_shape_keeps_that_reason_before_the_training_ones():
    """k_proj fails the shape rule: q/v are held back by the format (the whole-group rule runs first), and the one
    training left out says so after."""
    decisions = decide(qkv(k_shape=(40, 64)), options(trained={"attn.q_proj", "attn.k_proj"}))
    assert [d.reason_codes() for d in decisions] == [
        ["fused_group_not_fully_eligible:attn.qkv"], ["dim_not_divisible_by_16"],
        ["fused_group_not_fully_eligible:attn.qkv", "not_converted_in_training"], ["not_converted_in_training"]]


@pytest.mark.parametrize(("bad", "match"), [
    ({"trained": "attn.q_proj"}, "trained must be a collection"), ({"trained": [1]}, "trained must be a collection"),
    ({"trained": set(), "whole_groups": False}, "trained needs whole_groups")])
def test_bad_trained_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        options(**bad)


def tensor(*shape):
    return SimpleNamespace(dtype="BF16", shape=list(shape))


def test_sync_reports_the_tables_training_rows_for_stored_experts_and_groups():
    """Sync only serialises the table: a Mixtral-like header, training having converted all but layer 0's q_proj."""
    header = {"model.embed_tokens.weight": tensor(256, 128), "lm_head.weight": tensor(256, 128),
              "model.layers.0.block_sparse_moe.gate.weight": tensor(4, 128)}
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        header[f"model.layers.0.self_attn.{leaf}.weight"] = tensor(128, 128)
    for leaf, shape in (("w1", (256, 128)), ("w2", (128, 256)), ("w3", (256, 128))):
        header[f"model.layers.0.block_sparse_moe.experts.0.{leaf}.weight"] = tensor(*shape)
    modules = [key.removesuffix(".weight") for key in header if "embed" not in key and "q_proj" not in key]
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "bfloat16"}
    report = sync_decide({"model.safetensors": header}, config, {"converted_modules": modules + ["gone.proj"]},
                         model_free_target("fp8-block"))
    reasons = {layer["module"].removeprefix("model.layers.0."): layer["reasons"] for layer in report["layers"]}
    assert reasons == {
        "self_attn.q_proj": ["not_converted_in_training"],
        "self_attn.k_proj": ["fused_group_not_fully_converted:model.layers.0.self_attn.qkv"],
        "self_attn.v_proj": ["fused_group_not_fully_converted:model.layers.0.self_attn.qkv"],
        "self_attn.o_proj": [],
        "block_sparse_moe.gate": ["dim_not_divisible_by_16", "moe_router_gate"],
        "block_sparse_moe.experts.0.w1": ["experts_not_synced"],
        "block_sparse_moe.experts.0.w2": ["experts_not_synced"],
        "block_sparse_moe.experts.0.w3": ["experts_not_synced"],
        "lm_head": [],
    }
    assert report["quantized"] == {"model.layers.0.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj",
                                   "lm_head.weight": "lm_head"}
    assert report["not_stored"] == ["gone.proj"]
    assert report["differs_from_training"] == [
        "model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.0.block_sparse_moe.experts.0.w2",
        "model.layers.0.block_sparse_moe.experts.0.w3", "model.layers.0.block_sparse_moe.gate",
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
