"""TE's MXFP8 / FP8-block / NVFP4 recipes and torchao's quantize_ training configs: parsing (JSON, Accelerate
YAML), each recipe's shape rule and reason code, the GPUs each needs, and what the artifact records per recipe.

TE cannot run here: its recipe objects are built only in the CUDA-only test at the end (skipped with the reason
te_status() gives); on CPU the tests check the data the loader hands TE (te_recipe_spec).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from converters.analysis.eligibility import AnalysisOptions, analyze_model, check_report_rule
from converters.backends.loaders import load_torchao
from converters.backends.te.backend import TE
from converters.backends.te.loader import read_te_artifact
from converters.backends.te.runtime import build_te_recipe, te_align_size, te_recipe_spec, te_status
from converters.backends.torchao.backend import TORCHAO
from converters.backends.torchao.swap import training_op_unavailable
from converters.errors import ArtifactError, BackendUnavailableError, ConversionError, RecipeError
from converters.pipeline.request import ConversionRequest
from converters.recipes import (
    AOFloat8TrainingOpRecipe,
    AOMXFP8TrainingOpRecipe,
    AORecipeName,
    Fp8Format,
    MXKernelPreference,
    MXScaleCalculationMode,
    NVFP4ErrMode,
    NVFP4Scope,
    TECurrentScalingRecipe,
    TEDelayedScalingRecipe,
    TEFloat8BlockScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
    TorchAORecipe,
    load_recipe_file,
    recipe_from_accelerate_yaml,
    recipe_from_dict,
)
from converters.recipes.requirements import CAST_FORMATS, requirements
from service.cli.main import main

TE_OK, TE_WHY = te_status()

# --- parsing ------------------------------------------------------------------------------------

# Each recipe's defaults are its library's (TE common/recipe/__init__.py with no NVTE_* variable set; torchao
# prototype/moe_training/config.py).
DEFAULTS = [
    (TEMXFP8BlockScalingRecipe(), {"fp8_format": Fp8Format.E4M3, "margin": 0, "enable_2d_quantization": False}),
    (TEFloat8BlockScalingRecipe(), {"fp8_format": Fp8Format.E4M3, "use_f32_scales": False, "x_block_scaling_dim": 1,
                                    "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1}),
    (TENVFP4BlockScalingRecipe(), {"disable_rht": False, "disable_stochastic_rounding": False,
                                   "disable_2d_quantization": False, "row_scaled_activation": False,
                                   "nvfp4_4over6": NVFP4Scope.NONE, "nvfp4_4over6_e4m3_use_256": NVFP4Scope.ALL,
                                   "nvfp4_4over6_err_mode": NVFP4ErrMode.MAE}),
    (AOFloat8TrainingOpRecipe(), {"float8_linear_recipe": AORecipeName.ROWWISE,
                                  "pad_token_groups_for_grouped_mm": False}),
    (AOMXFP8TrainingOpRecipe(), {"kernel_preference": MXKernelPreference.AUTO, "wgrad_with_hp": False,
                                 "scale_calculation_mode": MXScaleCalculationMode.RCEIL,
                                 "pad_token_groups_for_grouped_mm": False}),
]


@pytest.mark.parametrize(("recipe", "fields"), DEFAULTS, ids=lambda value: type(value).__name__)
def test_defaults_are_the_libraries_defaults(recipe, fields):
    assert {name: getattr(recipe, name) for name in fields} == fields
    assert recipe_from_dict(recipe.to_dict()) == recipe == type(recipe).from_dict(recipe.to_dict())


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"backend": "te", "scaling": "mxfp8_block"}, TEMXFP8BlockScalingRecipe()),
        ({"backend": "TE", "scaling": "MXFP8_block", "fp8_format": "hybrid", "margin": 2},
         TEMXFP8BlockScalingRecipe(fp8_format=Fp8Format.HYBRID, margin=2)),
        ({"backend": "te", "use_mxfp8_block_scaling": True}, TEMXFP8BlockScalingRecipe()),
        ({"backend": "te", "scaling": "mxfp8_block", "use_mxfp8_block_scaling": True}, TEMXFP8BlockScalingRecipe()),
        ({"backend": "te", "scaling": "float8_block", "use_f32_scales": True, "x_block_scaling_dim": 2,
          "w_block_scaling_dim": 1}, TEFloat8BlockScalingRecipe(use_f32_scales=True, x_block_scaling_dim=2,
                                                                w_block_scaling_dim=1)),
        ({"backend": "te", "scaling": "nvfp4_block", "disable_rht": True, "nvfp4_4over6": "all",
          "nvfp4_4over6_err_mode": "mse"},
         TENVFP4BlockScalingRecipe(disable_rht=True, nvfp4_4over6=NVFP4Scope.ALL, nvfp4_4over6_err_mode="MSE")),
        ({"backend": "ao", "scaling": "float8_training_op", "float8_linear_recipe": "tensorwise"},
         AOFloat8TrainingOpRecipe(float8_linear_recipe=AORecipeName.TENSORWISE)),
        ({"backend": "AO", "scaling": "mxfp8_training_op", "kernel_preference": "emulated", "wgrad_with_hp": True,
          "scale_calculation_mode": "floor"},
         AOMXFP8TrainingOpRecipe(kernel_preference="emulated", wgrad_with_hp=True, scale_calculation_mode="floor")),
    ],
)
def test_recipe_json_parses_and_round_trips(data, expected):
    recipe = recipe_from_dict(data)
    assert recipe == expected and type(recipe) is type(expected)
    assert recipe_from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe


@pytest.mark.parametrize(
    ("data", "field", "mentions"),
    [
        ({"backend": "te", "scaling": "mxfp8_block", "fp8_format": "E5M2"}, "fp8_format", "E5M2"),
        ({"backend": "te", "scaling": "mxfp8_block", "margin": 33}, "margin", "<= 32"),
        # canonical spelling: a stateless recipe has no history to configure
        ({"backend": "te", "scaling": "mxfp8_block", "amax_history_len": 16}, "amax_history_len", "allowed keys"),
        ({"backend": "te", "scaling": "float8_block", "use_mxfp8_block_scaling": True}, "use_mxfp8_block_scaling",
         "contradicts"),
        ({"backend": "te", "scaling": "mxfp8_block", "use_mxfp8_block_scaling": False}, "use_mxfp8_block_scaling",
         "contradicts"),
        ({"backend": "te", "use_mxfp8_block_scaling": "yes"}, "use_mxfp8_block_scaling", "true or false"),
        ({"backend": "te", "scaling": "float8_block", "x_block_scaling_dim": 3}, "x_block_scaling_dim", "<= 2"),
        ({"backend": "te", "scaling": "float8_block", "x_block_scaling_dim": 2}, "w_block_scaling_dim", "2D by 2D"),
        ({"backend": "te", "scaling": "float8_block", "w_block_scaling_dim": 2, "grad_block_scaling_dim": 2},
         "grad_block_scaling_dim", "128x128"),
        ({"backend": "te", "scaling": "float8_block", "use_f32_scales": 1}, "use_f32_scales", "true or false"),
        ({"backend": "te", "scaling": "nvfp4_block", "nvfp4_4over6": "activations"}, "nvfp4_4over6", "disable_rht"),
        ({"backend": "te", "scaling": "nvfp4_block", "nvfp4_4over6": "some"}, "nvfp4_4over6", "weights"),
        ({"backend": "te", "scaling": "nvfp4_block", "fp8_format": "E4M3"}, "fp8_format", "allowed keys"),
        ({"backend": "te", "scaling": "fp4"}, "scaling", "mxfp8_block, float8_block, nvfp4_block"),
        ({"backend": "ao", "scaling": "rowwise"}, "scaling", "float8_training_op, mxfp8_training_op"),
        ({"backend": "ao", "scaling": "float8_training_op", "recipe_name": "rowwise"}, "recipe_name", "allowed keys"),
        ({"backend": "ao", "scaling": "float8_training_op", "float8_linear_recipe": "blockwise"},
         "float8_linear_recipe", "tensorwise"),
        ({"backend": "ao", "scaling": "mxfp8_training_op", "kernel_preference": "mslk"}, "kernel_preference",
         "auto, emulated"),
        ({"backend": "ao", "scaling": "mxfp8_training_op", "scale_calculation_mode": "even"},
         "scale_calculation_mode", "rceil, floor"),
    ],
)
def test_bad_recipes_are_refused_naming_the_field(data, field, mentions):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    assert info.value.field == field and mentions in info.value.message
    with pytest.raises(RecipeError) as info:  # a request names it from its root
        ConversionRequest(model="org/name", recipe=data)
    assert info.value.field == f"recipe.{field}"


# What `accelerate config` writes for TE (commands/config/cluster.py), with use_mxfp8_block_scaling added by hand.
ACCELERATE_MXFP8_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: fp8
fp8_config:
  amax_compute_algorithm: max
  amax_history_length: 1024
  backend: TE
  fp8_format: HYBRID
  interval: 1
  margin: 0
  override_linear_precision: (false, false, false)
  use_autocast_during_eval: false
  use_mxfp8_block_scaling: true
"""


