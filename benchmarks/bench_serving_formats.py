"""fp8forge's serving exports beside the tools they imitate, one scheme at a time: same model, same tokens.

Schemes (``--scheme``), each a pair of exports of every decoder Linear (lm_head left in bf16):
  fp8             fp8forge "compressed-tensors-fp8"  | llm-compressor QuantizationModifier(scheme="FP8")
  fp8-kv          the same with kv_cache="fp8"       | the same with kv_cache_scheme={"num_bits": 8, "type": "float",
                                                       "strategy": "tensor", "dynamic": False, "symmetric": True}
  fp8-kv-static   the same, the peer's kv_cache_scheme with observer "static_minmax" (see KV_CACHE_SCHEME)
  nvfp4           fp8forge "nvfp4" (W4A4)            | llm-compressor scheme="NVFP4"
  modelopt-fp8    fp8forge "modelopt-fp8"            | ModelOpt mtq.quantize(FP8_DEFAULT_CFG) + export_hf_checkpoint
  modelopt-nvfp4  fp8forge "modelopt-nvfp4"          | ModelOpt mtq.quantize(NVFP4_DEFAULT_CFG) + export_hf_checkpoint
  modelopt-fp8-kv, modelopt-nvfp4-kv   the same with kv_cache="fp8" | the config with FP8_KV_CFG's entries appended
                                       (update_quant_cfg_with_kv_cache_quant, as ModelOpt's hf_ptq.py does)
fp8forge runs as in bench_serving.py (run_conversion, backend "ao", skip_first_last off, exclude lm_head; its timed
work also writes the ao artifact). llm-compressor 0.14.0.1 runs in bench_serving.py's peer venv (its `peer-export`
child: from_pretrained(bf16), oneshot(...), save_pretrained(save_compressed=True); that venv resolves transformers
5.17 and compressed-tensors 0.19.0). ModelOpt 0.47 runs in a venv of its own (default build/modelopt-venv, where
`make modelopt-venv` builds it, `--modelopt-venv`; created on first use like the peer's: torch==2.13.0 first,
kept by a constraints file, then MODELOPT_PACKAGES):
from_pretrained(bf16), mtq.quantize(model, <config>, forward_loop over the calibration batches),
export_hf_checkpoint(model, export_dir). Every tool calibrates on the same `--steps` x `--batch-size` x
`--seq-len` tokens, built once as fp8forge builds them (bench_serving.write_calibration_tokens).

What is printed (figures only, nothing is asserted):
  time and memory  each export is a fresh child measured by benchmarks/measure.py: in-process seconds (after the
                   imports), process wall, peak RSS above the same tool's import-only baseline, split into
                   anonymous and file-backed pages (bench_serving.print_run / print_table).
  per layer        for every quantized Linear, read one tensor at a time from both exports and the source: whether
                   the quantized payload (FP8 `weight`, or the packed FP4 `weight_packed` / ModelOpt `weight`) is
                   identical byte for byte; the max abs and relative difference of each scale (weight_scale, the
                   global scales, the input scale) and how many are equal to the bit; the SQNR in dB of each tool's
                   dequantized weight against the bf16 source (10 log10 |w|^2 / |w - deq(w)|^2) and the margin
                   fp8forge minus the peer. Printed per decoder layer (its Linears summed or at their worst), then
                   in total.
  KV cache         each attention layer's k_scale / v_scale of both exports: equal to the bit, or their ratio.
                   Two causes of a difference, both the peer's: its bare kv_cache_scheme observes K/V with a moving
                   average (see KV_CACHE_SCHEME; fp8-kv-static removes it), and its sequential pipeline calibrates
                   each layer on the previous layers' quantized outputs, so input and KV scales after layer 0 can
                   differ by a bf16 step or so even with the same observer (fp8forge calibrates the bf16 model).
  logits           cosine to the bf16 model's logits on 2 x seq-len tokens drawn with seed 1 (calibration: seed
                   0): (a) the export loaded by transformers + compressed-tensors (only compressed-tensors
                   exports: transformers 5.24 has no loader for quant_method "modelopt"); (b) "weights only":
                   the bf16 model with each quantized Linear's weight replaced by the export's dequantized
                   weight, activations unquantized, the same for every format.
  config / layout  how the two quantization_config blocks and the safetensors layouts differ.

ModelOpt on a CPU (tried 2026-12-01: nvidia-modelopt 0.47.0, torch 2.13.0+cpu, transformers 5.14.1): both
FP8_DEFAULT_CFG and NVFP4_DEFAULT_CFG calibrate and export_hf_checkpoint writes the checkpoint, no GPU needed.
Three things were needed: transformers < 5.15 (what nvidia-modelopt[hf] 0.47 pins; the extra itself is not installed, it
would bring deepspeed, diffusers and peft) plus `requests` (modelopt.torch.utils imports it at import time and
declares it only in that extra), and config.architectures set before the export (bench_scale's config has none;
ModelOpt's is_multimodal_model then fails with "TypeError: 'NoneType' object is not iterable"). When its export
fails for another reason, the script prints the child's error and carries on with fp8forge's side alone.

Run (the smallest configuration that exercises every scheme, a few minutes each on 2 cores):
  .venv/bin/python benchmarks/bench_serving_formats.py --scheme nvfp4 --sizes 0.005 --hidden 256 \\
      --intermediate 1024 --heads 4 --kv-heads 2 --vocab 1024 --steps 2
  (--scheme: any name above; --skip-peer for fp8forge alone; --keep to keep the model and both exports)
The first llm-compressor or ModelOpt scheme creates that tool's venv (minutes, reported apart from the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import bench_serving
from bench_scale import GIB, Calibration, ModelPlan, add_width_arguments, read_through, weight_files, write_model
from bench_serving import (
    DEFAULT_PEER_VENV,
    FP8FORGE,
    PEER,
    SizeResult,
    ToolRun,
    config_differences,
    directory_bytes,
    ensure_peer_venv,
    flatten,
    last_json_line,
    layout_differences,
    measure_tool,
    model_plans,
    pip_install,
    print_run,
    print_table,
    venv_python,
    write_calibration_tokens,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.modelopt_venv (stdlib only), in either venv
from tests.modelopt_venv import MODELOPT_STAMP  # noqa: E402
from tests.modelopt_venv import MODELOPT_VENV as DEFAULT_MODELOPT_VENV  # noqa: E402  (`make modelopt-venv` builds it)

MODELOPT = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's side file, beside config.json
# transformers as nvidia-modelopt[hf] 0.47 pins it (the extra itself would add deepspeed, diffusers, peft...)
MODELOPT_PACKAGES = ("nvidia-modelopt==0.47.*", "transformers>=4.57,<5.15", "accelerate", "requests")
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# With no observer named, llm-compressor 0.14 observes K and V with "minmax" (calibration.initialize_observer), a
# moving average of each batch's min/max (averaging_constant 0.01), while its presets' input activations use
# "static_minmax" (the running extreme, what fp8forge records); fp8-kv-static names it to separate the two causes of
# KV-scale differences (the observer, and the peer calibrating through its already fake-quantized Linears).
KV_CACHE_SCHEME_STATIC = {**KV_CACHE_SCHEME, "observer": "static_minmax"}


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """One side-by-side: fp8forge's serving format (and kv_cache) against a peer tool's recipe."""

    name: str
    serving_format: str
    layout: str  # a key of LAYOUTS: how both exports store a quantized Linear
    peer: str  # PEER (llm-compressor) or MODELOPT
    peer_recipe: dict  # QuantizationModifier's keyword arguments, or {"config": <mtq config>[, "kv_config": ...]}
    kv_cache: str | None = None


SCHEMES = {scheme.name: scheme for scheme in (
    Scheme(name="fp8", serving_format="compressed-tensors-fp8", layout="ct-fp8", peer=PEER,
           peer_recipe={"scheme": "FP8"}),
    Scheme(name="fp8-kv", serving_format="compressed-tensors-fp8", layout="ct-fp8", peer=PEER, kv_cache="fp8",
           peer_recipe={"scheme": "FP8", "kv_cache_scheme": KV_CACHE_SCHEME}),
    Scheme(name="fp8-kv-static", serving_format="compressed-tensors-fp8", layout="ct-fp8", peer=PEER, kv_cache="fp8",
           peer_recipe={"scheme": "FP8", "kv_cache_scheme": KV_CACHE_SCHEME_STATIC}),
    Scheme(name="nvfp4", serving_format="nvfp4", layout="ct-nvfp4", peer=PEER, peer_recipe={"scheme": "NVFP4"}),
    Scheme(name="modelopt-fp8", serving_format="modelopt-fp8", layout="modelopt-fp8", peer=MODELOPT,
           peer_recipe={"config": "FP8_DEFAULT_CFG"}),
    Scheme(name="modelopt-nvfp4", serving_format="modelopt-nvfp4", layout="modelopt-nvfp4", peer=MODELOPT,
           peer_recipe={"config": "NVFP4_DEFAULT_CFG"}),
    Scheme(name="modelopt-fp8-kv", serving_format="modelopt-fp8", layout="modelopt-fp8", peer=MODELOPT,
           kv_cache="fp8", peer_recipe={"config": "FP8_DEFAULT_CFG", "kv_config": "FP8_KV_CFG"}),
    Scheme(name="modelopt-nvfp4-kv", serving_format="modelopt-nvfp4", layout="modelopt-nvfp4", peer=MODELOPT,
           kv_cache="fp8", peer_recipe={"config": "NVFP4_DEFAULT_CFG", "kv_config": "FP8_KV_CFG"}),
)}


# ---- ModelOpt's virtualenv and its child ------------------------------------------------------------------


def modelopt_versions(venv: Path) -> dict | None:
    """The ModelOpt venv's package versions, or None when it cannot import modelopt."""
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = ("import json, torch, transformers, modelopt; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'transformers': transformers.__version__, "
             "'nvidia-modelopt': modelopt.__version__}))")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None


