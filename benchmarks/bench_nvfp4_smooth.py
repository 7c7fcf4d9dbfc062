"""NVFP4 W4A4 on the real SmolLM2-135M with activation-aware per-channel smoothing (AWQ's scale search) before
the job: does moving each input channel's magnitude between the activation and the weight lower the loss that
round to nearest and GPTQ leave?

What runs:
  smoothing  on the bf16 model over the job's calibration windows, per mapping of one decoder layer (input norm ->
             q/k/v, post-attention norm -> gate/up, up -> down; v -> o only where the shapes match, not in a GQA
             model such as this one): the inputs X of the mapping's Linears and their weights W (one fused group,
             concatenated), ``x_mean`` and ``w_mean`` the mean |X| and the mean |W / its row's max| per input channel;
             for each ratio r of ``--grid`` steps in [0, 1) the scales ``s = x_mean^r / w_mean^(1-r)`` (divided by
             sqrt(max * min)), and the W4A4 output error ``|Q(X / s) Q(W s)^T - X W^T|^2`` with the engine's casts
             (inputs: per-16 E4M3 block scales under the group's calibrated amax; weights: round to nearest under the
             group's global scale); the ratio with the least error, or none (s = 1) where none beats it. The scales
             fold into the model: the norm's weight (or up's rows) divided by s, the Linears' columns times s, so
             the bf16 model computes the same function (to bf16 rounding).
  jobs       the smoothed model, saved as a checkpoint, goes through the same conversion jobs as the source:
             round to nearest, and ``nvfp4_weight_scales: four_over_six`` + ``nvfp4_weight_rounding: gptq`` (the
             product's best W4A4 path); each job calibrates its input global scales on the smoothed model.
Scoring: bench_nvfp4.perplexity on the source model with each export's Linears read back and their inputs cast as
the W4A4 kernels cast them; a smoothed export's changed norms replace the source's (as an engine would load them).
``--peer``: llm-compressor 0.14's NVFP4 RTN export (bench_nvfp4.peer_export, its own venv) on the same token rows,
and every row against it; otherwise against the source's own RTN export (byte-identical weights to llm-compressor
RTN's, bench_nvfp4). With bench_nvfp4's 5-95% interval over the held-out windows. Figures only, nothing asserted.

Run:  .venv/bin/python benchmarks/bench_nvfp4_smooth.py [--steps 24] [--tokens 4096] [--grid 20]
      [--held-out-file benchmarks/data/held_out_extra.txt] [--held-out-package-prose] [--peer] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from bench_nvfp4 import (  # noqa: E402
    NVFP4_INPUT,
    dequantize,
    eval_ids,
    fp8forge_export,
    job_batches,
    loss_ratio_interval,
    package_prose,
    peer_export,
    perplexity,
    read_export,
    run_with_input_hooks,
)
from bench_serving import DEFAULT_PEER_VENV  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from converters.casts.emulation import fake_quantize  # noqa: E402
from converters.serving.nvfp4 import quantize_nvfp4  # noqa: E402

#: (what feeds the Linears, the Linears) of a Llama decoder layer, as AWQ maps them
MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",)),
            ("self_attn.v_proj", ("self_attn.o_proj",)))
ROWS = 2048  #: calibration token rows each mapping's error is measured on (drawn at random, seed 0)


def w4a4_output_error(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, reference: torch.Tensor) -> float:
    """``|Q(X / s) Q(W s)^T - X W^T|^2`` with NVFP4's casts: the weight by round to nearest under its own amax
    (one fused group's global scale), the input per 16-block under the amax of ``X / s``."""
    scaled_x = x / scales
    cast_x = fake_quantize(scaled_x, NVFP4_INPUT, tensor_amax=scaled_x.abs().max())
    scaled_w = (weight * scales).to(torch.bfloat16)
    packed, block, gparam = quantize_nvfp4(scaled_w, float(scaled_w.float().abs().max()))
    read = dequantize({"weight_packed": packed, "weight_scale": block, "weight_global_scale": gparam})
    return float((cast_x @ read.T - reference).pow(2).mean())


def search_scales(x: torch.Tensor, weight: torch.Tensor, grid: int) -> tuple[torch.Tensor | None, float, float, float]:
    """AWQ's ratio search for one mapping: the scales with the least W4A4 output error, or None where none beats
    no scaling; returns (scales, ratio, error without, error with)."""
    reference = x @ weight.T
    x_mean = x.abs().mean(0)
    w_mean = (weight.abs() / weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)).mean(0)
    plain = w4a4_output_error(x, weight, torch.ones_like(x_mean), reference)
    best = (None, math.nan, plain)
    for step in range(grid):
        ratio = step / grid
        scales = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = w4a4_output_error(x, weight, scales, reference)
        if error < best[2]:
            best = (scales, ratio, error)
    return best[0], best[1], plain, best[2]