def test_accelerate_use_mxfp8_block_scaling_is_mxfp8_block_scaling():
    recipe = recipe_from_accelerate_yaml(ACCELERATE_MXFP8_YAML)
    # Accelerate's apply_fp8_autowrap: MXFP8BlockScaling(**kwargs) with fp8_format and margin; the rest is dropped
    assert recipe == TEMXFP8BlockScalingRecipe(fp8_format=Fp8Format.HYBRID, margin=0)
    dropped = ("amax_compute_algorithm", "amax_history_length", "interval", "override_linear_precision",
               "use_autocast_during_eval")
    assert all(any(name in note for note in recipe.warnings()) for name in dropped)
    assert "use_mxfp8_block_scaling" not in recipe.to_dict() and recipe.to_dict()["scaling"] == "mxfp8_block"


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("backend: TE\n  scaling: float8_block\n  w_block_scaling_dim: 1",
         TEFloat8BlockScalingRecipe(w_block_scaling_dim=1)),
        ("backend: TE\n  scaling: nvfp4_block\n  disable_rht: true", TENVFP4BlockScalingRecipe(disable_rht=True)),
        ("backend: TE\n  scaling: current", TECurrentScalingRecipe()),
        ("backend: AO\n  scaling: float8_training_op", AOFloat8TrainingOpRecipe()),
        ("backend: AO\n  scaling: mxfp8_training_op\n  kernel_preference: emulated",
         AOMXFP8TrainingOpRecipe(kernel_preference="emulated")),
    ],
)
def test_accelerate_yaml_takes_the_canonical_scaling(tmp_path, block, expected):
    path = tmp_path / "config.yaml"
    path.write_text(f"mixed_precision: fp8\nfp8_config:\n  {block}\n")
    assert load_recipe_file(path) == expected
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(expected.to_dict()))
    assert load_recipe_file(path) == expected