def ensure_modelopt_venv(venv: Path) -> tuple[dict, float | None]:
    """ModelOpt's versions and its install seconds (None when an existing venv was reused); the venv's stamp
    (MODELOPT_STAMP's name, what the tests look for) once `import modelopt` works."""
    versions = modelopt_versions(venv)
    if versions is not None:
        (venv / MODELOPT_STAMP.name).touch()
        return versions, None
    started = time.perf_counter()
    log = venv / "install.log"
    print(f"installing {', '.join(MODELOPT_PACKAGES)} into {venv} (log: {log})", flush=True)
    if not venv_python(venv).exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "fp8forge-bench-constraints.txt"
    constraints.write_text(bench_serving.PEER_TORCH + "\n")
    pip_install(venv, constraints, bench_serving.PEER_TORCH, log)
    for package in MODELOPT_PACKAGES:
        pip_install(venv, constraints, package, log)
    versions = modelopt_versions(venv)
    if versions is None:
        raise SystemExit(f"{venv} still cannot import modelopt after the install; see {log}")
    (venv / MODELOPT_STAMP.name).touch()
    return versions, time.perf_counter() - started


def import_modelopt() -> None:
    """What ModelOpt's baseline loads; its export child loads the same before its clock starts."""
    import modelopt.torch.quantization  # noqa: F401
    import torch  # noqa: F401
    from modelopt.torch.export import export_hf_checkpoint  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def child_modelopt_imports(_: dict) -> dict:
    import_modelopt()
    return {"seconds": 0.0}


