"""GPTQ on MoE expert matrices: each expert GEMM's output error on held-out tokens, GPTQ against round to nearest.

Builds the suite's tiny Qwen2-MoE and Mixtral (random weights, the demo tokenizer), runs the same job twice
(``nvfp4`` + ``nvfp4-a16``, ``four_over_six`` block scales) with ``nvfp4_weight_rounding`` ``nearest`` and
``gptq``, then runs the source model on the built-in held-out text and, for every expert, compares its two GEMMs
on the tokens routed to it: ``sum |x Q^T - x W^T|^2 / sum |x W^T|^2`` with ``Q`` the export's dequantized matrices
(``down_proj``'s inputs: the gated activations of the source's ``gate_up_proj``). Prints the ratio GPTQ / nearest
per model and export, and the report's model-level KL of each job beside it.

    python benchmarks/bench_moe_gptq.py [--steps 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from converters.calibration.experts import routing  # noqa: E402
from converters.model.sources import ModelSourceOptions  # noqa: E402
from converters.pipeline.driver import run_conversion  # noqa: E402
from converters.pipeline.request import CalibrationSettings, ConversionRequest  # noqa: E402
from converters.quality.held_out import held_out_part  # noqa: E402
from converters.serving.nvfp4_codes import dequantize_stepped, unpack_codes  # noqa: E402
from tests.models import save_tiny_moe  # noqa: E402

EXPORTS = ("nvfp4", "nvfp4-a16")
#: on-disk names of an expert's gate, up and down matrices (Qwen, Mixtral)
NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def dequantized(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    step = tensors[f"{key}.weight_scale"].float() / tensors[f"{key}.weight_global_scale"].float()
    return dequantize_stepped(unpack_codes(tensors[f"{key}.weight_packed"]), step)


def routed_inputs(model_dir: Path, tokens: int) -> tuple[torch.nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The source model and, per experts module, the hidden states and routing it received on held-out text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = "\n\n".join(held_out_part())
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids[:, :tokens]
    calls, handles = {}, []
    for path, module in model.named_modules():
        if getattr(module, "gate_up_proj", None) is not None and module.gate_up_proj.dim() == 3:
            def hook(_, args, kwargs, path=path):
                hidden, index, _ = routing(args, kwargs)
                hidden = hidden.reshape(-1, hidden.shape[-1])
                calls[path] = (hidden, index.reshape(hidden.shape[0], -1))
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return model, calls


def expert_error(model, calls, disk_prefix, exported: dict[str, torch.Tensor]) -> float:
    """Relative squared output error of every routed expert GEMM under the exported matrices."""
    error = reference = 0.0
    for path, (hidden, index) in calls.items():
        experts = model.get_submodule(path)
        prefix = disk_prefix(path)
        for expert in range(experts.gate_up_proj.shape[0]):
            x = hidden[(index == expert).any(dim=-1)]
            if not len(x):
                continue
            keys = {role: next(f"{prefix}.{expert}.{name}" for name in names
                               if f"{prefix}.{expert}.{name}.weight_packed" in exported)
                    for role, names in NAMES.items()}
            with torch.no_grad():
                gate_up = torch.nn.functional.linear(x, experts.gate_up_proj[expert])
                activated = experts._apply_gate(gate_up)
                down = torch.nn.functional.linear(activated, experts.down_proj[expert])
                rounded_gate_up = torch.cat([dequantized(exported, keys["gate"]), dequantized(exported, keys["up"])])
                error += float((torch.nn.functional.linear(x, rounded_gate_up) - gate_up).pow(2).sum())
                error += float((torch.nn.functional.linear(activated, dequantized(exported, keys["down"]))
                                - down).pow(2).sum())
                reference += float(gate_up.pow(2).sum() + down.pow(2).sum())
    return error / reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="calibration steps (batch 2 x 64 tokens)")
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens to measure on")
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-moe-gptq-"))
    for name, prefix_of in (("qwen2_moe", lambda path: path),
                            ("mixtral", lambda path: path.replace(".mlp.", ".block_sparse_moe."))):
        save_tiny_moe(name, root / name)
        results = {}
        for rounding in ("nearest", "gptq"):
            out = root / f"{name}-{rounding}"
            run_conversion(ConversionRequest(
                model=str(root / name), serving_formats=EXPORTS,
                recipe={"backend": "ao", "nvfp4_weight_scales": "four_over_six", "nvfp4_weight_rounding": rounding},
                calibration=CalibrationSettings(steps=args.steps, batch_size=2, seq_len=64)),
                out, ModelSourceOptions(allowed_roots=(root,)))
            results[rounding] = json.loads((out / "fp8_report.json").read_text())["quality"]["serving"]
        model, calls = routed_inputs(root / name, args.tokens)
        for export in EXPORTS:
            errors = {rounding: expert_error(model, calls, prefix_of, load_file(
                root / f"{name}-{rounding}" / "serving" / export / "model.safetensors")) for rounding in results}
            kl = {rounding: results[rounding][export]["kl_mean"] for rounding in results}
            print(f"{name} {export}: expert GEMM error nearest {errors['nearest']:.5f}, gptq {errors['gptq']:.5f}, "
                  f"ratio {errors['gptq'] / errors['nearest']:.3f}; report KL nearest {kl['nearest']:.3e}, "
                  f"gptq {kl['gptq']:.3e}")


if __name__ == "__main__":
    main()
