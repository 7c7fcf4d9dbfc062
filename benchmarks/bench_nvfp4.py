"""NVFP4 (W4A4) on the real SmolLM2-135M: fp8forge round to nearest, fp8forge with block scales searched by
reconstruction error (``scale_search="mse"``), llm-compressor's RTN and nvidia-modelopt's NVFP4 recipes, from the same
calibration tokens, scored by the same emulated W4A4 forward on the same held-out tokens.

What runs:
  fp8forge   a real conversion job (run_conversion: backend ao, serving format nvfp4, skip_first_last off, lm_head
             excluded, measure off) on ``--steps`` windows of 128 tokens of the built-in corpus' calibration part
             (what a job reads without texts); its export is "fp8forge rtn".
  mse        the same export with each quantized weight requantized by converters.serving.nvfp4.quantize_nvfp4(...,
             scale_search="mse") from the source weight and its fused group's amax; the RTN requantization is first
             checked byte-identical to the job's file, so only the block scales differ; input global scales kept.
  peer       llm-compressor 0.14.0.1 oneshot(QuantizationModifier(scheme="NVFP4", ignore=["lm_head"])) in its own
             virtualenv (bench_serving's, built on first use, ~3 minutes) on the same token rows as the job (written
             from the job's own calibration_batches call), saved compressed.
  swaps      fp8forge's weights with the peer's input global scales and the peer's weights with fp8forge's: which
             half of a difference comes from the calibration and which from the weights.
  four_over_six  the export requantized with scale_search="four_over_six" (each block's amax to 6 or to 4).
  modelopt   nvidia-modelopt 0.47 in its own venv (``make modelopt-venv``; built on first use otherwise), one export
             per ``--modelopt`` recipe (MODELOPT_RECIPES; by default MODELOPT_CPU_RECIPES, the NVFP4 calibration
             algorithms of 0.47 that run on a CPU) on the same token rows: bench_serving_formats' ``modelopt-export``
             child, i.e. from_pretrained(bf16), mtq.quantize(model, <preset>, forward_loop over the rows, batch 1),
             export_hf_checkpoint. A recipe that fails is printed with ModelOpt's error and left out. Read back
             like the others: ``code * weight_scale * weight_scale_2`` and the input amax ``input_scale * 2688``
             (compressed-tensors stores the reciprocals of the same two global scales); AWQ's ``pre_quant_scale``
             multiplies the input before its cast, and the export's other tensors that differ from the source
             (norms an AWQ scale was folded into) replace the model's. So every row runs what an engine would run
             from its file, not each tool's own fake quantization.
  searched   per fused group, converters.serving.nvfp4_search.search_group on ``--search-rows`` token rows of the
             bf16 model's inputs on the job's calibration windows: the weight global scale (``--weight-ratios``
             times the group amax, RTN blocks), then mse block scales, then the input global scale (0.2x-1.2x the
             calibrated amax), each kept only if it lowers the group's W4A4 output error; scored with the job's
             input scales ("searched weights") and with the searched ones ("searched weights + input scales").
  gptq       ``--gptq rtn,four_over_six[+act]``: each quantized weight requantized by
             converters.serving.nvfp4_gptq.quantize_nvfp4_gptq: the block scales of the named scale_search (and the
             fused group's global scale) fixed, the E2M1 codes rounded column by column with each column's error fed
             to the later columns through the inverse Hessian 2 X^T X / n of the group's inputs X on the bf16 model
             over the job's calibration windows (all their tokens); ``+act``: columns in order of decreasing H[j, j];
             ``+seq``: decoder layer by decoder layer, each layer's X from the model whose earlier layers already
             hold their GPTQ weights (llm-compressor's sequential pipeline); ``+qx``: H of the inputs cast to NVFP4
             under the export's input global scales (with ``+seq``, the earlier layers' inputs cast as well);
             ``+aq``: one pass toward what the W4A4 engine multiplies, ``Q(X) Q^T ~ X W^T`` (asymmetric_gptq).
             The job's input global scales are kept.
Scoring: the bf16 model with, for every Linear an export quantizes, the weight read back from the export
(``code * weight_scale / weight_global_scale``) and its input cast to NVFP4 as the engines' W4A4 kernels cast it
(per-16 E4M3 block scales under the file's ``input_global_scale``: converters.casts.emulation "nvfp4_block16").
``--activations a16`` (or ``both``) also scores every row with the inputs kept in bf16, as nvfp4-a16 (weight-only)
runs; those rows are named "... [a16]" and compared with llm-compressor RTN's weights scored the same way.
Perplexity over ``--tokens`` held-out tokens (the corpus' held-out part, windows of 256), next to the bf16 model's;
"loss" is perplexity / bf16 perplexity - 1. Also printed: each fp8forge input global scale over the peer's
(median, min with its layer), the weight SQNR of RTN and MSE, and how many block scales the search changed.
Figures only, nothing asserted; ratios against llm-compressor RTN measured in the same run.

Run:  .venv/bin/python benchmarks/bench_nvfp4.py [--steps 32] [--tokens 1024] [--skip-peer] [--keep DIR]
      [--search-rows 512 (0: no search)] [--weight-ratios 1.0,0.94,1.06] [--modelopt max[,awq_lite,...] | none]
      [--gptq rtn,four_over_six,four_over_six+act] [--activations w4a4|a16|both] [--skip-mse]
      (--keep DIR of an earlier run reuses its fp8forge and ModelOpt exports; --peer-export DIR scores an existing
      peer export)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from bench_serving import DEFAULT_PEER_VENV, ensure_peer_venv, venv_python  # noqa: E402
from bench_serving_formats import DEFAULT_MODELOPT_VENV, ensure_modelopt_venv  # noqa: E402
from safetensors import safe_open  # noqa: E402

from converters.casts.emulation import E2M1_GRID, cast_spec, fake_quantize  # noqa: E402
from converters.serving.nvfp4 import GROUP, block_errors, global_scale, quantize_nvfp4  # noqa: E402
from converters.serving.nvfp4_gptq import HessianAccumulator, quantize_nvfp4_gptq  # noqa: E402
from converters.serving.nvfp4_search import search_group  # noqa: E402

SEQ_LEN = 128  # calibration window
EVAL_WINDOW = 256
FUSED = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})  # members share weight_global_scale
NVFP4_INPUT = cast_spec("nvfp4_block16")
_E2M1 = torch.tensor(E2M1_GRID)
RECIPE_ROWS = ("fp8forge rtn", "fp8forge mse", "fp8forge four_over_six")  # what a job's nvfp4_weight_scales writes
JOB_GPTQ_ROW = "fp8forge job gptq "  #: + the block-scale method: a job's export with nvfp4_weight_rounding gptq
FP4_FP8_MAX = 6.0 * 448.0  # amax over a global scale: compressed-tensors stores its reciprocal, ModelOpt this one
#: nvidia-modelopt 0.47's W4A4 NVFP4 presets by calibration algorithm (modelopt_recipes/configs/ptq/presets/model)
MODELOPT_RECIPES = {
    "max": "NVFP4_DEFAULT_CFG",
    "four_over_six": "NVFP4_FOUR_OVER_SIX_CFG",  # weight block amax to 6 or 4, chosen by mse over 1.0-1.5x
    "mse fp8 sweep": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",  # every E4M3 block scale tried per block
    "local_hessian": "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG",  # the same sweep weighted by the inputs' X^T X
    "awq_lite": "NVFP4_AWQ_LITE_CFG",
    "awq_clip": "NVFP4_AWQ_CLIP_CFG",
    "awq_full": "NVFP4_AWQ_FULL_CFG",
    "svdquant": "NVFP4_SVDQUANT_DEFAULT_CFG",
}
#: the ones that run on a CPU: every other algorithm fake-quantizes during calibration, and 0.47's NVFP4 fake
#: quantization is CUDA-only (tensor_quant._dynamic_block_quantize_impl asserts ``amax.is_cuda``; the static
#: block quantizer needs its triton kernels, imported only when torch.cuda.is_available()). ``max`` calibrates with
#: the quantizers off and quantizes in plain torch at export.
MODELOPT_CPU_RECIPES = ("max",)


def job_batches(model_dir: Path, steps: int, *, whole_corpus: bool = False) -> tuple[list[dict], str]:
    """The job's calibration windows (the corpus' calibration part); ``whole_corpus``: the windows
    bench_serving.write_calibration_tokens gave the peer until 2026-12-03 (held-out part included)."""
    from transformers import AutoTokenizer

    from converters.calibration.batches import calibration_batches
    from converters.quality.held_out import calibration_part

    return calibration_batches(AutoTokenizer.from_pretrained(model_dir), vocab_size=49152, steps=steps, batch_size=1,
                               texts=None if whole_corpus else calibration_part(), seq_len=SEQ_LEN)


def run_with_input_hooks(model, batches: list[dict], paths: list[str], record) -> None:
    """Run ``batches`` through ``model`` (no grad), calling ``record(path, input)`` with each Linear's input."""
    handles = [model.get_submodule(path).register_forward_pre_hook(
        lambda module, args, path=path: record(path, args[0].detach())) for path in paths]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()