def test_accelerate_yaml_errors_name_the_fp8_config_field():
    bad = ACCELERATE_MXFP8_YAML.replace("fp8_format: HYBRID", "fp8_format: E5M2")
    with pytest.raises(RecipeError) as info:
        recipe_from_accelerate_yaml(bad)
    assert info.value.field == "fp8_config.fp8_format"
    with pytest.raises(RecipeError) as info:
        recipe_from_accelerate_yaml("mixed_precision: fp8\nfp8_config:\n  backend: TE\n  scaling: float8_block\n"
                                    "  x_block_scaling_dim: 2\n")
    assert info.value.field == "fp8_config.w_block_scaling_dim"


# --- shape rules --------------------------------------------------------------------------------

DELAYED = {"backend": "te"}
# recipe -> (an out_features that breaks only its rule among the rules, the reason code)
SHAPE_RULES = [
    ({"backend": "te", "scaling": "delayed"}, 24, "dim_not_divisible_by_16"),
    ({"backend": "te", "scaling": "current"}, 24, "dim_not_divisible_by_16"),
    ({"backend": "ao"}, 24, "dim_not_divisible_by_16"),
    ({"backend": "ao", "scaling": "float8_training_op"}, 24, "dim_not_divisible_by_16"),
    ({"backend": "te", "scaling": "mxfp8_block"}, 48, "dim_not_divisible_by_32_for_mxfp8"),
    ({"backend": "ao", "scaling": "mxfp8_training_op"}, 48, "dim_not_divisible_by_32_for_mxfp8"),
    ({"backend": "te", "scaling": "float8_block"}, 96, "dim_not_divisible_by_128_for_fp8_block"),
    ({"backend": "te", "scaling": "nvfp4_block"}, 96, "dim_not_divisible_by_128_for_nvfp4"),
]


def _two_linears(out_features: int) -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, out_features), nn.Linear(out_features, 256))


