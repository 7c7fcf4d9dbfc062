"""A DeepSeek-V3-shaped checkpoint in DeepSeek's own FP8 layout, built from a config for tests.

The layout is that of ``deepseek-ai/DeepSeek-V3`` scaled down: MLA attention (``q_a_proj``/``q_b_proj``,
``kv_a_proj_with_mqa``/``kv_b_proj``), one dense MLP layer (``first_k_dense_replace``) then MoE layers with a shared
expert and per-expert tensors on disk; every Linear weight of the decoder layers is stored as E4M3 with an fp32
``weight_scale_inv`` per 128x128 block (the multiplier that dequantizes it); embeddings, norms, the router and the
head stay bf16/fp32, and ``quantization_config`` is DeepSeek-V3's own. The dims are multiples of 128 wherever a
block grid lies on them, so every block is whole (see the partial-block test for the others).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DEEPSEEK_V3_FP8_CONFIG", "DEEPSEEK_V3_TINY", "FP8_MAX", "quantize_block_fp8", "save_deepseek_v3_fp8"]

#: DeepSeek-V3's quantization_config, as its config.json has it
DEEPSEEK_V3_FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                          "activation_scheme": "dynamic"}
#: q_b 2*(64+128) = 384 rows, kv_a 128+128 = 256, kv_b 2*(64+64) = 256, o_proj 2*64 = 128 inputs
DEEPSEEK_V3_TINY = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 128, "kv_lora_rank": 128,
                    "qk_rope_head_dim": 128, "qk_nope_head_dim": 64, "v_head_dim": 64,
                    "max_position_embeddings": 128}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_BLOCK = 128
#: weights DeepSeek-V3 keeps in high precision: embeddings, norms, the router, the head
_KEPT = ("embed_tokens", "layernorm", "norm.weight", "mlp.gate.", "lm_head")


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ([rows, cols], multiples of 128) as E4M3 codes and the fp32 ``weight_scale_inv`` of each 128x128
    block: ``scale = amax / 448`` and ``code = e4m3(w / scale)``, so ``code * scale`` dequantizes it."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // _BLOCK, _BLOCK, cols // _BLOCK, _BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(rows, cols), scale


def save_deepseek_v3_fp8(directory: Path, *, seed: int = 0, bf16_directory: Path | None = None) -> Path:
    """Build the tiny DeepSeek-V3 (random weights, bf16), and save it in DeepSeek's FP8 block layout to
    ``directory`` (one ``model.safetensors``); with ``bf16_directory``, also its bf16 original there."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(**DEEPSEEK_V3_TINY, dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    original = Path(bf16_directory or directory.parent / f".{directory.name}-bf16")
    model.save_pretrained(original)  # per-expert tensors on disk, as DeepSeek ships them
    from safetensors import safe_open

    tensors = {}
    with safe_open(original / "model.safetensors", "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open has no iterator)
            tensor = handle.get_tensor(name)
            if name.endswith(".weight") and tensor.ndim == 2 and not any(part in name for part in _KEPT):
                tensors[name], tensors[f"{name}_scale_inv"] = quantize_block_fp8(tensor)
            else:
                tensors[name] = tensor
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((original / "config.json").read_text())
    saved["quantization_config"] = dict(DEEPSEEK_V3_FP8_CONFIG)
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    if (original / "generation_config.json").is_file():
        (directory / "generation_config.json").write_text((original / "generation_config.json").read_text())
    return directory