def observed_input_amax(model, batches: list[dict], paths: list[str]) -> dict[str, tuple[float, float]]:
    """Each Linear's input amax on the bf16 model over ``batches`` (what llm-compressor's static_minmax observer
    sees: its sequential pipeline calibrates with quantization disabled), and the same without each window's
    first position (where attention-sink models put their massive activations)."""
    seen = {path: [0.0, 0.0] for path in paths}

    def record(path, inputs):
        magnitude = inputs.float().abs()
        seen[path][0] = max(seen[path][0], float(magnitude.max()))
        seen[path][1] = max(seen[path][1], float(magnitude[:, 1:].max()))

    run_with_input_hooks(model, batches, paths, record)
    return {path: (values[0], values[1]) for path, values in seen.items()}


def print_calibration_diagnosis(model, model_dir: Path, steps: int, layers: dict) -> None:
    """fp8forge's calibrated input amax (from the export) against the bf16 model's own, on the job's windows and
    on the whole-corpus windows; the layers whose amax moves most between the two, and position 0's part."""
    paths = sorted(layers)
    written = {p: float(input_amax(layers[p])) for p in paths}
    job = observed_input_amax(model, job_batches(model_dir, steps)[0], paths)
    whole = observed_input_amax(model, job_batches(model_dir, steps, whole_corpus=True)[0], paths)
    same = statistics.median(written[p] / job[p][0] for p in paths)
    print(f"input amax: fp8forge's export / the bf16 model's on the same windows: median {same:.4f}, range "
          f"{min(written[p] / job[p][0] for p in paths):.4f}-{max(written[p] / job[p][0] for p in paths):.4f}")
    ratios = sorted((job[p][0] / whole[p][0], p) for p in paths)
    print(f"input amax, job windows / whole-corpus windows (the peer's tokens in bench_serving until now): median "
          f"{statistics.median(r for r, _ in ratios):.3f}; largest:")
    for ratio, path in ratios[-4:]:
        print(f"  {path}: {ratio:.2f} (job {job[path][0]:.2f}, without position 0 {job[path][1]:.2f}; whole corpus "
              f"{whole[path][0]:.2f}, without position 0 {whole[path][1]:.2f})")
    first = sum(job[p][0] > job[p][1] for p in paths)
    print(f"Linears whose job amax is set by a window's first position: {first} of {len(paths)}")


def fp8forge_export(model_dir: Path, out: Path, steps: int, formats: tuple[str, ...] = ("nvfp4",),
                    **recipe: str) -> Path:
    """A job's ``nvfp4`` export, and any other ``formats`` beside it under ``out/serving/`` (``recipe``: its serving
    options, e.g. nvfp4_weight_rounding)."""
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import NullSink, run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    request = ConversionRequest(model=str(model_dir), recipe={"backend": "ao", **recipe}, skip_first_last=False,
                                exclude=("lm_head",), serving_formats=formats, measure=False,
                                calibration=CalibrationSettings(steps=steps, batch_size=1, seq_len=SEQ_LEN))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(model_dir.parent, out.parent)), NullSink())
    return out / "serving" / "nvfp4"