@pytest.mark.parametrize(("recipe", "dim", "reason"), SHAPE_RULES, ids=lambda v: v if isinstance(v, str) else None)
def test_each_recipe_applies_its_own_shape_rule(recipe, dim, reason):
    report = analyze_model(_two_linears(dim), AnalysisOptions(recipe=recipe, skip_first_last=False))
    reasons = {layer["path"]: layer["reasons"] for layer in report["layers"]}
    assert reasons == {"0": [], "1": [reason], "2": [reason]}
    multiple = {"dim_not_divisible_by_16": 16}.get(reason) or int(reason.split("_")[4])
    assert report["rule"] == f"both Linear dims divisible by {multiple}"
    assert report["recipe_requirements"]["shape_rule"]["reason"] == reason
    assert report["options"]["recipe"] == recipe_from_dict(recipe).to_dict()
    assert report["options"]["backend"] == recipe["backend"]
    # The same model under the next looser rule converts the layer: only this recipe's rule fails it.
    looser = {16: None, 32: DELAYED, 128: {"backend": "te", "scaling": "mxfp8_block"}}[multiple]
    if looser is not None:
        loose = analyze_model(_two_linears(dim), AnalysisOptions(recipe=looser, skip_first_last=False))
        assert all(layer["eligible"] for layer in loose["layers"])


def test_expert_gemms_follow_the_recipe_shape_rule():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, vocab_size=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for recipe, reason in ((DELAYED, None), ({"backend": "te", "scaling": "mxfp8_block"}, None),
                           ({"backend": "te", "scaling": "nvfp4_block"}, "dim_not_divisible_by_128_for_nvfp4")):
        units = [layer for layer in analyze_model(model, AnalysisOptions(recipe=recipe))["layers"] if "expert" in layer]
        assert len(units) == 4
        assert all(layer["reasons"] == ([reason] if reason else []) for layer in units), recipe


def test_analysis_options_refuse_a_bad_recipe_naming_the_field():
    with pytest.raises(RecipeError) as info:
        AnalysisOptions(recipe={"backend": "te", "scaling": "mxfp8_block", "margin": -1})
    assert info.value.field == "recipe.margin"
    default = analyze_model(_two_linears(48), AnalysisOptions(backend="ao", skip_first_last=False))
    assert default["recipe_requirements"]["recipe"] == "ao/tensorwise" and default["options"]["recipe"] is None


def test_conversion_refuses_a_report_built_without_the_recipe():
    report = analyze_model(_two_linears(48), AnalysisOptions(backend="te", skip_first_last=False))  # the 16 rule
    with pytest.raises(ConversionError) as info:
        check_report_rule(report, TEMXFP8BlockScalingRecipe())
    assert "both Linear dims divisible by 32" in info.value.message and "AnalysisOptions(recipe=" in info.value.message
    check_report_rule(report, TEDelayedScalingRecipe())


# --- hardware -----------------------------------------------------------------------------------

# recipe -> (min compute capability, first it does not run on, min CUDA), from TE pytorch/quantization.py
# _compute_*_support, PyTorch's RowwiseScaledMM.cu and torchao's MXFP8TrainingOpConfig
HARDWARE = [
    (TEDelayedScalingRecipe(), "8.9", None, None),
    (TECurrentScalingRecipe(), "8.9", None, None),
    (TEMXFP8BlockScalingRecipe(), "10.0", "12.0", None),
    (TEFloat8BlockScalingRecipe(), "9.0", None, "12.9"),
    (TEFloat8BlockScalingRecipe(use_f32_scales=True), "9.0", "10.0", "12.9"),
    (TENVFP4BlockScalingRecipe(), "10.0", None, None),
    (TorchAORecipe(), "8.9", None, None),
    (TorchAORecipe(emulate=True), None, None, None),
    (AOFloat8TrainingOpRecipe(), "8.9", None, None),
    (AOMXFP8TrainingOpRecipe(), "10.0", None, None),
    (AOMXFP8TrainingOpRecipe(kernel_preference="emulated"), None, None, None),
]


@pytest.mark.parametrize(("recipe", "minimum", "below", "cuda"), HARDWARE, ids=lambda v: repr(v)[:60])
def test_each_recipe_lists_the_gpus_it_needs(recipe, minimum, below, cuda):
    needs = requirements(recipe)
    hardware = needs["hardware"]
    assert (hardware["min_compute_capability"], hardware["below_compute_capability"], hardware["min_cuda"]) == (
        minimum, below, cuda)
    assert hardware["needs"] and hardware["source"]
    assert needs["state"].startswith("amax history" if recipe.stateful else "none: ")
    assert set(needs["cast_formats"]) == {"input", "weight"} and set(needs["cast_formats"].values()) <= set(
        CAST_FORMATS)


