"""FP8 KV-cache scales: post-RoPE key and value amax from the job's calibration pass, clipped by the ratio the
attention-output search chose, written as vLLM loads them."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from converters.calibration.amax import record_amax
from converters.calibration.batches import calibration_batches
from converters.calibration.kv_cache import recording_kv_amax
from converters.calibration.kv_search import CLIP_RATIOS
from converters.calibration.sequential import calibrate_layer_by_layer, find_layer_stack
from converters.model.checkpoint import Checkpoint
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_model, model_dtype
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import KV_CACHE_FORMAT_NAMES, CalibrationSettings, ConversionRequest
from converters.pipeline.stages import model_inputs
from converters.serving.audit import audit_export
from converters.serving.kv_scales import attach_kv_scales
from converters.serving.selection import ServingSelection
from tests.models import save_tiny_model

MODELS = ["llama", "mixtral"]  # GQA (4 query heads, 2 KV heads); mixtral is a mixture of experts too
CALIBRATION = CalibrationSettings(steps=3, batch_size=2, seq_len=16)
FORMAT = "compressed-tensors-fp8"
#: vLLM's maybe_remap_kv_scale_name maps ``<...>.self_attn.k_scale`` onto its Attention layer's ``attn.k_scale``
VLLM_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


@pytest.fixture(scope="module")
def kv_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    for name in MODELS:
        save_tiny_model(name, root / name)
    return root


@pytest.fixture(scope="module")
def exports(kv_root):
    """Each model converted once through the pipeline, with a static compressed-tensors export and kv_cache fp8."""
    outputs = {}
    for name in MODELS:
        request = ConversionRequest(model=str(kv_root / name), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                    serving_formats=(FORMAT,), kv_cache="fp8")
        run_conversion(request, kv_root / f"{name}-out", ModelSourceOptions(allowed_roots=(kv_root,)))
        outputs[name] = kv_root / f"{name}-out" / "serving" / FORMAT
    return outputs


def _batches(directory, model):
    """The pipeline's own calibration batches (the tiny models ship no tokenizer: seeded random ids)."""
    config = load_config(directory, ModelSourceOptions(allowed_roots=(directory.parent,)))
    batches, _ = calibration_batches(None, vocab_size=config.vocab_size, steps=CALIBRATION.steps,
                                     batch_size=CALIBRATION.batch_size, seq_len=CALIBRATION.seq_len)
    return [model_inputs(model, config, batch) for batch in batches]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def independent_amax(model, batches) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per attention module, per KV head: amax of k_proj's output rotated by the layer's cos/sin, and of v_proj's.

    No attention function is touched: forward hooks on the projections and the rotary tables the decoder layer
    hands the attention module, and RoPE written out here (``k * cos + rotate_half(k) * sin``).
    """
    found: dict[str, list[torch.Tensor]] = {}
    handles = []
    for path, module in model.named_modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        seen: dict[str, torch.Tensor] = {}

        def pre(_module, _args, kwargs, seen=seen):
            seen["cos"], seen["sin"] = kwargs["position_embeddings"]

        def projected(which, seen=seen, path=path, head_dim=module.head_dim):
            def hook(_module, _args, output):
                states = output.view(*output.shape[:-1], -1, head_dim).transpose(1, 2)
                if which == "k":
                    cos, sin = seen["cos"].unsqueeze(1), seen["sin"].unsqueeze(1)
                    states = (states * cos) + (_rotate_half(states) * sin)
                amax = states.abs().amax(dim=(0, 2, 3)).float()
                slot = 0 if which == "k" else 1
                pair = found.setdefault(path, [torch.zeros_like(amax), torch.zeros_like(amax)])
                pair[slot] = torch.fmax(pair[slot], amax)
            return hook

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.k_proj.register_forward_hook(projected("k")))
        handles.append(module.v_proj.register_forward_hook(projected("v")))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return {path: (pair[0], pair[1]) for path, pair in found.items()}


def clipped(amax: torch.Tensor, ratio: float) -> float:
    """The amax a searched scale is computed from: amax times the chosen ratio, in float32."""
    return float(amax.float().reshape(()) * torch.tensor(ratio, dtype=torch.float32))


def _export_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


@pytest.mark.parametrize("name", MODELS)
def test_every_attention_layer_has_vllm_mappable_scales_equal_to_clipped_amax_over_448(name, kv_root, exports):
    directory = kv_root / name
    sources = ModelSourceOptions(allowed_roots=(kv_root,))
    model = load_model(directory, sources)
    expected = independent_amax(model, _batches(directory, model))
    layers = load_config(directory, sources).num_hidden_layers
    assert sorted(expected) == [f"model.layers.{i}.self_attn" for i in range(layers)]

    tensors = _export_tensors(exports[name])
    scales = {key: value for key, value in tensors.items() if key.endswith(("k_scale", "v_scale"))}
    assert sorted(scales) == sorted(f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv")
    dtype = model_dtype(load_config(directory, sources))
    report = json.loads((exports[name].parent.parent / "fp8_report.json").read_text())["serving"][FORMAT]["kv_cache"]
    for key, value in scales.items():
        index, kv = VLLM_NAME.match(key).groups()
        amax = expected[f"model.layers.{index}.self_attn"][0 if kv == "k" else 1].max()
        layer = report["layers"][f"model.layers.{index}.self_attn"]
        ratio = layer[f"{kv}_clip_ratio"]
        assert ratio in CLIP_RATIOS
        assert value.dtype == dtype and tuple(value.shape) == (1,)
        want = torch.tensor([clipped(amax, ratio)], dtype=dtype) / 448.0
        assert torch.equal(value, want), (key, value, want)  # bit for bit
        assert torch.isfinite(value).all() and value.item() > 0
        assert 0 <= layer["attention_error"] <= layer["attention_error_at_amax"]  # the search never loses
        assert layer["searched_steps"] == CALIBRATION.steps
    audit = audit_export(exports[name])  # vLLM's loading rules replayed: every scale lands on its Attention layer
    assert audit.ok and audit.kv_scales_found == len(scales), audit.to_dict()


@pytest.mark.parametrize("name", MODELS)
def test_the_export_declares_the_kv_cache_scheme_and_compressed_tensors_loads_it(name, exports):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from transformers import AutoModelForCausalLM

    config = json.loads((exports[name] / "config.json").read_text())
    quantization = config["quantization_config"]
    scheme = quantization["kv_cache_scheme"]
    assert {key: scheme[key] for key in ("num_bits", "type", "strategy", "dynamic", "symmetric")} == {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    parsed = QuantizationConfig.model_validate(quantization)
    assert parsed.kv_cache_scheme is not None and parsed.kv_cache_scheme.strategy == "tensor"

    # The parameters compressed-tensors registers for this scheme on an attention module have our shape and dtype.
    holder = torch.nn.Module()
    dtype = getattr(torch, config.get("dtype") or config["torch_dtype"])
    shape = (config["num_key_value_heads"], None, config["hidden_size"] // config["num_attention_heads"])
    initialize_qparams(holder, "k", parsed.kv_cache_scheme, observed_shape=shape, observed_dtype=dtype,
                       force_zero_point=False)
    on_disk = _export_tensors(exports[name])
    written = on_disk["model.layers.0.self_attn.k_scale"]
    assert (holder.k_scale.dtype, tuple(holder.k_scale.shape)) == (written.dtype, tuple(written.shape))

    # transformers loads the export and runs it. (compressed-tensors 0.20.1 does not recognise transformers 5.24's
    # attention modules as cached, their forward takes `cache`, not `past_key_values`, so transformers reports
    # k_scale/v_scale as unexpected keys and runs a high-precision KV cache; vLLM reads them.)
    model = AutoModelForCausalLM.from_pretrained(exports[name])
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_and_layer_by_layer_record_the_same_kv_amax(name, kv_root):
    directory = kv_root / name
    sources = ModelSourceOptions(allowed_roots=(kv_root,))
    config = load_config(directory, sources)
    whole = load_model(directory, sources)
    batches = _batches(directory, whole)
    paths = ["model.layers.0.mlp.down_proj" if name == "llama" else "model.layers.0.self_attn.o_proj"]
    with recording_kv_amax(whole) as recorder:
        record_amax(whole, paths, batches)
    expected = recorder.results()

    meta = build_meta_model(config, sources)
    stack, why = find_layer_stack(meta)
    assert stack is not None, why
    checkpoint = Checkpoint(directory, meta, dtype=model_dtype(config), device="cpu")
    with recording_kv_amax(meta) as recorder:
        calibrate_layer_by_layer(meta, stack, checkpoint, batches, paths, compute_dtype=checkpoint.dtype)
    got = recorder.results()

    assert sorted(got) == sorted(expected) == [f"model.layers.{i}.self_attn" for i in range(config.num_hidden_layers)]
    independent = independent_amax(whole, batches)
    for path, layer in expected.items():
        assert layer.key.shape == (config.num_key_value_heads,)
        assert torch.equal(got[path].key, layer.key) and torch.equal(got[path].value, layer.value), path
        assert torch.equal(layer.key, independent[path][0]) and torch.equal(layer.value, independent[path][1]), path
        # the search ran in both (layer by layer: as each layer was released) over every step, and chose alike
        assert got[path].search is not None and layer.search is not None
        assert got[path].search.steps == layer.search.steps == len(batches)
        assert (got[path].search.key_ratio, got[path].search.value_ratio) == (
            layer.search.key_ratio, layer.search.value_ratio), path
        assert got[path].search.key_errors == pytest.approx(layer.search.key_errors, rel=1e-4, abs=1e-9), path

    selection = ServingSelection(format=FORMAT)
    block = attach_kv_scales(selection, got, checkpoint.target_of, model_dtype(config))
    assert selection.kv_cache == "fp8" and set(block["layers"]) == {path for path in got}
    for path, layer in got.items():
        anchor, k_scale = selection.extra_tensors[f"{path}.k_scale"]
        assert anchor.startswith(f"{path}.")  # written beside the layer's own tensors
        want = torch.tensor([clipped(layer.key.max(), layer.search.key_ratio)], dtype=model_dtype(config)) / 448.0
        assert torch.equal(k_scale, want)


def test_the_recorder_leaves_the_attention_interface_as_it_found_it(kv_root):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = {name: ALL_ATTENTION_FUNCTIONS.get(name) for name in ("sdpa", "eager")}
    model = load_model(kv_root / "llama", ModelSourceOptions(allowed_roots=(kv_root,)))
    with pytest.raises(RuntimeError), recording_kv_amax(model):
        raise RuntimeError("calibration failed")
    assert {name: ALL_ATTENTION_FUNCTIONS.get(name) for name in ("sdpa", "eager")} == before


def test_formats_that_write_kv_scales_match_the_registry():
    from converters.serving import SERVING_FORMATS

    declared = tuple(name for name, fmt in SERVING_FORMATS.items() if getattr(fmt, "supports_kv_cache", False))
    assert declared == KV_CACHE_FORMAT_NAMES


def test_without_kv_cache_the_export_is_the_same_bytes_less_the_kv_scales(kv_root, exports):
    # The search only runs where kv_cache asks for scales, and touches nothing else the export writes.
    request = ConversionRequest(model=str(kv_root / "llama"), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                serving_formats=(FORMAT,))
    run_conversion(request, kv_root / "llama-plain", ModelSourceOptions(allowed_roots=(kv_root,)))
    plain = _export_tensors(kv_root / "llama-plain" / "serving" / FORMAT)
    with_kv = _export_tensors(exports["llama"])
    assert not any(key.endswith(("k_scale", "v_scale")) for key in plain)
    assert sorted(plain) == sorted(key for key in with_kv if not key.endswith((".k_scale", ".v_scale")))
    for key, tensor in plain.items():
        assert tensor.dtype == with_kv[key].dtype and torch.equal(tensor.view(torch.uint8), with_kv[key].view(
            torch.uint8)), key


@pytest.mark.parametrize(("value_amax", "warned"), [(20.0, False), (255.9 * 448, False), (256 * 448, True)])
def test_a_kv_scale_vllms_amx_kernels_overflow_on_is_named_in_the_report(value_amax, warned):
    """From a scale of 256 vLLM's AMX attention kernels compute NaN (tests/engines/test_vllm_kv_cache.py): the
    report's KV block names each such layer, and says nothing below it."""
    from converters.calibration.kv_cache import KvAmax

    amax = {f"model.layers.{i}.self_attn": KvAmax(key=torch.tensor([10.0, 12.0]), dtype=torch.float32,
                                                   value=torch.tensor([1.0, value_amax if i else 2.0]))
            for i in range(2)}
    target_of = {f"model.layers.{i}.self_attn.{proj}.weight": f"model.layers.{i}.self_attn.{proj}.weight"
                 for i in range(2) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
    block = attach_kv_scales(ServingSelection(format=FORMAT), amax, target_of, torch.float32)
    assert block["layers"]["model.layers.1.self_attn"]["v_scale"] == pytest.approx(value_amax / 448)
    if warned:
        assert "model.layers.1.self_attn" in block["warning"] and "model.layers.0" not in block["warning"]
        assert "--kv-cache-dtype-skip-layers" in block["warning"]
    else:
        assert block["warning"] is None
