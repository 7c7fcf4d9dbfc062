"""Mixture-of-experts: per-expert analysis, calibration on the routed tokens, TE GroupedLinear state layout.

Fixtures are tiny Mixtral and Qwen2-MoE models with a trained tokenizer, saved with save_pretrained: the
routing is the model's own, and the on-disk tensors are the per-expert ones real checkpoints hold.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from converters.analysis.eligibility import analyze_model, eligible_expert_units
from converters.backends.te.layout import state_key
from converters.calibration.amax import LayerAmax, record_amax, te_scaling_state
from converters.calibration.batches import calibration_batches
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_model, load_tokenizer
from converters.pipeline.driver import ConversionRequest, run_conversion
from converters.pipeline.request import CalibrationSettings
from converters.pipeline.stages import model_inputs
from converters.recipes import TEDelayedScalingRecipe
from tests.models import MOE_CONFIGS

# on-disk names of one expert's three matrices: (gate, up, down)
ON_DISK = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                       "block_sparse_moe.experts.{e}.w2"),
           "qwen2_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")}


def _load(moe_root, name, implementation="eager"):
    directory = moe_root / name
    sources = ModelSourceOptions(allowed_roots=(moe_root,))
    config = load_config(directory, sources)
    model = load_model(directory, sources)
    model.set_experts_implementation(implementation)
    tokenizer = load_tokenizer(directory, sources)
    batches, _ = calibration_batches(tokenizer, vocab_size=config.vocab_size, steps=3, batch_size=2, seq_len=24)
    return model, [model_inputs(model, config, batch) for batch in batches], config


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_experts_hold_over_95_percent_of_fp8_matmul_weights_by_default(moe_root, name):
    sources = ModelSourceOptions(allowed_roots=(moe_root,))
    report = analyze_model(build_meta_model(load_config(moe_root / name, sources), sources))
    totals = report["totals"]
    assert totals["fp8_share_of_all_matmul_parameters"] > 0.95, totals
    assert totals["eligible_expert_units"] == totals["expert_units"] == 2 * 8 * 2
    gates = [entry for entry in report["other_weights"] if entry["path"].endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(entry["reason"] == "router_parameter" for entry in gates)
    assert [block["experts"] for block in report["moe"]] == [8, 8]


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_per_expert_amax_equals_a_direct_computation_from_the_routed_tokens(moe_root, name):
    model, batches, config = _load(moe_root, name)
    units = eligible_expert_units(analyze_model(model))
    recorded = record_amax(model, units, batches)

    # the same quantities from scratch: the block's input and the router's choice captured on the real forward,
    # the expert's matrices read from the checkpoint file under their on-disk names
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    block = model.model.layers[1].mlp
    handle = block.gate.register_forward_hook(lambda _m, args, out: seen.append((args[0].detach(), out[2])))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    disk = load_file(moe_root / name / "model.safetensors")
    act = nn.SiLU()
    for e in range(8):
        gate_w, up_w, down_w = (disk[f"model.layers.1.{key.format(e=e)}.weight"] for key in ON_DISK[name])
        for step, (hidden, chosen) in enumerate(seen):
            tokens = (chosen == e).any(dim=-1)
            x = hidden.reshape(-1, hidden.shape[-1])[tokens]
            gate, up = x @ gate_w.T, x @ up_w.T
            activated = act(gate) * up
            expected_gate_up = [x.abs().max(), torch.cat([gate_w, up_w]).abs().max(),
                                torch.cat([gate, up], -1).abs().max()]
            expected_down = [activated.abs().max(), down_w.abs().max(), (activated @ down_w.T).abs().max()]
            for gemm, expected in (("gate_up_proj", expected_gate_up), ("down_proj", expected_down)):
                got = recorded[f"model.layers.1.mlp.experts.{e}.{gemm}"]
                torch.testing.assert_close(got.forward[step], torch.stack(expected).float(), rtol=1e-5, atol=0)
            assert int(recorded[f"model.layers.1.mlp.experts.{e}.gate_up_proj"].tokens[step]) == int(tokens.sum())


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_every_experts_implementation_records_the_same_amax(moe_root, name):
    results = {}
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        model, batches, _ = _load(moe_root, name, implementation)
        results[implementation] = record_amax(model, eligible_expert_units(analyze_model(model)), batches)
    for unit, eager in results["eager"].items():
        for implementation in ("grouped_mm", "batched_mm"):
            got = results[implementation][unit]
            assert torch.equal(got.tokens, eager.tokens), (implementation, unit)
            if unit.startswith("model.layers.0."):  # same inputs: the measurement itself is bit-identical
                assert torch.equal(got.forward, eager.forward), (implementation, unit)
            else:  # later layers see the earlier layers' outputs, which the kernels round differently (~1e-7)
                torch.testing.assert_close(got.forward, eager.forward, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_per_expert_gradient_amax_equals_the_eager_experts_own_gemm_gradients(moe_root, name, monkeypatch):
    """Backward calibration: each expert GEMM's grad_output / grad_input amax, against the gradients of the very
    GEMM outputs and inputs transformers' eager experts compute (each nn.functional.linear call kept with
    retain_grad on a separate forward and backward of the same batches)."""
    from converters.calibration.amax import _backward_loss

    model, batches, _ = _load(moe_root, name)
    units = eligible_expert_units(analyze_model(model))
    recorded = record_amax(model, units, batches, backward=True)

    experts = {f"model.layers.{i}.mlp.experts": layer.mlp.experts for i, layer in enumerate(model.model.layers)}
    by_pointer = {getattr(module, gemm)[e].data_ptr(): f"{path}.{e}.{gemm}" for path, module in experts.items()
                  for gemm in ("gate_up_proj", "down_proj") for e in range(module.gate_up_proj.shape[0])}
    linear, calls = nn.functional.linear, []

    def kept_linear(inp, weight, bias=None):
        if weight.data_ptr() not in by_pointer or weight.dim() != 2:
            return linear(inp, weight, bias)
        inp.retain_grad()
        out = linear(inp, weight, bias)
        out.retain_grad()
        calls.append((by_pointer[weight.data_ptr()], inp, out))
        return out

    monkeypatch.setattr(nn.functional, "linear", kept_linear)
    model.eval()
    for step, batch in enumerate(batches):
        calls.clear()
        with torch.enable_grad():
            _backward_loss(model, batch).backward()
        model.zero_grad(set_to_none=True)
        expected = {}
        for unit, inp, out in calls:
            pair = torch.stack([out.grad.abs().max(), inp.grad.abs().max()]).float()
            expected[unit] = torch.fmax(expected.get(unit, torch.zeros(2)), pair)
        assert len(expected) > 8  # the eager loop ran the routed experts of both layers
        for unit in units:
            got = recorded[unit].backward[step]
            if unit in expected:
                torch.testing.assert_close(got, expected[unit], rtol=1e-4, atol=1e-12)
            else:  # no token routed to this expert in this step: nothing reached it
                assert torch.equal(got, torch.zeros(2)), unit


def test_backward_calibration_seeds_the_experts_backward_te_state(moe_root):
    model, batches, _ = _load(moe_root, "mixtral")
    unit = "model.layers.0.mlp.experts.1.down_proj"
    layer_amax = record_amax(model, [unit], batches, backward=True)[unit]
    assert layer_amax.backward[:, 0].gt(0).any() and layer_amax.backward[:, 1].gt(0).any()
    state = te_scaling_state(layer_amax, TEDelayedScalingRecipe(amax_history_len=4))
    assert state["amax_history_bwd"][:, 0].gt(0).any() and state["scale_bwd"][0] != 1
    assert state["amax_history_bwd"][:, 1].eq(0).all() and state["scale_bwd"][1] == 1  # grad_input never cast


def _starve_expert(model: nn.Module, expert: int, num_experts: int) -> list:
    """Router hooks that send every token elsewhere: ``expert`` is replaced by the next free expert."""
    def hook(_module, _args, output):
        logits, scores, indices = output
        indices = indices.clone()
        for row in range(indices.shape[0]):
            if expert in indices[row]:
                free = next(e for e in range(num_experts) if e != expert and e not in indices[row])
                indices[row][indices[row] == expert] = free
        return logits, scores, indices

    return [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]


def starve_expert_in_calibration(monkeypatch, expert: int, num_experts: int) -> None:
    """Whole-model calibration of any conversion in this test runs with ``expert`` starved of tokens."""
    from converters.pipeline import stages

    real_calibrate = stages._calibrate_whole_model

    def starved_calibration(run, batches, paths):
        hooks = _starve_expert(run.model, expert, num_experts)
        try:
            return real_calibrate(run, batches, paths)
        finally:
            for hook in hooks:
                hook.remove()

    monkeypatch.setattr(stages, "_calibrate_whole_model", starved_calibration)


def test_an_expert_without_tokens_gets_finite_weight_only_state_and_a_warning(moe_root, tmp_path, monkeypatch):
    recipe = TEDelayedScalingRecipe(amax_history_len=8)
    model, batches, _ = _load(moe_root, "mixtral")
    handles = _starve_expert(model, 5, 8)
    recorded = record_amax(model, eligible_expert_units(analyze_model(model)), batches)
    for handle in handles:
        handle.remove()
    starved = recorded["model.layers.0.mlp.experts.5.gate_up_proj"]
    assert int(starved.tokens.sum()) == 0
    assert torch.all(starved.forward[:, 0] == 0) and torch.all(starved.forward[:, 2] == 0)
    assert torch.all(starved.forward[:, 1] > 0)  # TE casts every expert's weight, routed or not
    state = te_scaling_state(starved, recipe)
    assert all(torch.isfinite(value).all() for value in state.values())
    assert state["scale_fwd"][0] == 1.0 and state["scale_fwd"][1] != 1.0

    # the same through a conversion: the report names the expert and the state file stays finite
    starve_expert_in_calibration(monkeypatch, 5, 8)
    request = ConversionRequest(model=str(moe_root / "mixtral"), recipe={"backend": "te", "amax_history_len": 8},
                                calibration=CalibrationSettings(steps=3, seq_len=24, backward=True))
    run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(moe_root,)))
    report = json.loads((tmp_path / "out" / "fp8_report.json").read_text())
    blocks = {block["module"]: block for block in report["analysis"]["moe"]}
    assert blocks["model.layers.0.mlp.experts"]["experts_without_tokens"] == [5]
    assert blocks["model.layers.0.mlp.experts"]["tokens_per_expert"][5] == 0
    warning = "model.layers.0.mlp.experts: expert(s) [5] received no calibration token"
    assert any(warning in line for line in report["warnings"])
    state = load_file(tmp_path / "out" / "fp8_state.safetensors")
    assert all(torch.isfinite(value).all() for value in state.values())


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_te_state_is_grouped_linear_slot_order_and_layer_sequential_equals_whole_model(moe_root, name, tmp_path):
    recipe = {"backend": "te", "amax_history_len": 16, "margin": 1}
    states = {}
    for mode, backward in (("layer_sequential", False), ("whole_model", True)):
        out = tmp_path / mode
        request = ConversionRequest(model=str(moe_root / name), recipe=recipe,
                                    calibration=CalibrationSettings(steps=3, seq_len=24, backward=backward))
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(moe_root,)))
        report = json.loads((out / "fp8_report.json").read_text())
        assert report["pipeline"]["mode"] == mode
        assert json.loads((out / "config.json").read_text())["fp8"]["converted_experts"] == [
            f"model.layers.{i}.mlp.experts.{gemm}" for i in range(2) for gemm in ("gate_up_proj", "down_proj")]
        states[mode] = (load_file(out / "fp8_state.safetensors"), load_file(out / "fp8_calibration.safetensors"))

    state, calibration = states["layer_sequential"]
    parsed = TEDelayedScalingRecipe(amax_history_len=16, margin=1)

    for layer in range(2):
        for gemm in ("gate_up_proj", "down_proj"):
            group = f"model.layers.{layer}.mlp.experts.{gemm}"
            assert state[state_key(group, "amax_history_fwd")].shape == (16, 3 * 8)
            assert state[state_key(group, "scale_bwd")].shape == (2 * 8,)
            for e in range(8):
                unit = f"model.layers.{layer}.mlp.experts.{e}.{gemm}"
                alone = te_scaling_state(LayerAmax(forward=calibration[f"{unit}.amax_forward"]), parsed)
                # GroupedLinear: forward slots 3e (input), 3e+1 (weight), 3e+2 (output); backward 2e, 2e+1
                for name_, width in (("scale_fwd", 3), ("amax_history_fwd", 3), ("scale_bwd", 2),
                                     ("amax_history_bwd", 2)):
                    grouped = state[state_key(group, name_)]
                    assert torch.equal(grouped[..., width * e:width * (e + 1)], alone[name_]), (unit, name_)
            assert torch.all(state[state_key(group, "scale_fwd")][2::3] == 1.0)  # outputs are never cast
    # one layer in memory at a time gives the whole model's numbers
    whole_calibration = states["whole_model"][1]
    for key, value in calibration.items():
        if ".experts." in key:
            assert torch.equal(value, whole_calibration[key]), key


def test_excluded_experts_keep_their_group_out_of_the_te_state(moe_root, tmp_path):
    request = ConversionRequest(model=str(moe_root / "mixtral"), recipe={"backend": "te", "amax_history_len": 4},
                                exclude=("model.layers.1.mlp.experts.2",),
                                calibration=CalibrationSettings(steps=2, seq_len=24))
    run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(moe_root,)))
    block = json.loads((tmp_path / "out" / "config.json").read_text())["fp8"]
    assert "model.layers.1.mlp.experts.gate_up_proj" not in block["converted_experts"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in block["converted_experts"]
    state = load_file(tmp_path / "out" / "fp8_state.safetensors")
    assert state_key("model.layers.1.mlp.experts.gate_up_proj", "scale_fwd") not in state
    report = json.loads((tmp_path / "out" / "fp8_report.json").read_text())
    assert any("model.layers.1.mlp.experts.gate_up_proj is only partly FP8" in w for w in report["warnings"])