@pytest.mark.parametrize(
    ("recipe", "capability", "cuda", "unmet"),
    [
        (TEMXFP8BlockScalingRecipe(), (9, 0), "12.8", "10.0 or newer"),
        (TEMXFP8BlockScalingRecipe(), (12, 0), "12.8", "12.0 or newer"),
        (TEMXFP8BlockScalingRecipe(), (10, 0), "12.8", None),
        (TENVFP4BlockScalingRecipe(), (9, 0), "12.9", "10.0 or newer"),
        (TEFloat8BlockScalingRecipe(), (9, 0), "12.8", "CUDA 12.9"),
        (TEFloat8BlockScalingRecipe(), (10, 0), "12.9", None),
        (TEFloat8BlockScalingRecipe(use_f32_scales=True), (10, 0), "12.9", "10.0 or newer"),
        (TEDelayedScalingRecipe(), (8, 0), "12.8", "8.9 or newer"),
        (TEDelayedScalingRecipe(), (9, 0), "12.8", None),
    ],
)
def test_hardware_rules(recipe, capability, cuda, unmet):
    why = recipe.hardware().unmet(capability, cuda)
    assert (why is None) if unmet is None else (unmet in why)


@pytest.fixture
def cuda_gpu(monkeypatch):
    """Make torch report one CUDA GPU of a given compute capability (TE stays absent: it is never faked)."""

    def use(capability, cuda="12.9", name="NVIDIA H100"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
        monkeypatch.setattr(torch.version, "cuda", cuda)

    return use


@pytest.mark.skipif(TE_OK, reason="checks the worker without TransformerEngine")
def test_a_gpu_worker_that_cannot_run_the_recipe_fails_before_any_work(cuda_gpu):
    cuda_gpu((9, 0))
    with pytest.raises(BackendUnavailableError) as info:
        TE.preflight(TEMXFP8BlockScalingRecipe())
    message = info.value.message
    assert info.value.code == "backend_unavailable" and info.value.field == "recipe"
    assert "NVIDIA H100 (compute capability 9.0)" in message and "MXFP8BlockScaling" in message
    assert "10.x or 11.x" in message
    with pytest.raises(BackendUnavailableError, match="NVFP4BlockScaling"):
        TE.preflight(TENVFP4BlockScalingRecipe())
    with pytest.raises(BackendUnavailableError, match="MXFP8TrainingOpConfig"):
        TORCHAO.preflight(AOMXFP8TrainingOpRecipe())
    for fine in (TEDelayedScalingRecipe(), TEFloat8BlockScalingRecipe(), TorchAORecipe()):
        (TE if fine.backend.value == "te" else TORCHAO).preflight(fine)
    cuda_gpu((9, 0), cuda="12.8")
    with pytest.raises(BackendUnavailableError, match="CUDA 12.9"):
        TE.preflight(TEFloat8BlockScalingRecipe())
    cuda_gpu((8, 0), name="NVIDIA A100")
    with pytest.raises(BackendUnavailableError, match="A100"):
        TORCHAO.preflight(TorchAORecipe())
    TORCHAO.preflight(TorchAORecipe(emulate=True))
    TORCHAO.preflight(AOMXFP8TrainingOpRecipe(kernel_preference="emulated"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only worker")
def test_a_cpu_worker_runs_the_preflight_with_at_most_a_warning():
    TE.preflight(TENVFP4BlockScalingRecipe())
    warnings = TORCHAO.preflight(AOMXFP8TrainingOpRecipe())
    assert len(warnings) == 1 and "does not run on this CPU-only worker" in warnings[0]
    assert training_op_unavailable(AOMXFP8TrainingOpRecipe(), "cpu") == "the model is on cpu"
    assert training_op_unavailable(AOFloat8TrainingOpRecipe(), "cpu") is None  # torch 2.13 _scaled_mm on CPU


# --- casts, TE recipe arguments -----------------------------------------------------------------

@pytest.mark.parametrize(
    ("recipe", "casts"),
    [
        (TEDelayedScalingRecipe(), ("e4m3_tensor", "e4m3_tensor")),
        (TECurrentScalingRecipe(fp8_format="E4M3"), ("e4m3_tensor", "e4m3_tensor")),
        (TEMXFP8BlockScalingRecipe(fp8_format="HYBRID"), ("mxfp8_e4m3_block32", "mxfp8_e4m3_block32")),
        (TEMXFP8BlockScalingRecipe(enable_2d_quantization=True), ("mxfp8_e4m3_block32", "mxfp8_e4m3_block32x32")),
        (TEFloat8BlockScalingRecipe(), ("e4m3_block_1x128", "e4m3_block_128x128")),
        (TEFloat8BlockScalingRecipe(x_block_scaling_dim=2, w_block_scaling_dim=1),
         ("e4m3_block_128x128", "e4m3_block_1x128")),
        (TENVFP4BlockScalingRecipe(), ("nvfp4_block16", "nvfp4_block16x16")),
        (TENVFP4BlockScalingRecipe(disable_2d_quantization=True), ("nvfp4_block16", "nvfp4_block16")),
        (TorchAORecipe(), ("e4m3_tensor", "e4m3_tensor")),
        (TorchAORecipe(recipe_name="rowwise_with_gw_hp"), ("e4m3_row", "e4m3_row")),
        (AOFloat8TrainingOpRecipe(), ("e4m3_row", "e4m3_row")),
        (AOMXFP8TrainingOpRecipe(), ("mxfp8_e4m3_block32", "mxfp8_e4m3_block32")),
    ],
    ids=lambda v: repr(v)[:70],
)
def test_cast_formats_are_the_forward_casts(recipe, casts):
    assert recipe.cast_formats() == {"input": casts[0], "weight": casts[1]}


@pytest.mark.parametrize(
    ("recipe", "spec"),
    [
        (TEDelayedScalingRecipe(amax_history_len=16), {"class": "DelayedScaling", "kwargs": {
            "fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 0}, "qparams": {}}),
        (TEMXFP8BlockScalingRecipe(margin=1), {"class": "MXFP8BlockScaling", "kwargs": {
            "fp8_format": "E4M3", "margin": 1, "enable_2d_quantization": False}, "qparams": {}}),
        (TENVFP4BlockScalingRecipe(disable_rht=True), {"class": "NVFP4BlockScaling", "kwargs": {
            "disable_rht": True, "disable_stochastic_rounding": False, "disable_2d_quantization": False,
            "row_scaled_activation": False, "nvfp4_4over6": "none", "nvfp4_4over6_e4m3_use_256": "all",
            "nvfp4_4over6_err_mode": "MAE"}, "qparams": {}}),
    ],
)
def test_the_te_recipe_the_loader_builds_is_the_recorded_one(recipe, spec):
    assert te_recipe_spec(recipe) == spec
    assert te_recipe_spec(recipe_from_dict(recipe.to_dict())) == spec


def test_block_scaling_qparams_follow_use_f32_scales_not_the_environment():
    # TE's quantizers read fp8_quant_*.power_2_scale, set at import from NVTE_FP8_BLOCK_SCALING_FP32_SCALES
    spec = te_recipe_spec(TEFloat8BlockScalingRecipe(use_f32_scales=True))
    assert spec["class"] == "Float8BlockScaling" and spec["kwargs"]["use_f32_scales"] is True
    assert spec["qparams"] == {name: {"power_2_scale": False, "amax_epsilon": 0.0}
                               for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")}
    assert te_align_size(TEMXFP8BlockScalingRecipe()) == 32 and te_align_size(TENVFP4BlockScalingRecipe()) == 128
    assert te_align_size(TEFloat8BlockScalingRecipe()) == 16
    with pytest.raises(RecipeError):
        te_recipe_spec(AOFloat8TrainingOpRecipe())


# --- artifacts (CPU, end to end through the CLI) ------------------------------------------------

def _convert(root, tmp_path, recipe_text: str, name: str, suffix: str = ".json"):
    recipe = tmp_path / f"recipe{suffix}"
    recipe.write_text(recipe_text)
    out = root / name
    assert main(["convert", str(root / "llama"), "--out", str(out), "--allow-root", str(root), "--recipe",
                 str(recipe), "--calib-steps", "2", "--calib-seq-len", "32", "--no-progress"]) == 0
    block = json.loads((out / "config.json").read_text())["fp8"]
    report = json.loads((out / "fp8_report.json").read_text())
    return out, block, report


def test_te_mxfp8_artifact_records_the_recipe_and_no_state(llama_root, tmp_path):
    out, block, report = _convert(llama_root, tmp_path, ACCELERATE_MXFP8_YAML, "te-mxfp8", ".yaml")
    expected = TEMXFP8BlockScalingRecipe(fp8_format=Fp8Format.HYBRID)
    assert recipe_from_dict(block["recipe"]) == expected
    assert block["te_recipe"] == te_recipe_spec(expected) and block["te_recipe"]["class"] == "MXFP8BlockScaling"
    assert "state_file" not in block and not (out / "fp8_state.safetensors").exists()
    assert block["state"] == report["calibration"]["state"] == (
        "none: TransformerEngine MXFP8BlockScaling computes scales from each tensor as it is cast")
    assert not any(key.endswith("scale_fwd_per_step") for key in load_file(out / "fp8_calibration.safetensors"))
    assert report["recipe_requirements"]["hardware"]["min_compute_capability"] == "10.0"
    assert any("load_te() loads it with MXFP8BlockScaling" in warning for warning in report["warnings"])

    artifact = read_te_artifact(out)  # what load_te builds the model from (no TE needed)
    assert artifact.recipe == expected and te_recipe_spec(artifact.recipe) == block["te_recipe"]
    assert not artifact.scaling_states and artifact.converted_modules == tuple(block["converted_modules"])

    config = json.loads((out / "config.json").read_text())
    config["fp8"]["te_recipe"] = te_recipe_spec(TEDelayedScalingRecipe())
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="te_recipe"):
        read_te_artifact(out)


@pytest.mark.parametrize(
    ("recipe", "wrapped"),
    [
        (AOFloat8TrainingOpRecipe(), "Float8TrainingWeightWrapperTensor"),
        (AOMXFP8TrainingOpRecipe(kernel_preference="emulated"), "MXFP8TrainingWeightWrapperTensor"),
        (AOMXFP8TrainingOpRecipe(), None),  # Blackwell kernels: in high precision on this CPU, and said so
    ],
    ids=["float8_training_op", "mxfp8_emulated", "mxfp8_auto"],
)
def test_torchao_training_op_artifacts_replay_with_quantize(llama_root, tmp_path, recipe, wrapped):
    name = f"ao-{recipe.scaling.value}-{recipe.to_dict().get('kernel_preference', '')}"
    out, block, report = _convert(llama_root, tmp_path, json.dumps(recipe.to_dict()), name)
    assert recipe_from_dict(block["recipe"]) == recipe and block["training_op_config"] == recipe.config_fields()
    assert "float8_linear_config" not in block and not (out / "fp8_state.safetensors").exists()
    assert report["calibration"]["state"] == f"none: torchao {recipe.config_name} computes scales from each tensor " \
                                             "as it is cast"

    model = load_torchao(out)
    weights = {type(model.get_submodule(path).weight).__name__ for path in block["converted_modules"]}
    assert model.fp8_linears.layers == tuple(block["converted_modules"]) and len(block["converted_modules"]) == 13
    assert model.fp8_linears.fp8 is (wrapped is not None)
    assert weights == {wrapped or "Parameter"}
    if wrapped is None:
        assert "high precision" in model.fp8_linears.note and any(
            "does not run on this CPU-only worker" in warning for warning in report["warnings"])
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[1].mlp.up_proj.weight.grad is not None


def test_moe_experts_and_linears_convert_with_a_training_config(llama_root, tmp_path):
    from tests.models import save_tiny_moe

    save_tiny_moe("mixtral", llama_root / "mixtral")
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(AOFloat8TrainingOpRecipe().to_dict()))
    out = llama_root / "ao-moe"
    assert main(["convert", str(llama_root / "mixtral"), "--out", str(out), "--allow-root", str(llama_root),
                 "--recipe", str(recipe), "--calib-steps", "2", "--calib-seq-len", "16", "--no-progress"]) == 0
    block = json.loads((out / "config.json").read_text())["fp8"]
    assert block["converted_experts"] and block["experts_config"]["config"] == "Float8TrainingOpConfig"
    model = load_torchao(out)
    assert model.fp8_linears.fp8 and len(model.fp8_linears.layers) == len(block["converted_modules"])
    assert model.fp8_experts.gemms == tuple(block["converted_experts"])  # in high precision on this CPU


def test_an_edited_training_op_config_is_refused(llama_root, tmp_path):
    out, block, _ = _convert(llama_root, tmp_path, json.dumps(AOFloat8TrainingOpRecipe().to_dict()), "ao-edited")
    config = json.loads((out / "config.json").read_text())
    config["fp8"]["training_op_config"]["float8_linear_recipe"] = "tensorwise"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="training_op_config"):
        load_torchao(out, verify=False)


# --- TransformerEngine itself (CUDA only) -------------------------------------------------------

@pytest.mark.skipif(not TE_OK, reason=f"needs CUDA and TransformerEngine: {TE_WHY}")
@pytest.mark.parametrize("recipe", [TEMXFP8BlockScalingRecipe(margin=1, fp8_format="HYBRID"),
                                    TEFloat8BlockScalingRecipe(use_f32_scales=True, w_block_scaling_dim=1),
                                    TENVFP4BlockScalingRecipe(disable_rht=True, nvfp4_4over6="all")],
                         ids=["mxfp8", "float8_block", "nvfp4"])
def test_build_te_recipe_constructs_the_recorded_class_and_fields(recipe):
    import transformer_engine.common.recipe as te_recipe

    built = build_te_recipe(recipe_from_dict(recipe.to_dict()))
    assert type(built) is getattr(te_recipe, recipe.te_class_name)
    for name, value in te_recipe_spec(recipe)["kwargs"].items():
        if hasattr(built, name):
            got = getattr(built, name)
            assert (got.name if name == "fp8_format" else got) == value, name
    for name, params in te_recipe_spec(recipe)["qparams"].items():
        assert getattr(built, name).power_2_scale is params["power_2_scale"]


# --- the API ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.service_helpers import live_app, queue_only_settings

    root = tmp_path_factory.mktemp("recipes-api")
    settings = queue_only_settings(root)
    with live_app(settings) as client:
        yield client


def _job(recipe):
    return {"model": "demo/tiny-llama", "recipe": recipe, "calibration": {"steps": 1, "batch_size": 1, "seq_len": 16}}


@pytest.mark.parametrize("recipe", [
    {"backend": "te", "scaling": "mxfp8_block", "fp8_format": "HYBRID", "margin": 1},
    {"backend": "te", "scaling": "float8_block", "use_f32_scales": True, "w_block_scaling_dim": 1},
    {"backend": "te", "scaling": "nvfp4_block", "disable_rht": True, "nvfp4_4over6": "activations"},
    {"backend": "ao", "scaling": "float8_training_op", "float8_linear_recipe": "tensorwise"},
    {"backend": "ao", "scaling": "mxfp8_training_op", "kernel_preference": "emulated"},
], ids=lambda recipe: recipe["scaling"])
def test_the_api_takes_each_recipe(api, recipe):
    response = api.post("/v1/jobs", json=_job(recipe))
    assert response.status_code == 202, response.text
    assert response.json()["request"]["recipe"] == recipe


@pytest.mark.parametrize(("recipe", "field"), [
    ({"backend": "te", "scaling": "mxfp8_block", "margin": "1"}, "recipe.margin"),  # the schema: strict JSON
    ({"backend": "te", "scaling": "mxfp8_block", "amax_history_len": 16}, "recipe.amax_history_len"),
    ({"backend": "te", "scaling": "float8_block", "x_block_scaling_dim": 3}, "recipe.x_block_scaling_dim"),
    ({"backend": "te", "scaling": "float8_block", "x_block_scaling_dim": 2}, "recipe.w_block_scaling_dim"),  # library
    ({"backend": "te", "scaling": "nvfp4_block", "nvfp4_4over6": "all"}, "recipe.nvfp4_4over6"),  # library
    ({"backend": "te", "scaling": "mxfp8"}, "recipe.scaling"),
    ({"backend": "te", "use_mxfp8_block_scaling": True}, "recipe.use_mxfp8_block_scaling"),  # Accelerate's spelling
    ({"backend": "ao", "scaling": "mxfp8_training_op", "kernel_preference": "mslk"}, "recipe.kernel_preference"),
    ({"backend": "ao", "scaling": "tensorwise"}, "recipe.scaling"),
])
def test_the_api_refuses_naming_the_recipe_field(api, recipe, field):
    response = api.post("/v1/jobs", json=_job(recipe))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_the_openapi_schema_states_each_recipe(api):
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    mx, block, nv = schemas["TEMXFP8RecipeCreate"], schemas["TEFloat8BlockRecipeCreate"], schemas["TENVFP4RecipeCreate"]
    assert mx["properties"]["scaling"]["const"] == "mxfp8_block" and mx["properties"]["margin"]["maximum"] == 32
    assert (block["properties"]["x_block_scaling_dim"]["minimum"], block["properties"]["x_block_scaling_dim"]["maximum"]
            ) == (1, 2)
    assert schemas["NVFP4Scope"]["enum"] == ["none", "weights", "activations", "all"]
    assert nv["properties"]["nvfp4_4over6_e4m3_use_256"]["default"] == "all"
    assert schemas["MXKernelPreference"]["enum"] == ["auto", "emulated"]
    assert schemas["AOFloat8TrainingOpRecipeCreate"]["properties"]["float8_linear_recipe"]["default"] == "rowwise"
