"""Resuming from a TE delayed-scaling artifact: its state restores bit for bit, and re-seeding from calibration steps on
resumed weights gives the scales TE's update would compute for those weights (CPU: our own restore and scaling code;
the te.Linear half on a GPU with TE, skipped elsewhere)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.artifact.files import write_manifest
from converters.backends.te.layout import TE_STATE_NAMES, state_key
from converters.backends.te.loader import read_te_artifact
from converters.backends.te.resume import reseeded_scaling_state
from converters.calibration.amax import LayerAmax, te_scaling_state
from converters.calibration.batches import calibration_batches
from converters.calibration.scaling import E4M3_MAX
from converters.errors import ConversionError
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from service.cli.main import main

LAYER = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def delayed(llama_root):
    out = llama_root / "te-delayed"
    assert main(["convert", str(llama_root / "llama"), "--out", str(out), "--allow-root", str(llama_root),
                 "--backend", "te", "--calib-steps", "3", "--calib-seq-len", "32", "--calib-backward",
                 "--no-progress"]) == 0
    return out


def test_artifact_state_restores_bit_for_bit(delayed):
    artifact = read_te_artifact(delayed)
    stored = load_file(delayed / "fp8_state.safetensors")
    recorded = load_file(delayed / "fp8_calibration.safetensors")
    assert sorted(artifact.scaling_states) == sorted(json.loads((delayed / "config.json").read_text())["fp8"]
                                                     ["converted_modules"])
    for path, state in artifact.scaling_states.items():
        amax = LayerAmax(forward=recorded[f"{path}.amax_forward"], backward=recorded[f"{path}.amax_backward"])
        again = te_scaling_state(amax, artifact.recipe)  # the state TE holds after the recorded steps
        for name in TE_STATE_NAMES:
            assert torch.equal(state[name], stored[state_key(path, name)])
            assert torch.equal(state[name], again[name]), (path, name)


def test_reseed_on_resumed_weights_follows_them(delayed, tmp_path):
    resumed = shutil.copytree(delayed, tmp_path / "resumed")
    weights = load_file(resumed / "model.safetensors")
    weights[f"{LAYER}.weight"] = weights[f"{LAYER}.weight"] * 4  # training moved this layer: exact in bf16
    save_file(weights, resumed / "model.safetensors", metadata={"format": "pt"})
    write_manifest(resumed)

    stale = read_te_artifact(resumed).scaling_states
    steps = 3
    reseeded = reseeded_scaling_state(resumed, steps=steps, seq_len=32)
    new_amax = weights[f"{LAYER}.weight"].abs().max().float()
    # the weight slot: TE's scale for the resumed weight, a quarter of the stale one (division by 4 is exact)
    assert torch.equal(reseeded[LAYER]["scale_fwd"][1], torch.tensor(E4M3_MAX) / new_amax)
    assert torch.equal(reseeded[LAYER]["scale_fwd"][1], stale[LAYER]["scale_fwd"][1] / 4)
    assert float(stale[LAYER]["scale_fwd"][1] * new_amax) > E4M3_MAX  # the stale scale would saturate every cast
    assert float(reseeded[LAYER]["scale_fwd"][1] * new_amax) <= E4M3_MAX
    # the input slot: the amax of the layer's input at each step, measured here with a plain hook
    model = load_model(resumed, ModelSourceOptions(allowed_roots=(resumed,)))
    batches, _ = calibration_batches(load_tokenizer(resumed, ModelSourceOptions(allowed_roots=(resumed,))),
                                     vocab_size=model.config.vocab_size, steps=steps, batch_size=2, seq_len=32)
    seen = []
    handle = model.get_submodule(LAYER).register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().max()))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    history = reseeded[LAYER]["amax_history_fwd"][:, 0]
    assert sorted(history[history > 0].tolist()) == sorted(float(x) for x in seen)
    assert torch.equal(reseeded[LAYER]["scale_fwd"][0], torch.tensor(E4M3_MAX) / max(x.float() for x in seen))
    assert (reseeded[LAYER]["scale_bwd"] != 1).any()  # the backward slots were re-seeded from gradients too
    # a layer the resume did not move keeps its weight scale
    assert torch.equal(reseeded["model.layers.1.mlp.down_proj"]["scale_fwd"][1],
                       stale["model.layers.1.mlp.down_proj"]["scale_fwd"][1])


def test_reseed_refuses_a_stateless_recipe(llama_root, tmp_path):
    recipe = tmp_path / "current.json"
    recipe.write_text(json.dumps({"backend": "te", "scaling": "current"}))
    out = llama_root / "te-current"
    assert main(["convert", str(llama_root / "llama"), "--out", str(out), "--allow-root", str(llama_root),
                 "--recipe", str(recipe), "--calib-steps", "1", "--calib-seq-len", "32", "--no-progress"]) == 0
    with pytest.raises(ConversionError, match="only delayed scaling keeps an amax history"):
        reseeded_scaling_state(out, steps=1, seq_len=32)


def test_te_state_restores_into_te_linear_and_reseeds_on_a_gpu(delayed):
    from converters.backends.loaders import load_te
    from converters.backends.te.runtime import te_status
    from converters.backends.te.state import read_scaling_state

    ok, why = te_status()
    if not ok:
        pytest.skip(why)
    artifact = read_te_artifact(delayed)
    restored = read_scaling_state(load_te(delayed))
    assert all(torch.equal(restored[p][n], artifact.scaling_states[p][n]) for p in restored for n in TE_STATE_NAMES)
    reseeded = read_scaling_state(load_te(delayed, reseed_steps=2))
    expected = reseeded_scaling_state(delayed, steps=2, device="cuda")
    assert all(torch.allclose(reseeded[p][n], expected[p][n], rtol=1e-2) for p in reseeded for n in TE_STATE_NAMES)
