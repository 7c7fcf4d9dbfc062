"""Loading MoE training artifacts: experts on TE's GroupedLinear (CUDA + TE) and on torchao's FP8 grouped GEMM
(CUDA compute capability 9.0/10.0 with triton; high precision elsewhere, said plainly).

On a CPU: the grouped experts forward (sort by expert, padded splits, gating, weighted sum back) against the eager
experts forward of transformers, the GroupedLinear state read back from a real TE artifact, and a torchao artifact
that loads and trains. The TE and torchao FP8 kernels themselves run only where they can; those tests skip here.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from converters.backends.loaders import load_torchao
from converters.backends.te.grouped import (
    GroupedExperts,
    TorchGroupedLinear,
    check_grouped_state,
    route_tokens,
)
from converters.backends.te.layout import state_key
from converters.backends.te.loader import load_te_model, read_te_artifact
from converters.backends.te.runtime import te_status
from converters.backends.torchao.experts import (
    convert_experts_to_torchao,
    experts_config_fields,
    experts_config_from_dict,
    fp8_grouped_gemm_unavailable,
)
from converters.errors import ConversionError, ModelNotFoundError
from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.driver import ConversionRequest, run_conversion
from converters.pipeline.request import CalibrationSettings
from converters.recipes import recipe_from_dict
from tests.models import MOE_CONFIGS

TE_OK, TE_WHY = te_status()
needs_te = pytest.mark.skipif(not TE_OK, reason=f"needs CUDA and TransformerEngine: {TE_WHY}")
AO_WHY = fp8_grouped_gemm_unavailable("cuda")
needs_ao_fp8 = pytest.mark.skipif(AO_WHY is not None, reason=f"torchao's FP8 grouped GEMM cannot run: {AO_WHY}")

EXPERTS = 8
GEMMS = [f"model.layers.{i}.mlp.experts.{gemm}" for i in range(2) for gemm in ("gate_up_proj", "down_proj")]
HISTORY = 4


def _convert(moe_root, out, recipe, name="mixtral", backward=False):
    request = ConversionRequest(model=str(moe_root / name), recipe=recipe,
                                calibration=CalibrationSettings(steps=2, seq_len=24, backward=backward))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(moe_root,)))
    return out


@pytest.fixture(scope="module")
def te_artifact(moe_root, tmp_path_factory):
    return _convert(moe_root, tmp_path_factory.mktemp("te") / "out", {"backend": "te", "amax_history_len": HISTORY})


@pytest.fixture(scope="module")
def ao_artifact(moe_root, tmp_path_factory):
    return _convert(moe_root, tmp_path_factory.mktemp("ao") / "out", {"backend": "ao"})


def _model(moe_root, name):
    model = load_model(moe_root / name, ModelSourceOptions(allowed_roots=(moe_root,)))
    model.set_experts_implementation("eager")
    return model


def _routed_inputs(model, tokens=40, seed=0):
    """Hidden states, the router's choice and weights of layer 0's experts on a real forward (one expert starved)."""
    seen = []
    block = model.model.layers[0].mlp
    handle = block.experts.register_forward_pre_hook(lambda _m, args: seen.append([a.detach() for a in args]))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 200, (2, tokens // 2), generator=torch.Generator().manual_seed(seed)))
    handle.remove()
    hidden, index, weights = seen[0]
    index = torch.where(index == 3, torch.full_like(index, EXPERTS), index)  # expert 3 gets nothing ...
    return hidden, index, weights  # ... its pairs go to the expert-parallel sentinel, which the forward drops


# --- the token sort / splits / unsort (no TE) -----------------------------------------------------------

@pytest.mark.parametrize(
    ("top_k_index", "align", "m_splits", "rows"),
    [
        ([[1, 0], [0, 2], [2, 1]], 1, [2, 2, 2, 0], [0, 1, 2, 3, 4, 5]),
        ([[1, 0], [0, 2], [2, 1]], 4, [4, 4, 4, 0], [0, 1, 4, 5, 8, 9]),
        ([[3, 4], [0, 3]], 16, [16, 0, 0, 16], [0, 16, 17]),  # 4: the sentinel, dropped
    ],
)
def test_route_tokens_groups_pairs_by_expert_in_padded_splits(top_k_index, align, m_splits, rows):
    routing = route_tokens(torch.tensor(top_k_index), 4, align=align)
    assert routing.m_splits == m_splits and routing.num_rows == sum(m_splits)
    assert routing.rows.tolist() == rows
    flat = torch.tensor(top_k_index).reshape(-1)
    experts = flat[routing.pair_index]
    assert experts.tolist() == sorted(experts.tolist())  # grouped by expert, in expert order
    assert routing.token_index.tolist() == (routing.pair_index // 2).tolist()


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_grouped_experts_equal_the_eager_forward_and_backward(moe_root, name, align):
    model = _model(moe_root, name)
    experts = model.model.layers[0].mlp.experts
    hidden, index, weights = _routed_inputs(model)
    grouped = GroupedExperts(experts, TorchGroupedLinear(experts.gate_up_proj), TorchGroupedLinear(experts.down_proj),
                             align=align)
    results = []
    for module in (experts, grouped):
        experts.zero_grad(set_to_none=True)
        inp = hidden.clone().requires_grad_(True)
        out = module(inp, index, weights)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), inp.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for eager, got in zip(*results, strict=True):
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    assert torch.all(results[1][2][3] == 0)  # the starved expert: no gradient


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_a_model_with_grouped_experts_gives_the_same_logits(moe_root, name):
    model = _model(moe_root, name)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for layer in model.model.layers:
            experts = layer.mlp.experts
            layer.mlp.experts = GroupedExperts(experts, TorchGroupedLinear(experts.gate_up_proj),
                                               TorchGroupedLinear(experts.down_proj), align=16)
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- the TE artifact's GroupedLinear state, read without TE ----------------------------------------------

def test_te_artifact_reads_grouped_state_per_experts_gemm(te_artifact):
    artifact = read_te_artifact(te_artifact)
    assert artifact.converted_experts == tuple(GEMMS)
    assert set(artifact.expert_states) == set(GEMMS)
    assert not set(artifact.scaling_states) & set(GEMMS)  # te.Linear state apart
    files = load_file(te_artifact / "fp8_state.safetensors")
    for gemm, tensors in artifact.expert_states.items():
        assert check_grouped_state(gemm, tensors, HISTORY) == EXPERTS
        assert tensors["amax_history_fwd"].shape == (HISTORY, 3 * EXPERTS)
        assert tensors["scale_bwd"].shape == (2 * EXPERTS,)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, files[state_key(gemm, name)])
        assert torch.all(tensors["scale_bwd"] == 1) and torch.all(tensors["amax_history_bwd"] == 0)


def test_a_backward_calibrated_te_artifact_seeds_each_experts_grad_output_slot(moe_root, tmp_path):
    artifact = read_te_artifact(_convert(moe_root, tmp_path / "out", {"backend": "te", "amax_history_len": HISTORY},
                                         backward=True))
    for gemm, tensors in artifact.expert_states.items():
        assert check_grouped_state(gemm, tensors, HISTORY) == EXPERTS
        grad_output, grad_input = tensors["amax_history_bwd"][:, 0::2], tensors["amax_history_bwd"][:, 1::2]
        assert grad_output.amax(0).gt(0).sum() >= EXPERTS - 1, gemm  # every expert that got a token
        assert grad_input.eq(0).all() and tensors["scale_bwd"][1::2].eq(1).all(), gemm  # never cast, as in TE
        seeded = grad_output.amax(0).gt(0)
        assert tensors["scale_bwd"][0::2][seeded].ne(1).all(), gemm


def _grouped_state():
    fwd = torch.rand(HISTORY, 3 * EXPERTS) + 0.1
    fwd[:, 2::3] = 0
    return {"scale_fwd": 448.0 / fwd.amax(0).clamp(min=448.0 / 1e4), "amax_history_fwd": fwd,
            "scale_bwd": torch.ones(2 * EXPERTS), "amax_history_bwd": torch.zeros(HISTORY, 2 * EXPERTS)}


def _changed(name, change):
    state = _grouped_state()
    state[name] = change(state[name])
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({k: v for k, v in _grouped_state().items() if k != "scale_bwd"}, "expected"),
        (_changed("scale_fwd", lambda t: t[:-1]), r"scale_fwd: shape \(23,\), expected \(21,\)"),
        (_changed("scale_bwd", lambda t: torch.ones(3 * EXPERTS)), r"scale_bwd: shape \(24,\), expected \(16,\)"),
        (_changed("scale_fwd", lambda t: t[:2]), r"expected \[3E\]"),
        (_changed("amax_history_bwd", lambda t: t[:, :-2]), r"expected \(4, 16\)"),
        (_changed("amax_history_fwd", lambda t: torch.cat([t, t])), "amax_history_len=4"),
        (_changed("amax_history_fwd", lambda t: t.index_fill(1, torch.tensor([10]), -1.0)), r"\(expert 3\)"),
        (_changed("scale_bwd", lambda t: t.index_fill(0, torch.tensor([15]), 0.0)), r"\(expert 7\).*scales must"),
    ],
)
def test_grouped_state_checks_refuse(state, message):
    with pytest.raises(ConversionError, match=message):
        check_grouped_state("model.layers.0.mlp.experts.down_proj", state, HISTORY)


def _edit_fp8(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["fp8"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("experts", "error", "message"),
    [
        (GEMMS[1:], ConversionError, "state without a converted module: \\['model.layers.0.mlp.experts.gate_up"),
        (GEMMS + ["model.layers.0.mlp.gate.gate_up_proj"], ConversionError, "converted without state"),
        (["model.layers.0.mlp.experts.w1"], ModelNotFoundError, "<experts module>.<gemm>"),
        ("model.layers.0.mlp.experts.gate_up_proj", ModelNotFoundError, "distinct module paths"),
    ],
)
def test_te_artifacts_whose_experts_and_state_disagree_are_refused(te_artifact, tmp_path, experts, error, message):
    import shutil

    copy = shutil.copytree(te_artifact, tmp_path / "copy")
    _edit_fp8(copy, converted_experts=experts)
    with pytest.raises(error, match=message):
        read_te_artifact(copy)


# --- torchao: the artifact records the experts config; on this machine the experts train in high precision --

@pytest.mark.parametrize("mode", ["layer_sequential", "whole_model"])
def test_ao_block_records_the_experts_config(ao_artifact, moe_root, tmp_path, mode):
    if mode == "whole_model":  # the swap check runs on the loaded model instead of the meta-device one
        ao_artifact = _convert(moe_root, tmp_path / "out", {"backend": "ao"}, name="qwen2_moe", backward=True)
    assert json.loads((ao_artifact / "fp8_report.json").read_text())["pipeline"]["mode"] == mode
    block = json.loads((ao_artifact / "config.json").read_text())["fp8"]
    assert block["converted_experts"] == GEMMS
    assert block["experts_config"] == {"config": "Float8TrainingOpConfig", "float8_recipe": "rowwise",
                                       "float8_dtype": "float8_e4m3fn", "out_dtype": "bfloat16",
                                       "experts_implementation": "grouped_mm"}


@pytest.mark.skipif(AO_WHY is None, reason="torchao's FP8 grouped GEMM runs here")
def test_ao_artifact_loads_and_trains_on_cpu_with_high_precision_experts(ao_artifact, caplog):
    from torchao.float8.float8_linear import Float8Linear

    with caplog.at_level(logging.WARNING, logger="converters.backends.torchao.experts"):
        model = load_torchao(ao_artifact)
    assert model.training and not model.fp8_experts.fp8 and model.fp8_experts.gemms == tuple(GEMMS)
    note = model.fp8_experts.note
    assert note.startswith("experts run in high precision here: torchao's FP8 grouped GEMM needs CUDA compute "
                           "capability 9.0 or 10.0 (torch._scaled_grouped_mm) with triton, and the model is on cpu")
    assert "the Float8Linear layers run as recorded (emulate=False" in note
    assert note in caplog.text
    assert isinstance(model.model.layers[1].self_attn.q_proj, Float8Linear)

    _assert_experts_train(model, torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0)))


def _assert_experts_train(model, ids):
    """One training step's loss is finite and every converted experts GEMM gets a nonzero, finite gradient."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item())
    for gemm in GEMMS:
        grad = model.get_parameter(gemm).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, gemm


