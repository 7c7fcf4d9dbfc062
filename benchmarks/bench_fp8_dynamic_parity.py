"""compressed-tensors FP8_DYNAMIC on the real SmolLM2-135M: fp8forge's export against llm-compressor's, tensor by
tensor, and what the one difference between them (which Linears are quantized) does to perplexity.

Needs an llm-compressor FP8_DYNAMIC export of the same model (``--peer-export``), made in the peer venv
(bench_serving's) by ``oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
ignore=["lm_head"]))`` and ``save_pretrained(save_compressed=True)``; no calibration data (the scheme has none).
Prints, for every Linear the peer quantized, whether fp8forge's ``compressed-tensors-fp8-dynamic`` quantize of the
source weight (converters.serving.compressed_tensors.DYNAMIC) equals the peer's FP8 weight and per-channel scale
byte for byte; the config fields that differ; and perplexity over ``--tokens`` held-out tokens (windows of 256) of
the bf16 model with W8A8-dynamic emulated (weights read back from the files, inputs cast per token to E4M3 with
amax/448 as vLLM's dynamic per-token quant does) on (a) every Linear the peer quantizes and (b) fp8forge's default
set (skip_first_last: layer 0's q/k/v stay bf16 with the first Linear of the model). Figures only.

Run:  .venv/bin/python benchmarks/bench_fp8_dynamic_parity.py --peer-export DIR [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from bench_nvfp4 import eval_ids  # noqa: E402
from safetensors import safe_open  # noqa: E402

from converters.casts.emulation import cast_spec, fake_quantize  # noqa: E402
from converters.serving.compressed_tensors import DYNAMIC  # noqa: E402

PER_TOKEN = cast_spec("e4m3_row")
FIRST_FUSED_GROUP = {f"model.layers.0.self_attn.{name}_proj" for name in "qkv"}  # fp8forge's skip_first_last


def read_fp8(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                path, _, name = key.rpartition(".")
                if name in ("weight", "weight_scale"):
                    layers.setdefault(path, {})[name] = handle.get_tensor(key)
    return {path: (t["weight"], t["weight_scale"]) for path, t in layers.items()
            if "weight_scale" in t and t["weight"].dtype == torch.float8_e4m3fn}


def perplexity(model, ids: torch.Tensor, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    import math

    originals, handles = {}, []
    for path, (weight, scale) in layers.items():
        module = model.get_submodule(path)
        originals[path] = module.weight.data
        module.weight.data = (weight.float() * scale.float()).to(module.weight.dtype)

        def cast_input(module, args):
            x = args[0]
            return (fake_quantize(x.reshape(-1, x.shape[-1]).float(), PER_TOKEN).reshape(x.shape).to(x.dtype),)

        handles.append(module.register_forward_pre_hook(cast_input))
    try:
        total, count = 0.0, 0
        with torch.no_grad():
            for row in ids:
                logits = model(input_ids=row[None]).logits[0, :-1].float()
                total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
                count += row.numel() - 1
        return math.exp(total / count)
    finally:
        for handle in handles:
            handle.remove()
        for path, weight in originals.items():
            model.get_submodule(path).weight.data = weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-export", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tests.converters.quality.smollm import smollm_dir

    model_dir = smollm_dir()
    peer = read_fp8(args.peer_export)
    with safe_open(model_dir / "model.safetensors", "pt") as handle:
        source = {key: handle.get_tensor(key) for key in handle.keys()}
    ours, equal_weight, equal_scale = {}, 0, 0
    for path in peer:
        weight, scale = DYNAMIC.quantize(source[f"{path}.weight"], None, torch.bfloat16)
        ours[path] = (weight, scale)
        equal_weight += torch.equal(weight.view(torch.uint8), peer[path][0].view(torch.uint8))
        equal_scale += torch.equal(scale, peer[path][1].to(scale.dtype)) and scale.dtype == peer[path][1].dtype
    print(f"{len(peer)} Linears in the peer's export; fp8forge's quantize of the same weight equal byte for byte: "
          f"weights {equal_weight}, per-channel scales {equal_scale} (scale dtype fp8forge "
          f"{next(iter(ours.values()))[1].dtype}, peer {next(iter(peer.values()))[1].dtype})")
    peer_config = json.loads((args.peer_export / "config.json").read_text())["quantization_config"]
    plan_like = type("Plan", (), {"linear_paths": (), "quantized": {}, "unquantized_experts": {},
                                  "router_gates": (), "kv_cache": None})()
    our_config = DYNAMIC.quantization_config(plan_like)
    group_ours, group_peer = our_config["config_groups"]["group_0"], peer_config["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        differing = {key: (group_ours[part].get(key), group_peer[part].get(key)) for key in group_peer[part]
                     if group_ours[part].get(key) != group_peer[part].get(key)}
        print(f"config {part}: fields that differ (fp8forge, peer): {differing or 'none'}")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = eval_ids(model_dir, args.tokens)
    base = perplexity(model, ids, {})
    rows = {"bf16": base,
            "every Linear but lm_head (llm-compressor's set)": perplexity(model, ids, peer),
            "fp8forge's default set (layer 0 q/k/v in bf16)": perplexity(
                model, ids, {p: t for p, t in ours.items() if p not in FIRST_FUSED_GROUP})}
    print(f"\n| W8A8 dynamic, {ids.numel()} held-out tokens | perplexity | vs bf16 |\n|---|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value:.3f} | {value / base - 1:+.2%} |")


if __name__ == "__main__":
    main()