def child_modelopt_export(params: dict) -> dict:
    import_modelopt()
    import copy

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    rows = json.loads(Path(params["tokens"]).read_text())
    ids, mask = torch.tensor(rows["input_ids"]), torch.tensor(rows["attention_mask"])
    batch = params["batch_size"]
    start = time.perf_counter()
    bench_serving.set_phase("load")
    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16).eval()
    # bench_scale writes its config without "architectures" (a hub checkpoint has it); ModelOpt's export iterates
    # over it (model_utils.is_multimodal_model) and fails with "'NoneType' object is not iterable" otherwise.
    model.config.architectures = model.config.architectures or [type(model).__name__]
    loaded = time.perf_counter()

    def forward_loop(module) -> None:
        with torch.no_grad():
            for first in range(0, len(ids), batch):
                module(input_ids=ids[first:first + batch], attention_mask=mask[first:first + batch])

    bench_serving.set_phase("quantize")
    # The configs already disable "*lm_head*" (their _default_disabled_quantizer_cfg): lm_head stays bf16.
    config = copy.deepcopy(getattr(mtq, params["recipe"]["config"]))
    if "kv_config" in params["recipe"]:
        from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant

        config = update_quant_cfg_with_kv_cache_quant(config, getattr(mtq, params["recipe"]["kv_config"])["quant_cfg"])
    mtq.quantize(model, config, forward_loop)
    calibrated = time.perf_counter()
    bench_serving.set_phase("export")
    export_hf_checkpoint(model, export_dir=params["out_dir"])
    end = time.perf_counter()
    return {"seconds": end - start, "load": loaded - start, "quantize": calibrated - loaded,
            "export": end - calibrated}


# ---- the check of both exports (project venv, not measured) -----------------------------------------------


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of codes 0..7; bit 3 is the sign
NVFP4_GROUP = 16