MX_EMULATED = {"backend": "ao", "scaling": "mxfp8_training_op", "kernel_preference": "emulated"}


@pytest.fixture(scope="module")
def mx_artifact(moe_root, tmp_path_factory):
    return _convert(moe_root, tmp_path_factory.mktemp("ao_mx") / "out", MX_EMULATED)


def test_an_mxfp8_job_gives_its_experts_its_own_mxfp8_config(mx_artifact):
    block = json.loads((mx_artifact / "config.json").read_text())["fp8"]
    assert block["converted_experts"] == GEMMS
    assert block["experts_config"] == {"config": "MXFP8TrainingOpConfig", "kernel_preference": "emulated",
                                       "out_dtype": "bfloat16", "wgrad_with_hp": False,
                                       "scale_calculation_mode": "rceil", "pad_token_groups_for_grouped_mm": False,
                                       "experts_implementation": "grouped_mm"}
    assert block["experts_config"] | {"experts_implementation": None} == \
        block["training_op_config"] | {"experts_implementation": None}  # the Linear weights' config, the same


def test_emulated_mxfp8_experts_load_and_train_on_cpu_in_torchao_mxfp8(mx_artifact, moe_root):
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    model = load_torchao(mx_artifact)
    assert model.fp8_experts.fp8 and model.config._experts_implementation == "grouped_mm"
    assert model.fp8_experts.note.startswith("experts run torchao's MXFP8 (emulated) grouped GEMM")
    for gemm in GEMMS:
        assert isinstance(model.get_parameter(gemm), MXFP8TrainingWeightWrapperTensor), gemm

    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = _model(moe_root, "mixtral")  # the source in high precision, eager experts
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(input_ids=ids).logits.float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.1, error  # MXFP8 E4M3 rounding: close to the source, never identical
    _assert_experts_train(model, ids)


