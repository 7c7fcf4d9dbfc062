"""A quantized source whose scales are not finite numbers (NaN, inf, 3e38, whose product with a code overflows), whose
codes are NaN, or whose scale has a shape of another rank: requantizing it (to bf16 and to fp8-block) and a
calibrated job from it are refused as ``invalid_model_config`` naming the tensor, and nothing is written; before,
each was published as a layer of NaN (with an ``inf`` output scale) or failed as an internal error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.errors import ModelConfigError
from converters.model.sources import ModelSourceOptions
from converters.modelfree import convert_model_free
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest

WEIGHT = "model.layers.0.mlp.gate_proj.weight"  # [256, 128]: a 2 x 1 grid of 128 x 128 blocks
SCALE = f"{WEIGHT}_scale_inv"


def _fill(value: float):
    return lambda tensors: tensors[SCALE].fill_(value)


def _nan_code(tensors: dict[str, torch.Tensor]) -> None:
    tensors[WEIGHT].view(torch.uint8)[3, 5] = 0x7F  # E4M3's NaN


def _rank3(tensors: dict[str, torch.Tensor]) -> None:
    tensors[SCALE] = tensors[SCALE].unsqueeze(0).repeat(2, 1, 1)


#: damage -> (what the message must name, the words that say what is wrong)
DAMAGES = {
    "nan_scale": (_fill(float("nan")), SCALE, "NaN or infinite"),
    "inf_scale": (_fill(float("inf")), SCALE, "NaN or infinite"),
    "huge_scale": (_fill(3e38), WEIGHT, "NaN or infinite"),
    "nan_code": (_nan_code, WEIGHT, "NaN or infinite"),
    "rank3_scale": (_rank3, SCALE, "expected [2, 1] (its 128x128 block grid)"),
}


def build_damaged_sources(root: Path) -> Path:
    """In ``root``: the tiny Llama (``llama``), it requantized to fp8-block (``sound``), and one copy of that per
    damage, named after it."""
    from converters.model.demo import build_tiny_llama

    convert_model_free(build_tiny_llama(root / "llama"), root / "sound", "fp8-block")
    for name, (damage, _, _) in DAMAGES.items():
        shutil.copytree(root / "sound", root / name)
        tensors = load_file(root / name / "model.safetensors")
        damage(tensors)
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_damaged_sources(tmp_path_factory.mktemp("damaged-scales"))


@pytest.mark.parametrize("target", ["bf16", "fp8-block"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_requantizing_a_damaged_source_is_refused_naming_the_tensor(root: Path, tmp_path: Path, damage: str,
                                                                     target: str) -> None:
    _, named, words = DAMAGES[damage]
    with pytest.raises(ModelConfigError) as caught:
        convert_model_free(root / damage, tmp_path / "out", target)
    assert caught.value.code == "invalid_model_config" and caught.value.field == "model"
    assert named in caught.value.message and words in caught.value.message, caught.value.message
    assert not (tmp_path / "out").exists()


def test_the_sound_source_still_requantizes(root: Path, tmp_path: Path) -> None:
    convert_model_free(root / "sound", tmp_path / "out", "bf16")
    weight = load_file(tmp_path / "out" / "model.safetensors")[WEIGHT]
    assert weight.dtype == torch.bfloat16 and bool(torch.isfinite(weight).all())


@pytest.mark.parametrize("damage", ["nan_scale", "huge_scale", "rank3_scale"])
def test_a_calibrated_job_from_a_damaged_source_is_refused(root: Path, tmp_path: Path, damage: str) -> None:
    _, named, words = DAMAGES[damage]
    request = ConversionRequest(model=str(root / damage), recipe={"backend": "te"},
                                calibration=CalibrationSettings(steps=1, seq_len=8), measure=False)
    with pytest.raises(ModelConfigError) as caught:
        run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(root,)))
    assert named in caught.value.message and words in caught.value.message, caught.value.message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["fp8-block", "nvfp4-a16"])
def test_a_high_precision_weight_that_is_not_finite_is_not_quantized(root: Path, tmp_path: Path, target: str) -> None:
    """The writer's side: a bf16 source holding NaN would give NaN codes under a scale of 1 (fp8-block) or a NaN
    global scale (nvfp4, from the weight amax)."""
    source = tmp_path / "nan-weight"
    shutil.copytree(root / "llama", source)
    tensors = load_file(source / "model.safetensors")
    tensors[WEIGHT][7, 9] = float("nan")
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=f"{WEIGHT}.*NaN or infinite"):
        convert_model_free(source, tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
