"""TransformerEngine backend: honest CPU behaviour (clear errors, artifact reading) and, on a CUDA worker with
TE installed, the real swap, scaling state round trip, FP8 check step and artifact loading."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from torch import nn

from converters.backends.te import loader as te_loader
from converters.backends.te.check_step import fp8_check_step
from converters.backends.te.layout import state_key
from converters.backends.te.loader import load_te_model, read_te_artifact
from converters.backends.te.runtime import build_te_recipe, require_te, te_status
from converters.backends.te.state import (
    apply_scaling_state,
    check_state_tensors,
    read_scaling_state,
    te_extra_state_tensor,
)
from converters.backends.te.swap import convert_to_te
from converters.errors import BackendUnavailableError, ConversionError, Fp8ForgeError, ModelNotFoundError, RecipeError
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe
from tests.models import tiny_config

TE_OK, TE_WHY = te_status()
needs_te = pytest.mark.skipif(not TE_OK, reason=f"needs CUDA and TransformerEngine: {TE_WHY}")
without_te = pytest.mark.skipif(TE_OK, reason="TransformerEngine is usable here")

HISTORY = 4
RECIPE = TEDelayedScalingRecipe(amax_history_len=HISTORY, amax_compute_algo="max")
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_llama(*, tie: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.tie_word_embeddings = tie
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def linear_paths(model) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]


def layer_state(seed: int, history: int = HISTORY) -> dict[str, torch.Tensor]:
    """Plausible delayed-scaling state: amax > 0 for input/weight (output never cast: amax 0, scale 1)."""
    gen = torch.Generator().manual_seed(seed)
    fwd = torch.rand(history, 3, generator=gen) * 4 + 0.1
    fwd[:, 2] = 0
    bwd = torch.rand(history, 2, generator=gen) * 0.01 + 1e-4
    scale_fwd = torch.where(fwd.amax(0) > 0, 448.0 / fwd.amax(0), torch.ones(3))
    return {"scale_fwd": scale_fwd, "amax_history_fwd": fwd,
            "scale_bwd": 57344.0 / bwd.amax(0), "amax_history_bwd": bwd}


def write_artifact(directory, *, tie=False, converted=None, recipe=RECIPE, states=None, extra_state=False):
    """save_pretrained a tiny Llama, then add the fp8 block and the te_layout state in fp8_state.safetensors."""
    from safetensors.torch import save_file

    model = tiny_llama(tie=tie)
    model.save_pretrained(directory)
    converted = linear_paths(model) if converted is None else converted
    if states is None:
        states = {p: layer_state(i) for i, p in enumerate(converted)} if isinstance(recipe, TEDelayedScalingRecipe) \
            else {}
    extra = {state_key(p, n): t.contiguous() for p, s in states.items() for n, t in s.items()}
    if extra_state:
        extra.update({f"{p}._extra_state": torch.zeros(8, dtype=torch.uint8) for p in converted})
    block = {"version": 2, "backend": "te", "recipe": recipe.to_dict(), "converted_modules": converted}
    if extra:
        save_file(extra, directory / "fp8_state.safetensors")
        block["state_file"] = "fp8_state.safetensors"
    config = json.loads((directory / "config.json").read_text())
    config["fp8"] = block
    (directory / "config.json").write_text(json.dumps(config))
    return model, states


# --- CPU: what a machine without CUDA/TE must say ---------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_te_status_names_cuda_and_te_when_missing():
    ok, message = te_status()
    assert ok is False
    assert "CUDA" in message and "TransformerEngine" in message
    assert "pip install" in message and "GPU worker" in message


@without_te
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: require_te(), id="require_te"),
        pytest.param(lambda m: build_te_recipe(RECIPE), id="build_te_recipe"),
        pytest.param(lambda m: convert_to_te(m, linear_paths(m)), id="convert_to_te"),
        pytest.param(lambda m: apply_scaling_state(m, {"lm_head": layer_state(0)}, RECIPE), id="apply"),
        pytest.param(lambda m: read_scaling_state(m), id="read"),
        pytest.param(lambda m: fp8_check_step(m, {"input_ids": torch.zeros(1, 16, dtype=torch.long)}, RECIPE),
                     id="check_step"),
        pytest.param(lambda m: te_extra_state_tensor(m.lm_head), id="extra_state"),
    ],
)
def test_te_functions_raise_backend_unavailable_with_a_fix(call):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BackendUnavailableError) as info:
        call(model)
    assert info.value.code == "backend_unavailable" and info.value.field == "backend"
    assert "pip install --no-build-isolation 'transformer_engine[pytorch]'" in info.value.message
    assert "GPU worker" in info.value.message
    # Nothing was swapped or changed before the check.
    assert all(type(m) is nn.Linear for p, m in model.named_modules() if p in linear_paths(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@without_te
def test_load_te_checks_backend_before_reading_anything(tmp_path, monkeypatch):
    write_artifact(tmp_path)

    def must_not_read(*args, **kwargs):
        raise AssertionError("weights were read before the backend check")

    monkeypatch.setattr(te_loader, "read_te_artifact", must_not_read)
    monkeypatch.setattr(te_loader, "load_model", must_not_read)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        load_te_model(tmp_path)
    with pytest.raises(BackendUnavailableError):
        load_te_model(tmp_path / "does-not-exist")


def test_build_te_recipe_rejects_a_torchao_recipe():
    from converters.recipes import TorchAORecipe

    with pytest.raises(RecipeError, match="te recipe"):
        build_te_recipe(TorchAORecipe())


# --- CPU: state checks and artifact reading (no TE involved) ----------------------------------------------

def _bad(name, value):
    state = layer_state(0)
    state[name] = value
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({k: v for k, v in layer_state(0).items() if k != "scale_bwd"}, "expected"),
        (_bad("scale_fwd", torch.ones(2)), r"shape \(2,\)"),
        (_bad("amax_history_fwd", torch.ones(HISTORY + 1, 3)), "amax_history_len=4"),
        (_bad("amax_history_bwd", torch.ones(HISTORY, 3)), r"expected \(4, 2\)"),
        (_bad("scale_fwd", torch.tensor([1.0, float("nan"), 1.0])), "finite"),
        (_bad("scale_bwd", torch.tensor([1.0, 0.0])), "scales must be > 0"),
        (_bad("amax_history_fwd", -torch.ones(HISTORY, 3)), "amax values >= 0"),
        (_bad("scale_bwd", torch.ones(2, dtype=torch.int32)), "floating-point"),
    ],
)
def test_check_state_tensors_rejects(state, message):
    with pytest.raises(ConversionError, match=message):
        check_state_tensors("model.layers.0.mlp.up_proj", state, HISTORY)


def test_check_state_tensors_accepts_a_plausible_state():
    check_state_tensors("lm_head", layer_state(3), HISTORY)


def test_read_te_artifact_splits_state_and_ignores_pickles(tmp_path):
    model, states = write_artifact(tmp_path, extra_state=True)
    artifact = read_te_artifact(tmp_path)
    assert artifact.recipe == RECIPE
    assert artifact.converted_modules == tuple(linear_paths(model))
    assert set(artifact.scaling_states) == set(states)
    assert all(torch.equal(artifact.scaling_states[p][n], states[p][n]) for p in states for n in states[p])
    assert artifact.ignored_keys == tuple(sorted(f"{p}._extra_state" for p in states))


@pytest.mark.parametrize("tie", [False, True])
def test_artifact_weights_load_with_a_plain_from_pretrained(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    model, _ = write_artifact(tmp_path, tie=tie)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie


def test_a_missing_state_file_is_refused(tmp_path):
    write_artifact(tmp_path)
    (tmp_path / "fp8_state.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="re-download the artifact"):
        read_te_artifact(tmp_path)


def test_a_state_file_holding_weights_is_refused(tmp_path):
    from safetensors.torch import save_file

    write_artifact(tmp_path)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "fp8_state.safetensors")
    with pytest.raises(ConversionError, match="not scaling state"):
        read_te_artifact(tmp_path)


def test_a_plain_hf_directory_is_not_a_te_artifact(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no fp8 block"):
        read_te_artifact(tmp_path)


def _edit_fp8(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["fp8"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"backend": "ao"}, ModelNotFoundError, "backend 'ao'"),
        ({"version": 1}, ModelNotFoundError, "convert the model again"),
        ({"recipe": {"backend": "te", "amax_history_len": 0}}, RecipeError, "amax_history_len"),
        ({"converted_modules": "lm_head"}, ModelNotFoundError, "distinct module paths"),
        ({"converted_modules": ["lm_head"]}, ConversionError, "state without a converted module"),
        ({"recipe": TEDelayedScalingRecipe(amax_history_len=8).to_dict()}, ConversionError, "amax_history_len=8"),
        ({"recipe": TECurrentScalingRecipe().to_dict()}, ConversionError, "current-scaling artifact"),
    ],
)
def test_inconsistent_artifacts_are_refused(tmp_path, changes, error, message):
    write_artifact(tmp_path)
    _edit_fp8(tmp_path, **changes)
    with pytest.raises(error, match=message):
        read_te_artifact(tmp_path)


def test_a_converted_layer_without_state_is_refused(tmp_path):
    model = tiny_llama()
    paths = linear_paths(model)
    write_artifact(tmp_path, converted=paths, states={p: layer_state(0) for p in paths[1:]})
    with pytest.raises(ConversionError, match=f"converted without state: \\['{paths[0]}'\\]"):
        read_te_artifact(tmp_path)


def test_a_state_file_outside_the_artifact_is_refused(tmp_path):
    write_artifact(tmp_path)
    _edit_fp8(tmp_path, state_file="../elsewhere.safetensors")
    with pytest.raises(Fp8ForgeError, match="which is not fp8_state.safetensors"):
        read_te_artifact(tmp_path)


# --- CUDA + TransformerEngine ------------------------------------------------------------------------------

@needs_te
def test_convert_swaps_every_listed_linear_and_keeps_outputs():
    import transformer_engine.pytorch as te

    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    paths = linear_paths(model)
    assert convert_to_te(model, paths) == paths
    assert all(isinstance(model.get_submodule(p), te.Linear) for p in paths)
    assert all(p.device.type == "cuda" for p in model.parameters())
    with torch.no_grad():  # outside an FP8 autocast te.Linear computes in high precision (TF32 GEMMs allowed)
        got = model(input_ids=ids.cuda()).logits.cpu()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@needs_te
def test_convert_keeps_tied_weights_tied():
    model = tiny_llama(tie=True)
    embedding = model.model.embed_tokens.weight.detach().clone()
    convert_to_te(model, ["lm_head"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight.detach().cpu(), embedding)


@needs_te
@pytest.mark.parametrize(
    ("paths", "message"),
    [(["model.layers.0.mlp.nope"], "no module at path"), (["model.norm"], "not an nn.Linear"),
     (["lm_head", "lm_head"], "more than once")],
)
def test_convert_refuses_bad_paths(paths, message):
    with pytest.raises(ConversionError, match=message):
        convert_to_te(tiny_llama(), paths)


def _converted_with_state():
    model = tiny_llama()
    paths = [f"model.layers.{i}.{name}" for i in range(2) for name in PROJ] + ["lm_head"]
    convert_to_te(model, paths)
    states = {p: layer_state(i) for i, p in enumerate(paths)}
    apply_scaling_state(model, states, RECIPE)
    return model, states


def _assert_states_equal(got, expected):
    assert set(got) == set(expected)
    for path, tensors in expected.items():
        for name, tensor in tensors.items():
            assert torch.equal(got[path][name], tensor.float()), f"{path}.{name}"


@needs_te
def test_apply_then_read_round_trips_and_sets_te_meta():
    model, states = _converted_with_state()
    _assert_states_equal(read_scaling_state(model), states)
    meta = model.lm_head.fp8_meta
    assert meta["scaling_fwd"].amax_history.shape == (HISTORY, 3)
    assert meta["recipe"].amax_history_len == HISTORY and meta["recipe"].amax_compute_algo == "max"


@needs_te
def test_apply_refuses_a_history_of_another_length():
    model = tiny_llama()
    convert_to_te(model, ["lm_head"])
    with pytest.raises(ConversionError, match="amax_history_len=8"):
        apply_scaling_state(model, {"lm_head": layer_state(0)}, TEDelayedScalingRecipe(amax_history_len=8))


@needs_te
def test_fp8_check_step_uses_the_calibrated_state_and_restores_it():
    model, states = _converted_with_state()
    report = fp8_check_step(model, {"input_ids": torch.randint(0, 256, (1, 16))}, RECIPE)
    assert report["output_finite"] and report["backward"] and report["state_restored"]
    assert math.isfinite(report["loss"])
    for path, layer in report["layers"].items():
        assert layer["scale_fwd_before"] == states[path]["scale_fwd"].tolist()
        assert layer["amax_fwd_step"][0] > 0 and layer["amax_fwd_step"][1] > 0  # input and weight were cast
    _assert_states_equal(read_scaling_state(model), states)
    assert all(p.grad is None for p in model.parameters())


@needs_te
def test_fp8_check_step_with_current_scaling_needs_no_state():
    model = tiny_llama()
    convert_to_te(model, linear_paths(model))
    report = fp8_check_step(model, {"input_ids": torch.randint(0, 256, (2, 8))}, TECurrentScalingRecipe())
    assert report["output_finite"] and report["layers"] == {} and math.isfinite(report["loss"])
    assert read_scaling_state(model) == {}


@needs_te
def test_fp8_check_step_refuses_a_batch_te_cannot_run():
    model, _ = _converted_with_state()
    with pytest.raises(ConversionError, match="divisible by 8"):
        fp8_check_step(model, {"input_ids": torch.randint(0, 256, (1, 7))}, RECIPE)


@needs_te
def test_te_extra_state_carries_the_same_numbers():
    model, states = _converted_with_state()
    model(input_ids=torch.randint(0, 256, (1, 16), device="cuda"))  # a plain forward clears fp8_checkpoint
    payload = te_extra_state_tensor(model.lm_head)
    assert payload.dtype == torch.uint8 and payload.numel() > 0
    state = pickle.loads(payload.numpy().tobytes())  # our own pickle, produced just above
    for name in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(state[name], states["lm_head"][name])


@needs_te
def test_load_te_equals_the_files(tmp_path):
    import transformer_engine.pytorch as te

    model, states = write_artifact(tmp_path)
    loaded = load_te_model(tmp_path)
    assert not loaded.training
    assert loaded.fp8_recipe.amax_history_len == HISTORY and loaded.fp8_recipe.amax_compute_algo == "max"
    assert all(isinstance(loaded.get_submodule(p), te.Linear) for p in states)
    _assert_states_equal(read_scaling_state(loaded), states)
    assert all(torch.equal(v, loaded.state_dict()[k].cpu()) for k, v in model.state_dict().items())