def test_mxfp8_experts_for_blackwell_kernels_stay_high_precision_on_cpu_and_say_why(moe_root, tmp_path, caplog):
    artifact = _convert(moe_root, tmp_path / "out", {"backend": "ao", "scaling": "mxfp8_training_op"})
    with caplog.at_level(logging.WARNING, logger="converters.backends.torchao.experts"):
        model = load_torchao(artifact)
    assert not model.fp8_experts.fp8
    assert model.fp8_experts.note.startswith("experts run in high precision here: MXFP8TrainingOpConfig needs ")
    assert "the model is on cpu" in model.fp8_experts.note and model.fp8_experts.note in caplog.text
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    assert math.isfinite(model(input_ids=ids, labels=ids).loss.item())


@pytest.mark.parametrize("edit", [{"kernel_preference": "fastest"}, {"out_dtype": "float32"}, {"extra": 1},
                                  {"experts_implementation": "eager"}])
def test_edited_mxfp8_experts_configs_are_refused(edit):
    fields = experts_config_fields(torch.bfloat16, recipe_from_dict(MX_EMULATED))
    assert experts_config_from_dict(fields).kernel_preference.value == "emulated"
    with pytest.raises(ConversionError, match="convert the model again"):
        experts_config_from_dict({**fields, **edit})