def peer_export(model_dir: Path, rows_file: Path, out: Path, venv: Path) -> Path:
    ensure_peer_venv(venv)
    params = {"model_dir": str(model_dir), "tokens": str(rows_file), "recipe": {"scheme": "NVFP4"},
              "seq_len": SEQ_LEN, "batch_size": 1, "out_dir": str(out)}
    done = subprocess.run([str(venv_python(venv)), str(ROOT / "benchmarks" / "bench_serving.py"), "--child",
                           "peer-export", json.dumps(params)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llm-compressor's export failed:\n{done.stderr[-3000:]}")
    return out


def modelopt_export(model_dir: Path, rows_file: Path, out: Path, venv: Path, recipe: str) -> Path:
    """ModelOpt's export with MODELOPT_RECIPES[recipe] calibrated on ``rows_file``'s rows; a finished one is reused
    (a --keep directory of a run with the same --steps). RuntimeError with ModelOpt's last lines when it fails."""
    if (out / "hf_quant_config.json").is_file():
        return out
    ensure_modelopt_venv(venv)
    params = {"model_dir": str(model_dir), "tokens": str(rows_file), "recipe": {"config": MODELOPT_RECIPES[recipe]},
              "batch_size": 1, "out_dir": str(out)}
    done = subprocess.run([str(venv_python(venv)), str(ROOT / "benchmarks" / "bench_serving_formats.py"), "--child",
                           "modelopt-export", json.dumps(params)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return out


def read_modelopt_export(directory: Path, source: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A ModelOpt NVFP4 export: module path -> its tensors (the packed ``weight`` as weight_packed, weight_scale,
    weight_scale_2, input_scale, AWQ's pre_quant_scale), and the export's other tensors that differ from the
    source's. ValueError naming the tensors when the export holds any this reading would leave out."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    layers = {}
    for path in [key.removesuffix(".weight_scale_2") for key in tensors if key.endswith(".weight_scale_2")]:
        layers[path] = {name: tensors.pop(f"{path}.{suffix}") for name, suffix in (
            ("weight_packed", "weight"), ("weight_scale", "weight_scale"), ("weight_scale_2", "weight_scale_2"),
            ("input_scale", "input_scale"), ("pre_quant_scale", "pre_quant_scale")) if f"{path}.{suffix}" in tensors}
    unknown = sorted(key for key in tensors if key not in source)
    if unknown:
        raise ValueError(f"{len(unknown)} tensors this bench does not score, e.g. {unknown[:3]}")
    return layers, {key: tensor for key, tensor in tensors.items() if not torch.equal(tensor, source[key])}


def read_export(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Module path -> its NVFP4 tensors (weight_packed, weight_scale, weight_global_scale, input_global_scale)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                path, _, name = key.rpartition(".")
                if name in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
                    layers.setdefault(path, {})[name] = handle.get_tensor(key)
    return layers


def dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``code * weight_scale / weight_global_scale`` (fp32; ModelOpt's ``* weight_scale_2``), the even column in the
    low nibble."""
    packed = tensors["weight_packed"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    if "weight_scale_2" in tensors:
        step = tensors["weight_scale"].float() * tensors["weight_scale_2"].float()
    else:
        step = tensors["weight_scale"].float() / tensors["weight_global_scale"].float()
    return (values.unflatten(-1, (-1, GROUP)) * step.unsqueeze(-1)).flatten(-2)


def modelopt_differences(layers: dict, replaced: dict, ours: dict) -> str:
    """How a ModelOpt export differs from fp8forge's RTN export: packed weights, input amax, AWQ's tensors."""
    shared = sorted(set(ours) & set(layers))
    same = sum(torch.equal(ours[p]["weight_packed"], layers[p]["weight_packed"]) for p in shared)
    ratios = [float(input_amax(layers[p]) / input_amax(ours[p])) for p in shared]
    scaled = sum("pre_quant_scale" in tensors for tensors in layers.values())
    return (f"{len(layers)} Linears in NVFP4; packed weights identical to fp8forge rtn's in {same} of {len(shared)}; "
            f"input amax / fp8forge's: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-"
            f"{max(ratios):.3f}; Linears with a pre_quant_scale: {scaled}; other tensors changed: "
            f"{len(replaced)} {sorted(replaced)[:4]}")


def input_amax(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The calibrated input amax a layer's input global scale came from (fp32)."""
    if "input_scale" in tensors:  # ModelOpt
        return tensors["input_scale"].float() * FP4_FP8_MAX
    return FP4_FP8_MAX / tensors["input_global_scale"].float()


def requantized(source: dict[str, torch.Tensor], layers: dict[str, dict[str, torch.Tensor]], scale_search: str
                ) -> dict[str, dict[str, torch.Tensor]]:
    """The export's layers requantized from the source weights (each fused group's amax) by ``scale_search``."""
    def group_amax(path: str) -> float:
        parent, _, name = path.rpartition(".")
        members = next((group for group in FUSED if name in group), {name})
        return max(float(source[f"{parent}.{member}.weight"].float().abs().max()) for member in members
                   if f"{parent}.{member}" in layers)

    result = {}
    for path, tensors in layers.items():
        packed, scale, gparam = quantize_nvfp4(source[f"{path}.weight"], group_amax(path), scale_search=scale_search)
        result[path] = {**tensors, "weight_packed": packed, "weight_scale": scale, "weight_global_scale": gparam}
    return result


def fused_groups(layers: dict) -> dict[str, list[str]]:
    """The export's Linears by fused group (q/k/v, gate/up share their input and global scales; others alone)."""
    groups: dict[str, list[str]] = {}
    for path in sorted(layers):
        parent, _, name = path.rpartition(".")
        members = next((group for group in FUSED if name in group), {name})
        groups.setdefault(f"{parent}.{'+'.join(sorted(members))}", []).append(path)
    return groups


def cast_input(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x`` cast to NVFP4 as the engines' W4A4 kernels cast a layer's input under its file's input global scale."""
    flat = fake_quantize(x.reshape(-1, x.shape[-1]).float(), NVFP4_INPUT, tensor_amax=input_amax(tensors).reshape(()))
    return flat.reshape(x.shape).to(x.dtype)


def group_hessians(model, batches: list[dict], layers: dict, *, cast_inputs: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Each fused group's input Hessian (2 X^T X / n, fp64) on the bf16 model over ``batches``, by member path;
    ``cast_inputs``: of the inputs cast to NVFP4 (what a W4A4 layer multiplies its weight by)."""
    groups = fused_groups(layers)
    accumulators = {paths[0]: HessianAccumulator(model.get_submodule(paths[0]).in_features)
                    for paths in groups.values()}
    run_with_input_hooks(model, batches, list(accumulators), lambda path, inputs: accumulators[path].add(
        cast_input(inputs, layers[path]) if cast_inputs else inputs))
    matrices = {first: accumulator.matrix for first, accumulator in accumulators.items()}
    return {path: matrices[paths[0]] for paths in groups.values() for path in paths}


def gptq_requantized(source: dict[str, torch.Tensor], layers: dict, hessians: dict[str, torch.Tensor],
                     scale_search: str, act_order: bool) -> dict[str, dict[str, torch.Tensor]]:
    """The export's layers with GPTQ-rounded codes under ``scale_search``'s block scales (input scales kept)."""
    result = {}
    for paths in fused_groups(layers).values():
        amax = max(float(source[f"{path}.weight"].float().abs().max()) for path in paths)
        for path in paths:
            packed, scale, gparam = quantize_nvfp4_gptq(source[f"{path}.weight"], amax, hessians[path],
                                                        scale_search=scale_search, act_order=act_order)
            result[path] = {**layers[path], "weight_packed": packed, "weight_scale": scale,
                            "weight_global_scale": gparam}
    return result


def asymmetric_gptq(model, batches: list[dict], source: dict[str, torch.Tensor], layers: dict, scale_search: str,
                    act_order: bool) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ toward what a W4A4 engine multiplies: codes ``Q`` that make ``Q(X) Q^T`` close to ``X W^T`` (``Q(X)``:
    the inputs cast to NVFP4 under the export's input global scale). With ``H = Q(X)^T Q(X)`` and ``C = Q(X)^T X``
    (per fused group, on the bf16 model), ``|Q(X) Q^T - X W^T|^2 = |Q(X) (Q - W*)^T|^2 + const`` for
    ``W* = W C^T H^-1``; with GPTQ's damping ``d`` (1% of H's mean diagonal) ``W* = W (C + d I)^T (H + d I)^-1``,
    the least-squares fit plus ``d |W* - W|^2``. GPTQ rounds ``W*`` under ``H``, block scales of ``scale_search``
    from ``W*`` itself."""
    groups = fused_groups(layers)
    sums = {paths[0]: [torch.zeros(model.get_submodule(paths[0]).in_features, model.get_submodule(paths[0]).in_features,
                                   dtype=torch.float64) for _ in range(2)] for paths in groups.values()}

    def record(path, inputs):
        x = inputs.reshape(-1, inputs.shape[-1]).double()
        cast = cast_input(inputs, layers[path]).reshape(-1, inputs.shape[-1]).double()
        sums[path][0].addmm_(cast.T, cast)
        sums[path][1].addmm_(cast.T, x)

    run_with_input_hooks(model, batches, list(sums), record)
    result = {}
    for paths in groups.values():
        hessian, cross = sums[paths[0]]
        damping = 0.01 * hessian.diagonal().mean()
        damped, pulled = hessian.clone(), cross.clone()
        damped.diagonal().add_(damping)
        pulled.diagonal().add_(damping)  # the damping pulls W* toward W, not toward 0
        targets = {path: torch.linalg.solve(damped, pulled @ source[f"{path}.weight"].double().T).T
                   .to(source[f"{path}.weight"].dtype) for path in paths}
        amax = max(float(target.float().abs().max()) for target in targets.values())
        for path in paths:
            packed, scale, gparam = quantize_nvfp4_gptq(targets[path], amax, hessian, scale_search=scale_search,
                                                        act_order=act_order)
            result[path] = {**layers[path], "weight_packed": packed, "weight_scale": scale,
                            "weight_global_scale": gparam}
    return result


class _StopForward(Exception):
    """Raised after the decoder layer whose inputs were wanted: the rest of the forward is not needed."""


def sequential_gptq(model, batches: list[dict], source: dict[str, torch.Tensor], layers: dict, scale_search: str,
                    act_order: bool, *, cast_inputs: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ decoder layer by decoder layer, as llm-compressor's sequential pipeline runs it: each layer's Hessians
    from the inputs it gets when every earlier layer already holds its GPTQ weights (the earlier layers' rounding
    error included), the forward stopped after that layer; ``cast_inputs``: the quantized layers' inputs cast to
    NVFP4 and the Hessians of cast inputs (W4A4 as the engine runs it). The model is left as it was."""
    by_layer: dict[str, list[list[str]]] = {}
    for paths in fused_groups(layers).values():
        by_layer.setdefault(paths[0].rsplit(".", 2)[0], []).append(paths)  # model.layers.N
    result, originals, cast_handles = {}, {}, []

    def stop(module, args, output):
        raise _StopForward

    try:
        for prefix in sorted(by_layer, key=lambda name: int(name.rsplit(".", 1)[1])):
            accumulators = {paths[0]: HessianAccumulator(model.get_submodule(paths[0]).in_features)
                            for paths in by_layer[prefix]}
            handles = [model.get_submodule(prefix).register_forward_hook(stop)]
            handles += [model.get_submodule(path).register_forward_pre_hook(
                lambda module, args, into=accumulator, tensors=layers[path]: into.add(
                    cast_input(args[0].detach(), tensors) if cast_inputs else args[0].detach()))
                for path, accumulator in accumulators.items()]
            try:
                with torch.no_grad():
                    for batch in batches:
                        try:
                            model(**batch)
                        except _StopForward:
                            pass
            finally:
                for handle in handles:
                    handle.remove()
            for paths in by_layer[prefix]:
                hessian = accumulators[paths[0]].matrix
                amax = max(float(source[f"{path}.weight"].float().abs().max()) for path in paths)
                for path in paths:
                    packed, scale, gparam = quantize_nvfp4_gptq(source[f"{path}.weight"], amax, hessian,
                                                                scale_search=scale_search, act_order=act_order)
                    result[path] = {**layers[path], "weight_packed": packed, "weight_scale": scale,
                                    "weight_global_scale": gparam}
                    weight = model.get_submodule(path).weight
                    originals.setdefault(path, weight.data)
                    weight.data = dequantize(result[path]).to(weight.dtype)
                    if cast_inputs:
                        cast_handles.append(model.get_submodule(path).register_forward_pre_hook(
                            lambda module, args, tensors=layers[path]: (cast_input(args[0], tensors),)))
    finally:
        for handle in cast_handles:
            handle.remove()
        for path, value in originals.items():
            model.get_submodule(path).weight.data = value
    return result


def calibration_inputs(model, batches: list[dict], paths: list[str], rows: int) -> dict[str, torch.Tensor]:
    """Each Linear's inputs on the bf16 model over the calibration windows (what the calibration sees), ``rows``
    token rows drawn at random (seed 0) from all of them, the same rows for every Linear."""
    seen: dict[str, list[torch.Tensor]] = {path: [] for path in paths}
    run_with_input_hooks(model, batches, paths,
                         lambda path, inputs: seen[path].append(inputs.reshape(-1, inputs.shape[-1])))
    total = sum(chunk.shape[0] for chunk in seen[paths[0]])
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(0))[:rows].sort().values
    return {path: torch.cat(chunks)[pick] for path, chunks in seen.items()}


def output_searched(model, model_dir: Path, steps: int, source: dict[str, torch.Tensor], layers: dict, rows: int,
                    weight_ratios: tuple[float, ...], rtn: dict, mse: dict) -> tuple[dict, dict, list]:
    """Per fused group, converters.serving.nvfp4_search.search_group on the calibration inputs: the export with
    the chosen weight scales and input global scales, the same with the job's input scales, and the choices."""
    groups = fused_groups(layers)
    inputs = calibration_inputs(model, job_batches(model_dir, steps)[0], [paths[0] for paths in groups.values()],
                                rows)
    both, weights_only, choices = {}, {}, []
    for paths in groups.values():
        weights = [source[f"{path}.weight"] for path in paths]
        amax = max(float(weight.float().abs().max()) for weight in weights)
        written_amax = float(input_amax(layers[paths[0]]))
        known = {(method, 1.0): [dequantize(done[path]) for path in paths] for method, done in (("rtn", rtn),
                                                                                              ("mse", mse))}
        choice = search_group(weights, inputs[paths[0]], amax, written_amax, methods=("mse",),
                              weight_ratios=weight_ratios, known=known)
        choices.append((paths, choice, amax, written_amax))
        for path, weight in zip(paths, weights, strict=True):
            packed, scale, gparam = quantize_nvfp4(weight, choice.weight_amax, scale_search=choice.method)
            tensors = {**layers[path], "weight_packed": packed, "weight_scale": scale, "weight_global_scale": gparam}
            weights_only[path] = tensors
            both[path] = {**tensors, "input_global_scale": global_scale(
                torch.tensor([choice.input_amax], dtype=weight.dtype))}
    return both, weights_only, choices


def print_choices(choices: list) -> None:
    """What the output-error search chose: methods, weight and input ratios, the error against RTN's."""
    methods = {method: sum(c.method == method for _, c, _, _ in choices) for method in ("rtn", "mse")}
    relative = sorted(c.relative_error for _, c, _, _ in choices)
    weight_ratios = sorted(round(c.weight_amax / amax, 3) for _, c, amax, _ in choices)
    input_ratios = sorted(round(c.input_amax / input_amax, 3) for _, c, _, input_amax in choices)
    print(f"output-error search over {len(choices)} groups: methods {methods}; W4A4 output error / RTN's: median "
          f"{statistics.median(relative):.3f}, range {relative[0]:.3f}-{relative[-1]:.3f}")
    for name, ratios in (("weight", weight_ratios), ("input", input_ratios)):
        counts = {ratio: ratios.count(ratio) for ratio in sorted(set(ratios))}
        print(f"  chosen {name} amax / RTN's: {counts}")
    for paths, choice, amax, input_amax in choices:
        print(f"  {'+'.join(paths)}: {choice.method}, weight amax x{choice.weight_amax / amax:.3f}, input amax "
              f"x{choice.input_amax / input_amax:.2f} ({choice.input_amax:.4g}), error/RTN {choice.relative_error:.3f}")


def eval_ids(model_dir: Path, tokens: int, extra_files: list[Path] = ()) -> torch.Tensor:
    """Windows of EVAL_WINDOW held-out tokens: the corpus' held-out part, then the paragraphs (blank-line separated)
    of ``extra_files`` (text no calibration reads, e.g. benchmarks/data/held_out_extra.txt)."""
    from transformers import AutoTokenizer

    from converters.quality.held_out import held_out_part

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = held_out_part() + [paragraph.strip() for path in extra_files
                               for paragraph in path.read_text().split("\n\n") if paragraph.strip()]
    stream = [i for text in texts for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    windows = min(tokens, len(stream)) // EVAL_WINDOW
    return torch.tensor(stream[: windows * EVAL_WINDOW]).view(windows, EVAL_WINDOW)


def held_out_windows(model_dir: Path, tokens: int, files: list[Path], prose_into: Path | None) -> torch.Tensor:
    """:func:`eval_ids` over the corpus' held-out part, ``files`` and, with ``prose_into``, the installed packages'
    descriptions (written there as package-prose.txt); prints how many windows."""
    extra = list(files)
    if prose_into is not None:
        prose = prose_into / "package-prose.txt"
        prose.write_text("\n\n".join(package_prose(Path(torch.__file__).parents[1])))
        extra.append(prose)
    ids = eval_ids(model_dir, tokens, extra)
    print(f"held-out: {ids.shape[0]} windows of {ids.shape[1]} tokens", flush=True)
    return ids


def write_calibration_rows(batches: list[dict], path: Path) -> Path:
    """The calibration windows' token rows as JSON, for a peer's export on the same tokens."""
    path.write_text(json.dumps({key: [row for batch in batches for row in batch[key].tolist()]
                                for key in ("input_ids", "attention_mask")}))
    return path


def package_prose(site_packages: Path) -> list[str]:
    """English paragraphs of the installed packages' descriptions (``*.dist-info/METADATA``): more held-out text
    than the corpus has, written by nobody here and read by no calibration. Code blocks, tables, links, lists,
    headings and paragraphs under 200 characters or under 90% letters and spaces are left out; repeats once."""
    import email
    import re

    kept: dict[str, None] = {}
    for metadata in sorted(site_packages.glob("*.dist-info/METADATA")):
        body = email.message_from_string(metadata.read_text(errors="ignore")).get_payload()
        if not isinstance(body, str):
            continue
        for paragraph in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", body, flags=re.S)):
            text = " ".join(paragraph.split())
            if (len(text) < 200 or "|" in text or "http" in text or text.count("`") > 2
                    or text.startswith(("#", "-", "*", ">", "..", ":"))):
                continue
            if sum(c.isalpha() or c == " " for c in text) / len(text) >= 0.9:
                kept[text] = None
    return list(kept)


def perplexity(model, ids: torch.Tensor, layers: dict[str, dict[str, torch.Tensor]] | None,
               replaced: dict[str, torch.Tensor] | None = None, *, cast_inputs: bool = True
               ) -> tuple[float, list[float]]:
    """The model's perplexity on ``ids``, and each window's summed negative log-likelihood, with ``layers``' weights
    read back and their inputs cast to NVFP4 (after the layer's pre_quant_scale, if any; ``cast_inputs`` False:
    kept in the model's dtype, as weight-only NVFP4 runs), and the parameters in ``replaced`` taken from the
    export."""
    originals, handles = {}, []
    for name, tensor in (replaced or {}).items():
        parameter = model.get_parameter(name)
        originals[name] = parameter.data
        parameter.data = tensor.to(parameter.dtype)
    for path, tensors in (layers or {}).items():
        weight = model.get_submodule(path).weight
        originals[f"{path}.weight"] = weight.data
        weight.data = dequantize(tensors).to(weight.dtype)

        def cast_input(module, args, amax=input_amax(tensors), pre_scale=tensors.get("pre_quant_scale")):
            x = args[0] if pre_scale is None else args[0] * pre_scale.to(args[0].dtype)
            flat = fake_quantize(x.reshape(-1, x.shape[-1]).float(), NVFP4_INPUT, tensor_amax=amax.reshape(()))
            return (flat.reshape(x.shape).to(x.dtype),)

        if cast_inputs:
            handles.append(model.get_submodule(path).register_forward_pre_hook(cast_input))
    try:
        windows = []
        with torch.no_grad():
            for row in ids:
                logits = model(input_ids=row[None]).logits[0, :-1].float()
                windows.append(float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")))
        return math.exp(sum(windows) / (ids.shape[0] * (ids.shape[1] - 1))), windows
    finally:
        for handle in handles:
            handle.remove()
        for name, value in originals.items():
            model.get_parameter(name).data = value


def loss_ratio_interval(ours: list[float], theirs: list[float], base: list[float], positions: int,
                        draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``loss(ours) / loss(theirs)`` over a paired bootstrap of the held-out
    windows (each draw resamples the windows, the same ones for all three rows; loss = perplexity / bf16's - 1):
    how far the ratio moves with the text it is scored on."""
    generator = torch.Generator().manual_seed(0)
    nll = torch.tensor([ours, theirs, base], dtype=torch.float64)
    picks = torch.randint(0, nll.shape[1], (draws, nll.shape[1]), generator=generator)
    means = nll[:, picks].mean(dim=2) / positions  # [3, draws] mean NLL per position
    losses = torch.exp(means[:2] - means[2]) - 1
    ratios = (losses[0] / losses[1]).sort().values
    return float(ratios[int(0.05 * draws)]), float(ratios[int(0.95 * draws) - 1])


def gptq_figures(source: dict[str, torch.Tensor], rtn: dict, gptq: dict) -> str:
    """How far GPTQ moved the codes: the fraction of codes that differ from the export's, and the weight SQNR of
    each (GPTQ trades weight error for output error, so its weight SQNR is lower)."""
    signal = noise_rtn = noise_gptq = changed = total = 0.0
    for path in gptq:
        weight = source[f"{path}.weight"].float()
        signal += float(weight.square().sum())
        noise_rtn += float((dequantize(rtn[path]) - weight).square().sum())
        noise_gptq += float((dequantize(gptq[path]) - weight).square().sum())
        codes = [torch.stack([t["weight_packed"] & 0xF, t["weight_packed"] >> 4]) for t in (rtn[path], gptq[path])]
        changed += float((codes[0] != codes[1]).sum())
        total += codes[0].numel()
    return (f"codes changed {changed / total:.1%}; weight SQNR {10 * math.log10(signal / noise_gptq):.2f} dB (the "
            f"export's {10 * math.log10(signal / noise_rtn):.2f} dB)")


def weight_figures(source: dict[str, torch.Tensor], rtn: dict, mse: dict) -> tuple[float, float, float]:
    """Weight SQNR (dB, all layers' errors summed) of RTN and MSE, and the fraction of block scales MSE changed."""
    signal = noise_rtn = noise_mse = changed = blocks_total = 0.0
    for path in rtn:
        weight = source[f"{path}.weight"]
        blocks = weight.unflatten(-1, (-1, GROUP))
        signal += float(weight.float().square().sum())
        noise_rtn += float(block_errors(blocks, rtn[path]["weight_scale"].float(), rtn[path]["weight_global_scale"])
                           .sum())
        noise_mse += float(block_errors(blocks, mse[path]["weight_scale"].float(), mse[path]["weight_global_scale"])
                           .sum())
        changed += float((rtn[path]["weight_scale"].view(torch.uint8) != mse[path]["weight_scale"].view(torch.uint8))
                         .sum())
        blocks_total += rtn[path]["weight_scale"].numel()
    return 10 * math.log10(signal / noise_rtn), 10 * math.log10(signal / noise_mse), changed / blocks_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32, help="calibration windows of 128 tokens (default 32)")
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens scored (default 1024)")
    parser.add_argument("--held-out-package-prose", action="store_true",
                        help="also score the installed packages' descriptions (package_prose), after the files")
    parser.add_argument("--held-out-file", type=Path, action="append", default=[],
                        help="more held-out text after the corpus' (paragraphs separated by blank lines), e.g. "
                             "benchmarks/data/held_out_extra.txt; repeatable")
    parser.add_argument("--skip-peer", action="store_true", help="fp8forge's rows only")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--peer-export", type=Path, help="an llm-compressor NVFP4 export made on the same tokens")
    parser.add_argument("--keep", type=Path, help="write the exports here and keep them")
    parser.add_argument("--four-over-six", action="store_true", help="also score scale_search four_over_six")
    parser.add_argument("--no-swaps", action="store_true", help="leave out the input-scale swap rows")
    parser.add_argument("--search-rows", type=int, default=512,
                        help="calibration token rows the output-error search scores (default 512; 0: no search)")
    parser.add_argument("--weight-ratios", default="1.0,0.94,1.06",
                        help="weight amax multipliers the search tries for the global scale (comma separated)")
    parser.add_argument("--modelopt", default=",".join(MODELOPT_CPU_RECIPES),
                        help=f"ModelOpt recipes, comma separated, or none ({', '.join(MODELOPT_RECIPES)})")
    parser.add_argument("--modelopt-venv", type=Path, default=DEFAULT_MODELOPT_VENV)
    parser.add_argument("--gptq", default="",
                        help="GPTQ-rounded rows, comma separated: the scale_search whose block scales are fixed "
                             "(rtn, mse, four_over_six), '+act' for decreasing-H[j, j] column order, '+seq' for "
                             "Hessians layer by layer from the earlier layers' GPTQ weights, '+qx' for Hessians of "
                             "the inputs cast to NVFP4 (with +seq: the earlier layers' inputs cast too)")
    parser.add_argument("--activations", choices=("w4a4", "a16", "both"), default="w4a4",
                        help="score with NVFP4 inputs (w4a4), bf16 inputs (a16: nvfp4-a16), or both")
    parser.add_argument("--skip-mse", action="store_true", help="leave out the mse row (its requantization)")
    parser.add_argument("--job-gptq", default="",
                        help="comma-separated block-scale methods (rtn, mse, four_over_six): score a job's own export "
                             "with nvfp4_weight_scales METHOD and nvfp4_weight_rounding gptq (the product path)")
    parser.add_argument("--gptq-only", action="store_true",
                        help="score only bf16 and the --gptq rows, no calibration diagnosis (the scoring is "
                             "deterministic: the other rows of an earlier run on the same windows stand)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tests.converters.quality.smollm import smollm_dir

    model_dir = smollm_dir()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_nvfp4-"))
    work.mkdir(parents=True, exist_ok=True)
    batches, data_source = job_batches(model_dir, args.steps)
    rows_file = write_calibration_rows(batches, work / "calibration_rows.json")
    print(f"SmolLM2-135M-Instruct ({model_dir}); calibration: {data_source}; {args.tokens} held-out tokens scored")

    started = time.perf_counter()
    kept = work / "fp8forge" / "serving" / "nvfp4"
    if (kept / "config.json").is_file():  # a --keep directory of an earlier run: its export is reused
        ours = read_export(kept)
        print(f"fp8forge export: reused {kept}, {len(ours)} Linears in NVFP4")
    else:
        ours = read_export(fp8forge_export(model_dir, work / "fp8forge", args.steps))
        print(f"fp8forge export: {time.perf_counter() - started:.0f} s, {len(ours)} Linears in NVFP4")
    with safe_open(model_dir / "model.safetensors", "pt") as handle:
        source = {key: handle.get_tensor(key) for key in handle.keys()}
    started = time.perf_counter()
    rtn = requantized(source, ours, "rtn")
    mse = rtn if args.skip_mse else requantized(source, ours, "mse")
    search_seconds = time.perf_counter() - started
    identical = all(torch.equal(rtn[p]["weight_packed"], ours[p]["weight_packed"]) and
                    torch.equal(rtn[p]["weight_scale"].view(torch.uint8), ours[p]["weight_scale"].view(torch.uint8))
                    and torch.equal(rtn[p]["weight_global_scale"], ours[p]["weight_global_scale"]) for p in ours)
    sqnr_rtn, sqnr_mse, changed = weight_figures(source, rtn, mse)
    print(f"RTN requantized here equals the job's file byte for byte: {identical}; RTN + MSE requantization "
          f"{search_seconds:.0f} s (2 cores, shared)")
    if not args.skip_mse:
        print(f"weight SQNR: RTN {sqnr_rtn:.2f} dB, MSE {sqnr_mse:.2f} dB ({sqnr_mse - sqnr_rtn:+.2f} dB); "
              f"block scales the search changed: {changed:.1%}")

    peer = None
    if args.peer_export is not None:
        if not (args.peer_export / "config.json").is_file():
            raise SystemExit(f"--peer-export {args.peer_export} holds no config.json: give a finished export")
        peer = read_export(args.peer_export)
    elif not args.skip_peer:
        started = time.perf_counter()
        peer = read_export(peer_export(model_dir, rows_file, work / "llm-compressor", args.peer_venv))
        print(f"llm-compressor export: {time.perf_counter() - started:.0f} s, {len(peer)} Linears in NVFP4")

    variants: dict[str, dict | None] = {"bf16": None, "fp8forge rtn": ours}
    if not args.skip_mse:
        variants["fp8forge mse"] = mse
    if args.four_over_six:
        started = time.perf_counter()
        variants["fp8forge four_over_six"] = requantized(source, ours, "four_over_six")
        print(f"four_over_six requantization {time.perf_counter() - started:.0f} s")
    if peer is not None:
        shared = sorted(set(ours) & set(peer))
        ratios = sorted((float(ours[p]["input_global_scale"] / peer[p]["input_global_scale"]), p) for p in shared)
        same_weights = sum(torch.equal(ours[p]["weight_packed"], peer[p]["weight_packed"]) for p in shared)
        print(f"input_global_scale fp8forge / llm-compressor over {len(shared)} shared Linears: median "
              f"{statistics.median(r for r, _ in ratios):.3f}, min {ratios[0][0]:.3f} ({ratios[0][1]}), max "
              f"{ratios[-1][0]:.3f} ({ratios[-1][1]}); packed weights identical in {same_weights}")
        variants["llm-compressor rtn"] = peer
    replacements = {}  # variant -> the export's parameters that differ from the source's (AWQ's folded norms)
    for recipe in [] if args.modelopt == "none" else args.modelopt.split(","):
        started = time.perf_counter()
        try:
            directory = modelopt_export(model_dir, rows_file, work / "modelopt" / recipe.replace(" ", "-"),
                                        args.modelopt_venv, recipe)
            layers, replaced = read_modelopt_export(directory, source)
        except (RuntimeError, ValueError) as error:
            print(f"ModelOpt {recipe} ({MODELOPT_RECIPES[recipe]}): not scored: {str(error).strip()[-1500:]}")
            continue
        print(f"ModelOpt {recipe} ({MODELOPT_RECIPES[recipe]}): {time.perf_counter() - started:.0f} s; "
              f"{modelopt_differences(layers, replaced, ours)}", flush=True)
        variants[f"modelopt {recipe}"], replacements[f"modelopt {recipe}"] = layers, replaced
    if peer is not None and not args.no_swaps:
        variants["fp8forge rtn, peer's input scales"] = {
            p: {**t, "input_global_scale": peer[p]["input_global_scale"]} if p in peer else t for p, t in ours.items()}
        variants["fp8forge mse, peer's input scales"] = {
            p: {**t, "input_global_scale": peer[p]["input_global_scale"]} if p in peer else t for p, t in mse.items()}

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if not args.gptq_only:
        print_calibration_diagnosis(model, model_dir, args.steps, ours)
    if args.search_rows:
        started = time.perf_counter()
        ratios = tuple(float(ratio) for ratio in args.weight_ratios.split(","))
        both, weights_only, choices = output_searched(model, model_dir, args.steps, source, ours, args.search_rows,
                                                      ratios, rtn, mse)
        print(f"output-error search: {time.perf_counter() - started:.0f} s (2 cores, shared)")
        print_choices(choices)
        variants["fp8forge searched weights (output error)"] = weights_only
        variants["fp8forge searched weights + input scales"] = both
    if args.gptq:
        started = time.perf_counter()
        hessians = {cast: group_hessians(model, job_batches(model_dir, args.steps)[0], ours, cast_inputs=cast)
                    for cast in dict.fromkeys("qx" in spec.split("+") for spec in args.gptq.split(",")
                                              if not {"seq", "aq"} & set(spec.split("+")))}
        print(f"Hessians of {len(fused_groups(ours))} fused groups: {time.perf_counter() - started:.0f} s")
        # GPTQ's column loop is thousands of small operations a Linear: one intra-op thread runs them 2-20x faster
        # than two on a shared 2-core machine (measured), so they run on one
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for spec in args.gptq.split(","):
                method, *options = spec.split("+")
                started = time.perf_counter()
                if "aq" in options:
                    gptq = asymmetric_gptq(model, job_batches(model_dir, args.steps)[0], source, ours, method,
                                           "act" in options)
                elif "seq" in options:
                    gptq = sequential_gptq(model, job_batches(model_dir, args.steps)[0], source, ours, method,
                                           "act" in options, cast_inputs="qx" in options)
                else:
                    gptq = gptq_requantized(source, ours, hessians["qx" in options], method, "act" in options)
                print(f"gptq {spec}: {time.perf_counter() - started:.0f} s; {gptq_figures(source, ours, gptq)}",
                      flush=True)
                variants[f"fp8forge gptq {spec}"] = gptq
        finally:
            torch.set_num_threads(threads)
        del hessians
    for method in filter(None, args.job_gptq.split(",")):
        started = time.perf_counter()
        job_dir = work / f"fp8forge-gptq-{method}"
        kept = job_dir / "serving" / "nvfp4"
        layouts = ("nvfp4", "modelopt-nvfp4") if args.modelopt != "none" else ("nvfp4",)
        if not all((job_dir / "serving" / name / "config.json").is_file() for name in layouts):
            shutil.rmtree(job_dir, ignore_errors=True)
            fp8forge_export(model_dir, job_dir, args.steps, layouts, nvfp4_weight_scales=method,
                            nvfp4_weight_rounding="gptq")
        variants[JOB_GPTQ_ROW + method] = read_export(kept)
        if "modelopt-nvfp4" in layouts:  # the same job's ModelOpt layout, beside ModelOpt's own rows
            variants[f"{JOB_GPTQ_ROW}{method}, modelopt layout"] = read_modelopt_export(
                job_dir / "serving" / "modelopt-nvfp4", source)[0]
        rounding = json.loads((job_dir / "fp8_report.json").read_text())["calibration"]["nvfp4_rounding"]
        print(f"job with nvfp4_weight_rounding gptq, {method} scales: {time.perf_counter() - started:.0f} s "
              f"(rounding {rounding['seconds']:.0f} s, {sum(rounding['weights'].values())} weights); "
              f"{gptq_figures(source, ours, variants[JOB_GPTQ_ROW + method])}", flush=True)
    if args.gptq_only:
        variants = {name: layers for name, layers in variants.items() if name == "bf16" or " gptq " in name}
    ids = held_out_windows(model_dir, args.tokens, args.held_out_file, work if args.held_out_package_prose else None)
    modes = {"w4a4": [True], "a16": [False], "both": [True, False]}[args.activations]
    scores, windows, scored = {}, {}, {}
    for cast_inputs in modes:
        for name, layers in variants.items():
            row = name if cast_inputs or name == "bf16" else f"{name} [a16]"
            if row in scores or (not cast_inputs and name.startswith("modelopt ")):
                continue  # bf16 once; ModelOpt's AWQ rows scale inputs, not weight-only
            started = time.perf_counter()
            scores[row], windows[row] = perplexity(model, ids, layers, replacements.get(name), cast_inputs=cast_inputs)
            scored[row] = layers
            # each row as it is scored (a --keep run that stops later keeps what it measured)
            (work / "scores.json").write_text(json.dumps({"perplexity": scores, "window_nll": windows}))
            print(f"  scored {row} in {time.perf_counter() - started:.0f} s", flush=True)
    base = scores["bf16"]
    # each row against llm-compressor RTN scored the same way (W4A4 or [a16]); without the peer, fp8forge RTN
    # (byte-identical weights to llm-compressor RTN's where both were measured)
    denominator = "llm-compressor rtn" if "llm-compressor rtn" in scores else "fp8forge rtn"
    print(f"\n| export | Linears | perplexity | loss vs bf16 | loss / {denominator}'s | its 5-95% over the "
          "windows |\n|---|---|---|---|---|---|")
    for name, value in scores.items():
        loss = value / base - 1
        reference = denominator + (" [a16]" if name.endswith(" [a16]") else "")
        versus = f"{loss / (scores[reference] / base - 1):.2f}x" if reference in scores and name != "bf16" else ""
        spread = ""
        if reference in scores and name not in ("bf16", reference):
            low, high = loss_ratio_interval(windows[name], windows[reference], windows["bf16"], ids.shape[1] - 1)
            spread = f"{low:.2f}-{high:.2f}x"
        count = len(scored[name]) if scored[name] else 0
        print(f"| {name} | {count} | {value:.3f} | {loss:+.2%} | {versus} | {spread} |")
    ours_best = min((name for name in scores if name in RECIPE_ROWS or name.startswith(JOB_GPTQ_ROW)),
                    key=scores.get, default=None)
    theirs = [name for name in scores if name.startswith("modelopt ")]
    if theirs and ours_best:
        best = min(theirs, key=scores.get)
        ratio = (scores[ours_best] / base - 1) / (scores[best] / base - 1)
        print(f"\nfp8forge's best recipe row ({ours_best}) loses {ratio:.2f}x the perplexity ModelOpt's best that ran "
              f"({best}) loses")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