def smooth(model, batches: list[dict], grid: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The smoothed model's changed tensors (fp32 math, stored in the model's dtype) and one line per mapping."""
    layers = model.model.layers
    firsts = {f"model.layers.{i}.{linears[0]}": (i, feeder, linears)
              for i in range(len(layers)) for feeder, linears in MAPPINGS}
    inputs: dict[str, list[torch.Tensor]] = {path: [] for path in firsts}
    run_with_input_hooks(model, batches, list(firsts),
                         lambda path, x: inputs[path].append(x.reshape(-1, x.shape[-1]).float()))
    changed, lines = {}, []
    pick = None
    for path, (index, feeder, linears) in firsts.items():
        x = torch.cat(inputs.pop(path))
        if pick is None:
            pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:ROWS]
        prefix = f"model.layers.{index}"
        feeder_module = model.get_submodule(f"{prefix}.{feeder}")
        weights = [model.get_submodule(f"{prefix}.{name}").weight.float() for name in linears]
        feeder_out = feeder_module.weight.shape[0]
        if feeder_out != x.shape[1]:  # v -> o in a GQA model: v's rows are fewer than o's columns
            lines.append(f"{prefix}.{feeder} -> {','.join(linears)}: skipped ({feeder_out} rows feed {x.shape[1]})")
            continue
        scales, ratio, plain, error = search_scales(x[pick], torch.cat(weights), grid)
        if scales is None:
            lines.append(f"{prefix}.{feeder} -> {','.join(linears)}: kept (no ratio beats s = 1, error {plain:.3e})")
            continue
        lines.append(f"{prefix}.{feeder} -> {','.join(linears)}: ratio {ratio:.2f}, error {plain:.3e} -> "
                     f"{error:.3e} ({error / plain:.2f}x), s in {float(scales.min()):.3f}-{float(scales.max()):.3f}")
        dtype = feeder_module.weight.dtype
        folded = feeder_module.weight.float() / (scales if feeder_module.weight.dim() == 1 else scales[:, None])
        changed[f"{prefix}.{feeder}.weight"] = folded.to(dtype)
        feeder_module.weight.data = changed[f"{prefix}.{feeder}.weight"]
        for name, weight in zip(linears, weights, strict=True):
            changed[f"{prefix}.{name}.weight"] = (weight * scales).to(dtype)
            model.get_submodule(f"{prefix}.{name}").weight.data = changed[f"{prefix}.{name}.weight"]
    return changed, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="calibration windows of 128 tokens (default 24)")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored (default 4096)")
    parser.add_argument("--grid", type=int, default=20, help="ratios tried per mapping (default 20)")
    parser.add_argument("--held-out-file", type=Path, action="append", default=[],
                        help="more held-out text (paragraphs separated by blank lines); repeatable")
    parser.add_argument("--held-out-package-prose", action="store_true",
                        help="also score the installed packages' descriptions (bench_nvfp4.package_prose)")
    parser.add_argument("--peer", action="store_true",
                        help="also llm-compressor's NVFP4 RTN export on the same token rows (its own venv)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--keep", type=Path, help="write the exports here and keep them (reused when present)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tests.converters.quality.smollm import smollm_dir

    model_dir = smollm_dir()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_nvfp4_smooth-"))
    work.mkdir(parents=True, exist_ok=True)
    batches, data_source = job_batches(model_dir, args.steps)
    print(f"SmolLM2-135M-Instruct ({model_dir}); calibration: {data_source}")

    smoothed_dir = work / "smoothed-model"
    if not (smoothed_dir / "model.safetensors").is_file():
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            changed, lines = smooth(model, batches, args.grid)
        print(f"smoothing search: {time.perf_counter() - started:.0f} s; {len(changed)} tensors changed")
        print("\n".join(lines))
        tensors = {**load_file(model_dir / "model.safetensors"), **changed}
        shutil.copytree(model_dir, smoothed_dir, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(tensors, smoothed_dir / "model.safetensors", metadata={"format": "pt"})
        (work / "smoothing.txt").write_text("\n".join(lines) + "\n")
    source = load_file(model_dir / "model.safetensors")
    norms = {name: tensor for name, tensor in load_file(smoothed_dir / "model.safetensors").items()
             if name.endswith("norm.weight") and not torch.equal(tensor, source[name])}

    jobs = {"rtn": {}, "gptq four_over_six": {"nvfp4_weight_scales": "four_over_six",
                                              "nvfp4_weight_rounding": "gptq"}}
    variants: dict[str, tuple[dict | None, dict | None]] = {"bf16": (None, None)}
    for smoothed, base in ((False, model_dir), (True, smoothed_dir)):
        for name, recipe in jobs.items():
            out = work / f"{'smoothed' if smoothed else 'source'}-{name.replace(' ', '-')}"
            if not (out / "serving" / "nvfp4" / "config.json").is_file():
                started = time.perf_counter()
                shutil.rmtree(out, ignore_errors=True)
                fp8forge_export(base, out, args.steps, **recipe)
                print(f"job {'smoothed' if smoothed else 'source'} {name}: {time.perf_counter() - started:.0f} s",
                      flush=True)
            variants[f"{'smoothed + ' if smoothed else ''}{name}"] = (read_export(out / "serving" / "nvfp4"),
                                                                       norms if smoothed else None)

    if args.peer:
        peer_dir = work / "llm-compressor"
        if not (peer_dir / "config.json").is_file():
            started = time.perf_counter()
            rows_file = work / "calibration_rows.json"
            rows_file.write_text(json.dumps({key: [row for batch in batches for row in batch[key].tolist()]
                                             for key in ("input_ids", "attention_mask")}))
            peer_export(model_dir, rows_file, peer_dir, args.peer_venv)
            print(f"llm-compressor NVFP4 RTN export: {time.perf_counter() - started:.0f} s", flush=True)
        variants["llm-compressor rtn"] = (read_export(peer_dir), None)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    extra = list(args.held_out_file)
    if args.held_out_package_prose:
        prose = work / "package-prose.txt"
        prose.write_text("\n\n".join(package_prose(Path(torch.__file__).parents[1])))
        extra.append(prose)
    ids = eval_ids(model_dir, args.tokens, extra)
    print(f"held-out: {ids.shape[0]} windows of {ids.shape[1]} tokens", flush=True)
    scores, windows = {}, {}
    for name, (layers, replaced) in variants.items():
        started = time.perf_counter()
        scores[name], windows[name] = perplexity(model, ids, layers, replaced)
        print(f"  scored {name} in {time.perf_counter() - started:.0f} s", flush=True)
    (work / "scores.json").write_text(json.dumps({"perplexity": scores, "window_nll": windows}))
    base = scores["bf16"]
    reference = "llm-compressor rtn" if "llm-compressor rtn" in scores else "rtn"
    rtn_loss = scores[reference] / base - 1
    print(f"\n| export (W4A4) | perplexity | loss vs bf16 | loss / {reference}'s | 5-95% over the windows |\n"
          "|---|---:|---:|---:|---:|")
    for name, value in scores.items():
        loss = value / base - 1
        versus = spread = ""
        if name != "bf16":
            versus = f"{loss / rtn_loss:.2f}x"
            if name != reference:
                low, high = loss_ratio_interval(windows[name], windows[reference], windows["bf16"],
                                                ids.shape[1] - 1)
                spread = f"{low:.2f}-{high:.2f}x"
        print(f"| {name} | {value:.3f} | {loss:+.2%} | {versus} | {spread} |")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