def test_torchao_wraps_exactly_the_listed_experts_weights(moe_root):
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    model = _model(moe_root, "qwen2_moe")
    config = experts_config_from_dict(experts_config_fields(torch.float32))
    listed = ["model.layers.1.mlp.experts.down_proj"]  # one GEMM of one module: the other stays as it was
    assert convert_experts_to_torchao(model, listed, config) == listed
    wrapped = [p for p, t in model.named_parameters() if isinstance(t, Float8TrainingWeightWrapperTensor)]
    assert wrapped == listed
    with pytest.raises(ConversionError, match="is no parameter in the loaded model"):
        convert_experts_to_torchao(model, ["model.layers.0.mlp.experts.w2"], config)
    with pytest.raises(ConversionError, match="is a 2-D parameter"):
        convert_experts_to_torchao(model, ["model.layers.0.mlp.shared_expert.down_proj.weight"], config)


def test_float16_experts_are_refused_for_torchao_with_a_fix():
    with pytest.raises(ConversionError, match="float32 or bfloat16 expert weights, these are float16: exclude"):
        experts_config_fields(torch.float16)
    with pytest.raises(ConversionError, match="convert the model again"):
        experts_config_from_dict({"config": "MXFP8TrainingOpConfig"})


# --- CUDA + TransformerEngine ------------------------------------------------------------------------------