def unpack_e2m1(packed):
    """``[rows, cols / 2]`` uint8 (the even column in the low nibble) as float32 ``[rows, cols]``."""
    import torch

    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    values = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def _block_dequantize(packed, block_scale, factor):
    values = unpack_e2m1(packed)
    rows, columns = values.shape
    blocks = values.unflatten(-1, (columns // NVFP4_GROUP, NVFP4_GROUP)) * block_scale.float().unsqueeze(-1)
    return blocks.reshape(rows, columns) * factor


def _dequantize_ct_nvfp4(t: dict):
    return _block_dequantize(t["weight_packed"], t["weight_scale"], 1.0 / t["weight_global_scale"].float())


def _dequantize_modelopt_nvfp4(t: dict):
    return _block_dequantize(t["weight"], t["weight_scale"], t["weight_scale_2"].float())


def _dequantize_fp8(t: dict):
    return t["weight"].float() * t["weight_scale"].float()


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one export format stores a quantized Linear ``<prefix>``: its payload, its scales, how it dequantizes."""

    payload: str  # the quantized weight's suffix: "weight" or "weight_packed"
    scales: tuple[str, ...]  # the scale suffixes compared (a Linear is quantized when it has the first)
    dequantize: Callable[[dict], object]  # {suffix: tensor} -> float32 weight
    transformers_loads: bool  # whether transformers 5.24 can load the export (quant_method compressed-tensors)


LAYOUTS = {
    "ct-fp8": Layout(payload="weight", scales=("weight_scale", "input_scale"), dequantize=_dequantize_fp8,
                     transformers_loads=True),
    "ct-nvfp4": Layout(payload="weight_packed",
                       scales=("weight_scale", "weight_global_scale", "input_global_scale"),
                       dequantize=_dequantize_ct_nvfp4, transformers_loads=True),
    "modelopt-fp8": Layout(payload="weight", scales=("weight_scale", "input_scale"), dequantize=_dequantize_fp8,
                           transformers_loads=False),
    "modelopt-nvfp4": Layout(payload="weight", scales=("weight_scale", "weight_scale_2", "input_scale"),
                             dequantize=_dequantize_modelopt_nvfp4, transformers_loads=False),
}


class Tensors:
    """The tensors of a directory's safetensors files, read one at a time by name."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self._handles, self._file_of = {}, {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            self._handles[path] = handle = safe_open(path, framework="pt")
            self._file_of.update({name: path for name in handle.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __getitem__(self, name: str):
        return self._handles[self._file_of[name]].get_tensor(name)

    def names(self) -> list[str]:
        return list(self._file_of)

    def quantized(self, layout: Layout) -> dict[str, dict]:
        """``{prefix: {suffix: tensor}}`` for every quantized Linear (loaded lazily: the dict maps to a reader)."""
        suffix = f".{layout.scales[0]}"
        prefixes = [name.removesuffix(suffix) for name in self._file_of if name.endswith(suffix)]
        return {prefix: {kind: f"{prefix}.{kind}" for kind in (layout.payload, *layout.scales)
                         if f"{prefix}.{kind}" in self}
                for prefix in prefixes if f"{prefix}.{layout.payload}" in self}

    def read(self, names: dict[str, str]) -> dict:
        return {kind: self[name] for kind, name in names.items()}


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def dequantize(directory: str, layout: Layout) -> Iterator[tuple[str, object]]:
    """``(module path, float32 weight)`` for every quantized Linear of an export, one at a time."""
    tensors = Tensors(directory)
    for prefix, names in tensors.quantized(layout).items():
        yield prefix, layout.dequantize(tensors.read(names))


def sqnr_db(reference, approximation) -> float:
    import math

    noise = float((reference - approximation).double().pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(reference.double().pow(2).sum()) / noise)


def compare_linear(source, ours: dict, theirs: dict, layout: Layout) -> dict:
    """One Linear of both exports: payload bytes, scale differences, SQNR of each against the bf16 source."""
    import torch

    a, b = ours[layout.payload].view(torch.uint8), theirs[layout.payload].view(torch.uint8)
    same = int((a == b).sum()) if a.shape == b.shape else 0
    scale_diff, scale_relative, scale_equal = {}, {}, {}
    for kind in layout.scales:
        if kind in ours and kind in theirs and ours[kind].numel() == theirs[kind].numel():
            x, y = ours[kind].reshape(-1), theirs[kind].reshape(-1)
            difference = (x.float() - y.float()).abs()
            scale_diff[kind] = float(difference.max())
            scale_relative[kind] = float((difference / y.float().abs().clamp(min=1e-30)).max())
            scale_equal[kind] = x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    source = source.float()
    return {"bytes": a.numel(), "equal_bytes": same, "identical": same == a.numel(), "scale_diff": scale_diff,
            "scale_relative": scale_relative, "scale_equal": scale_equal,
            "sqnr_ours": sqnr_db(source, layout.dequantize(ours)),
            "sqnr_peer": sqnr_db(source, layout.dequantize(theirs))}


def _summary(linears: list[dict]) -> dict:
    def worst(kind: str, measure: str = "scale_diff") -> float | None:
        values = [linear[measure][kind] for linear in linears if kind in linear[measure]]
        return max(values) if values else None

    kinds = {kind for linear in linears for kind in linear["scale_diff"]}
    margins = [linear["sqnr_ours"] - linear["sqnr_peer"] for linear in linears]
    return {"linears": len(linears), "identical": sum(linear["identical"] for linear in linears),
            "equal_byte_fraction": sum(x["equal_bytes"] for x in linears) / max(1, sum(x["bytes"] for x in linears)),
            "scale_diff": {kind: worst(kind) for kind in kinds},
            "scale_relative": {kind: worst(kind, "scale_relative") for kind in kinds},
            "scale_equal": {kind: sum(bool(x["scale_equal"].get(kind)) for x in linears) for kind in kinds},
            "sqnr_ours": sum(x["sqnr_ours"] for x in linears) / len(linears),
            "sqnr_peer": sum(x["sqnr_peer"] for x in linears) / len(linears),
            "margin_min": min(margins), "margin_max": max(margins)}


def compare_layers(model_dir: str, ours_dir: str, theirs_dir: str, layout: Layout) -> dict:
    """Every Linear quantized in both exports, compared (:func:`compare_linear`), summed per decoder layer."""
    source, ours, theirs = Tensors(model_dir), Tensors(ours_dir), Tensors(theirs_dir)
    mine, peers = ours.quantized(layout), theirs.quantized(layout)
    common = sorted(set(mine) & set(peers), key=_natural)
    by_layer: dict[str, list[dict]] = {}
    for prefix in common:
        layer = re.search(r"\.layers\.(\d+)\.", prefix)
        compared = compare_linear(source[f"{prefix}.weight"], ours.read(mine[prefix]), theirs.read(peers[prefix]),
                                  layout)
        by_layer.setdefault(layer.group(1) if layer else "-1", []).append(compared)
    only_one = {tool: sorted(set(a) - set(b), key=_natural)[:5]
                for tool, a, b in ((FP8FORGE, mine, peers), ("peer", peers, mine)) if set(a) - set(b)}
    return {"payload": layout.payload, "scale_kinds": list(layout.scales), "linears": len(common),
            "per_layer": {layer: _summary(linears) for layer, linears in by_layer.items()},
            "total": _summary([x for linears in by_layer.values() for x in linears]), "only_one": only_one}


def kv_scales(ours_dir: str, theirs_dir: str) -> dict:
    """Each attention layer's k_scale / v_scale in both exports, and whether the two are equal to the bit."""
    import torch

    exports = {FP8FORGE: Tensors(ours_dir), "peer": Tensors(theirs_dir)}
    found = {tool: [n for n in t.names() if n.endswith((".k_scale", ".v_scale"))] for tool, t in exports.items()}
    layers: dict[str, dict] = {}
    for name in sorted(set(found[FP8FORGE]) | set(found["peer"]), key=_natural):
        prefix, kind = name.rsplit(".", 1)
        prefix = re.sub(r"\.[kv]_proj$", "", prefix)  # ModelOpt's <attn>.k_proj.k_scale: one row per attention
        values = {tool: exports[tool][name] for tool in exports if name in exports[tool]}
        entry = {tool: float(value.float().reshape(-1)[0]) for tool, value in values.items()}
        if len(values) == 2:
            a, b = values[FP8FORGE], values["peer"]
            entry["bit_equal"] = a.dtype == b.dtype and a.numel() == b.numel() and torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            entry["dtypes"] = [str(a.dtype), str(b.dtype)]
        layers.setdefault(prefix, {})[kind] = entry
    return {"layers": layers, "count": {tool: len(names) for tool, names in found.items()}}


def child_formats_check(params: dict) -> dict:
    """Per-layer bytes, scales and SQNR, KV scales, and logits cosines of both exports (see the docstring)."""
    layout = LAYOUTS[params["layout"]]
    exports = params["exports"]
    result = {"layers": compare_layers(params["model_dir"], exports[FP8FORGE], exports["peer"], layout),
              "kv": kv_scales(exports[FP8FORGE], exports["peer"]),
              "logits": logits_cosines(params, layout)}
    return result


def logits_cosines(params: dict, layout: Layout) -> dict:
    """Per export: cosine to the bf16 logits, loaded by transformers (compressed-tensors only) and weights-only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from converters.calibration.batches import calibration_batches

    batches, _ = calibration_batches(AutoTokenizer.from_pretrained(params["model_dir"]), vocab_size=params["vocab"],
                                     steps=1, batch_size=2, seq_len=params["seq_len"], seed=1)
    batch = batches[0]

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(**batch, use_cache=False).logits.float().flatten()

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    reference = logits(AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16))
    result = {}
    for tool, directory in params["exports"].items():
        entry: dict = {}
        if layout.transformers_loads:
            model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
            entry["transformers"] = cosine(logits(model), reference)
            entry["q_proj_class"] = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")})
            entry["loading_problems"] = {kind: sorted(info[kind])[:5] for kind in
                                         ("missing_keys", "unexpected_keys", "mismatched_keys") if info[kind]}
            del model
        model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.bfloat16)
        modules = dict(model.named_modules())
        for prefix, weight in dequantize(directory, layout):
            modules[prefix].weight.data = weight.to(torch.bfloat16)
        entry["weights_only"] = cosine(logits(model), reference)
        result[tool] = entry
    return result


ROLES = {"modelopt-imports": child_modelopt_imports, "modelopt-export": child_modelopt_export,
         "formats-check": child_formats_check}


# ---- printing the check -----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _scale(summary: dict, kind: str) -> str:
    """A scale's worst absolute difference and, in brackets, its worst relative one."""
    absolute, relative = summary["scale_diff"].get(kind), summary["scale_relative"].get(kind)
    return "n/a" if absolute is None else f"{absolute:.3g} ({relative:.2%})"


def print_layers(layers: dict, peer: str) -> None:
    rows = layers["per_layer"]
    kinds = layers["scale_kinds"]
    print(f"  per decoder layer ({layers['linears']} quantized Linears compared; payload '{layers['payload']}'; "
          f"SQNR of the dequantized weight against the bf16 source, mean over the layer's Linears):")
    header = ("layer", "identical", *[f"max|d {kind}| (rel)" for kind in kinds], f"SQNR {FP8FORGE} dB",
              f"SQNR {peer} dB", "margin min / max dB")
    table = [(str(index), f"{row['identical']}/{row['linears']}", *[_scale(row, kind) for kind in kinds],
              _fmt(row["sqnr_ours"]), _fmt(row["sqnr_peer"]),
              f"{_fmt(row['margin_min'], '+.3f')} / {_fmt(row['margin_max'], '+.3f')}")
             for index, row in sorted(rows.items(), key=lambda item: int(item[0]))]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print("    " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    total = layers["total"]
    print(f"  total: {total['identical']}/{layers['linears']} Linears with identical payload bytes "
          f"({total['equal_byte_fraction']:.6f} of the bytes equal); max |diff| " + ", ".join(
              f"{kind} {_scale(total, kind)} ({total['scale_equal'].get(kind, 0)}/"
              f"{layers['linears']} equal)" for kind in kinds) +
          f"; SQNR mean {FP8FORGE} {_fmt(total['sqnr_ours'])} dB, {peer} {_fmt(total['sqnr_peer'])} dB, margin "
          f"{_fmt(total['margin_min'], '+.3f')} .. {_fmt(total['margin_max'], '+.3f')} dB")
    if layers["only_one"]:
        print(f"  quantized in one export only: {json.dumps(layers['only_one'])}")


def print_kv(kv: dict, peer: str) -> None:
    if not kv["layers"]:
        print(f"  KV-cache scales: none in either export ({FP8FORGE} {kv['count'][FP8FORGE]}, {peer} "
              f"{kv['count']['peer']})")
        return
    print(f"  KV-cache scales ({FP8FORGE} / {peer}; '=' equal to the bit, else the ratio):")
    for prefix, entry in kv["layers"].items():
        cells = []
        for kind in ("k_scale", "v_scale"):
            ours, theirs = entry.get(kind, {}).get(FP8FORGE), entry.get(kind, {}).get("peer")
            if ours is None or theirs is None:
                cells.append(f"{kind} {FP8FORGE} {_fmt(ours, '.4g')} | {peer} {_fmt(theirs, '.4g')}")
            elif entry[kind]["bit_equal"]:
                cells.append(f"{kind} = ({ours:.4g})")
            else:
                cells.append(f"{kind} {ours:.4g} / {theirs:.4g} = {ours / theirs:.4f}")
        print(f"    {prefix}: " + "; ".join(cells))


def print_logits(logits: dict, peer: str) -> None:
    print("  logits cosine to the bf16 model (2 x seq-len tokens, seed 1):")
    for tool, entry in logits.items():
        name = FP8FORGE if tool == FP8FORGE else peer
        loaded = ("transformers + compressed-tensors "
                  f"{_fmt(entry['transformers'], '.5f')} (q_proj as {entry['q_proj_class']}; loading problems: "
                  f"{entry['loading_problems'] or 'none'}); " if "transformers" in entry else "")
        print(f"    {name}: {loaded}weights only {_fmt(entry['weights_only'], '.5f')}")


def side_file_differences(ours: Path, theirs: Path, peer: str) -> list[str]:
    """Keys of ModelOpt's hf_quant_config.json whose values differ between the two exports."""
    def read(directory: Path) -> dict:
        path = directory / HF_QUANT_CONFIG
        return flatten(json.loads(path.read_text())) if path.exists() else {"<file>": "absent"}

    first, second = read(ours), read(theirs)
    return [f"    {key}: {FP8FORGE} {json.dumps(first.get(key, '<absent>'))} | {peer} "
            f"{json.dumps(second.get(key, '<absent>'))}"
            for key in sorted(set(first) | set(second)) if first.get(key) != second.get(key)] or ["    (none)"]


def check_exports(scheme: Scheme, plan: ModelPlan, model_dir: Path, ours: Path, theirs: Path,
                  calibration: Calibration) -> None:
    started = time.perf_counter()
    params = {"model_dir": str(model_dir), "vocab": plan.width.vocab_size, "seq_len": calibration.seq_len,
              "layout": scheme.layout, "exports": {FP8FORGE: str(ours), "peer": str(theirs)}}
    checked = subprocess.run([sys.executable, __file__, "--child", "formats-check", json.dumps(params)],
                             capture_output=True, text=True)
    if checked.returncode:
        raise SystemExit(f"the check of both exports failed:\n{checked.stderr[-3000:]}")
    result = last_json_line(checked.stdout)
    peer = scheme.peer
    print(f"\n[{plan.name}] check, scheme {scheme.name} ({time.perf_counter() - started:.0f} s, project venv):")
    print_layers(result["layers"], peer)
    print_kv(result["kv"], peer)
    print_logits(result["logits"], peer)
    print(f"  quantization_config differences ({FP8FORGE} | {peer}):")
    print("\n".join(config_differences(ours, theirs, peer)))
    if (ours / HF_QUANT_CONFIG).exists() or (theirs / HF_QUANT_CONFIG).exists():
        print(f"  {HF_QUANT_CONFIG} differences ({FP8FORGE} | {peer}):")
        print("\n".join(side_file_differences(ours, theirs, peer)))
    print("  tensor layout differences (dtype [shape]):")
    print("\n".join(layout_differences(ours, theirs, peer)), flush=True)


# ---- one size ---------------------------------------------------------------------------------------------


def measure_peer(scheme: Scheme, python: Path, model_dir: Path, out_dir: Path, tokens: Path,
                 sizes: dict) -> ToolRun | None:
    """The peer's measured export; None (with its error printed) when the child fails."""
    script = bench_serving.__file__ if scheme.peer == PEER else __file__
    role = "peer-export" if scheme.peer == PEER else "modelopt-export"
    try:
        return measure_tool(scheme.peer, python, role, script, model_dir=str(model_dir), out_dir=str(out_dir),
                            tokens=str(tokens), recipe=scheme.peer_recipe, **sizes)
    except SystemExit as error:
        print(f"{scheme.peer}'s export failed; its last lines:\n{str(error)[-2500:]}", flush=True)
        return None


def measure_size(scheme: Scheme, plan: ModelPlan, root: Path, calibration: Calibration, peer_python: Path | None,
                 tokens: Path, baselines: dict[str, ToolRun], check: bool, keep: bool) -> SizeResult:
    model_dir = root / plan.name
    write_model(plan, model_dir)
    os.sync()
    read_through(weight_files(model_dir))
    print(f"[{plan.name}] {plan.layers} layers, {plan.parameters:,} parameters", flush=True)
    sizes = {"steps": calibration.steps, "batch_size": calibration.batch_size, "seq_len": calibration.seq_len}
    if peer_python is not None and not tokens.exists():
        source = write_calibration_tokens(model_dir, plan.width.vocab_size, calibration, tokens)
        print(f"calibration tokens for both tools: {source}", flush=True)

    ours_dir = root / f"{plan.name}-fp8forge"
    ours = measure_tool(FP8FORGE, sys.executable, "fp8forge-export", model_dir=str(model_dir), out_dir=str(ours_dir),
                        root=str(root), serving_format=scheme.serving_format, kv_cache=scheme.kv_cache, **sizes)
    serving_dir = ours_dir / "serving" / scheme.serving_format
    stages = json.loads((ours_dir / "fp8_report.json").read_text()).get("stage_seconds", {})
    ours.details["stages"] = {stage: round(seconds, 2) for stage, seconds in stages.items()}
    print_run(plan.name, ours, baselines[FP8FORGE])
    print(f"[{plan.name}] {FP8FORGE} wrote {directory_bytes(serving_dir) / GIB:.3f} GiB of serving export",
          flush=True)
    runs = {FP8FORGE: ours}
    theirs_dir = root / f"{plan.name}-{scheme.peer}"
    if peer_python is not None:
        theirs = measure_peer(scheme, peer_python, model_dir, theirs_dir, tokens, sizes)
        if theirs is not None:
            print_run(plan.name, theirs, baselines[scheme.peer])
            print(f"[{plan.name}] {scheme.peer} wrote {directory_bytes(theirs_dir) / GIB:.3f} GiB", flush=True)
            runs[scheme.peer] = theirs
            if check:
                check_exports(scheme, plan, model_dir, serving_dir, theirs_dir, calibration)
    if not keep:
        for directory in (model_dir, ours_dir, theirs_dir):
            shutil.rmtree(directory, ignore_errors=True)
    return SizeResult(plan=plan, runs=runs)


# ---- command line -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="fp8")
    parser.add_argument("--sizes", default="0.5", help="target sizes in billions of parameters (0.5)")
    parser.add_argument("--steps", type=int, default=8, help="calibration batches (8)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workdir", type=Path, help="where the run's temporary directory goes (system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the models, the exports and the run's directory")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV,
                        help=f"llm-compressor's virtualenv, created when missing ({DEFAULT_PEER_VENV})")
    parser.add_argument("--modelopt-venv", type=Path, default=DEFAULT_MODELOPT_VENV,
                        help=f"ModelOpt's virtualenv, created when missing ({DEFAULT_MODELOPT_VENV})")
    parser.add_argument("--skip-peer", action="store_true", help="measure fp8forge only")
    add_width_arguments(parser)
    return parser.parse_args()


def peer_python(args: argparse.Namespace, scheme: Scheme) -> Path | None:
    """The peer venv's interpreter, installing the venv when missing; None with --skip-peer."""
    if args.skip_peer:
        return None
    venv = (args.peer_venv if scheme.peer == PEER else args.modelopt_venv).expanduser().resolve()
    versions, seconds = (ensure_peer_venv if scheme.peer == PEER else ensure_modelopt_venv)(venv)
    how = "reused" if seconds is None else f"installed in {seconds:.0f} s (not measured below)"
    print(f"{scheme.peer} venv {venv} {how}: {json.dumps(versions)}", flush=True)
    return venv_python(venv)


def run(args: argparse.Namespace, root: Path) -> None:
    scheme = SCHEMES[args.scheme]
    calibration = Calibration(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    python = peer_python(args, scheme)
    print(f"scheme {scheme.name}: {FP8FORGE} {scheme.serving_format!r} kv_cache={scheme.kv_cache} | {scheme.peer} "
          f"{json.dumps(scheme.peer_recipe)}", flush=True)
    print(f"fp8forge: {bench_serving.fp8forge_source_state()}", flush=True)
    baselines = {FP8FORGE: measure_tool(FP8FORGE, sys.executable, "fp8forge-imports")}
    if python is not None:
        script, role = ((bench_serving.__file__, "peer-imports") if scheme.peer == PEER
                        else (__file__, "modelopt-imports"))
        baselines[scheme.peer] = measure_tool(scheme.peer, python, role, script)
    print(f"calibration: {calibration.steps} x {calibration.batch_size} x {calibration.seq_len} tokens; "
          f"work directory {root}", flush=True)
    tokens = root / "calibration_tokens.json"
    results = [measure_size(scheme, plan, root, calibration, python, tokens, baselines, index == 0, args.keep)
               for index, plan in enumerate(model_plans(args))]
    print_table(results, baselines)
    print("baselines (import-only peak RSS): " + ", ".join(f"{tool} {run.peak_rss / 2**20:,.0f} MiB"
                                                           for tool, run in baselines.items()))
    for result in results:
        if scheme.peer in result.runs:
            ours, theirs = result.runs[FP8FORGE], result.runs[scheme.peer]
            print(f"ratio {FP8FORGE} / {scheme.peer} at {result.plan.name}: in-process time "
                  f"{ours.seconds / theirs.seconds:.2f}, process wall {ours.wall / theirs.wall:.2f}")


def main() -> None:
    bench_serving.main(run, parse_args, "bench_serving_formats-", ROLES)


if __name__ == "__main__":
    main()