def _fp8_or_skip():
    from converters.backends.te.runtime import require_fp8_execution, te_module
    from converters.errors import BackendUnavailableError

    try:
        require_fp8_execution(te_module())
    except BackendUnavailableError as exc:
        pytest.skip(exc.message)


@needs_te
def test_te_grouped_experts_match_eager_and_run_fp8(moe_root):
    import transformer_engine.pytorch as te

    from converters.backends.te.grouped import convert_experts_to_te
    from converters.backends.te.runtime import build_te_recipe, te_autocast
    from converters.recipes import TEDelayedScalingRecipe

    model = _model(moe_root, "mixtral").to(torch.bfloat16)
    eager = model.model.layers[0].mlp.experts
    hidden, index, weights = (t.cuda() for t in _routed_inputs(model))
    expected = eager.cuda()(hidden, index, weights)
    convert_experts_to_te(model, GEMMS[:2], device="cuda")
    grouped = model.model.layers[0].mlp.experts
    assert isinstance(grouped.gate_up_proj, te.GroupedLinear) and grouped.gate_up_proj.num_gemms == EXPERTS
    assert isinstance(grouped.down_proj, te.GroupedLinear)
    assert type(model.model.layers[1].mlp.experts).__name__ == "MixtralExperts"  # not listed: left as it was
    with torch.no_grad():
        got = grouped(hidden, index, weights)
    assert (got - expected).float().norm() / expected.float().norm() < 2e-2

    _fp8_or_skip()
    recipe = build_te_recipe(TEDelayedScalingRecipe(amax_history_len=HISTORY))
    with torch.no_grad(), te_autocast(te, enabled=True, recipe=recipe):  # records amax: scales for the next step
        grouped(hidden, index, weights)
    inp = hidden.clone().requires_grad_(True)
    with te_autocast(te, enabled=True, recipe=recipe):
        out = grouped(inp, index, weights)
    out.float().pow(2).mean().backward()
    assert torch.isfinite(out).all() and (out - expected).float().norm() / expected.float().norm() < 0.1
    routed = route_tokens(index, EXPERTS).m_splits
    for e in range(EXPERTS):
        grad = getattr(grouped.gate_up_proj, f"weight{e}").grad
        if routed[e]:
            assert grad is not None and torch.isfinite(grad).all(), e


@needs_te
def test_load_te_model_puts_the_artifact_state_into_grouped_linear(te_artifact):
    import transformer_engine.pytorch as te

    from converters.backends.te.runtime import te_autocast
    from converters.backends.te.state import meta_tensor

    artifact = read_te_artifact(te_artifact)
    model = load_te_model(te_artifact)
    for gemm, tensors in artifact.expert_states.items():
        module = model.get_submodule(gemm)
        assert isinstance(module, te.GroupedLinear) and module.num_gemms == EXPERTS
        for name, tensor in tensors.items():
            assert torch.equal(meta_tensor(module, name).cpu(), tensor), (gemm, name)
    assert isinstance(model.model.layers[0].mlp.experts, GroupedExperts)

    _fp8_or_skip()
    model.train()
    ids = torch.randint(0, 200, (2, 16), device="cuda")
    with te_autocast(te, enabled=True, recipe=model.fp8_recipe):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item())
    fc1 = model.get_submodule(GEMMS[0])
    assert any(getattr(fc1, f"weight{e}").grad is not None for e in range(EXPERTS))


# --- CUDA (compute capability 9.0/10.0) + triton: torchao's FP8 grouped GEMM ----------------------------------

@needs_ao_fp8
def test_ao_experts_are_torchao_training_weights_on_cuda(ao_artifact):
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    model = load_torchao(ao_artifact, device="cuda")
    assert model.fp8_experts.fp8 and model.config._experts_implementation == "grouped_mm"
    for gemm in GEMMS:
        assert isinstance(model.get_parameter(gemm), Float8TrainingWeightWrapperTensor), gemm
    ids = torch.randint(0, 200, (2, 16), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and model.get_parameter(GEMMS[0]).grad is not None
