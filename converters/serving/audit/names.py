"""How vLLM names a checkpoint's layers: fused (packed) modules, experts, KV-cache scales, ignore entries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from converters.model.files import INDEX_NAME
from converters.model.safetensors_stream import SourceTensor, read_tensor_index

__all__ = ["ARCHITECTURES", "EXPERT", "FP8_KV_SUFFIX", "KV_REGEX", "KV_SUFFIXES", "NOT_LINEAR", "Architecture",
           "is_match", "read_headers"]

KV_SUFFIXES = ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale")
EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """How vLLM names one model family's layers (its ``packed_modules_mapping`` and expert checkpoint names)."""

    packed: dict[str, tuple[str, ...]]  #: fused layer -> its checkpoint shards, in order
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  #: ckpt gate, up, down names
    renames: tuple[tuple[str, str], ...] = ()  #: rename-mapper substrings applied to ignore entries
    never_quantized: tuple[str, ...] = ()  #: module-name regexes vLLM builds with ``quant_config=None``


_DENSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_QWEN_MOE = Architecture(packed=_DENSE, never_quantized=(r".*\.mlp\.gate$", r".*\.shared_expert_gate$"))
ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture(packed=_DENSE) for name in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")},
    "MixtralForCausalLM": Architecture(
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")}, experts=("w1", "w3", "w2"),
        renames=((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")),
        never_quantized=(r".*\.block_sparse_moe\.gate$",)),
    "Qwen2MoeForCausalLM": _QWEN_MOE,
    "Qwen3MoeForCausalLM": _QWEN_MOE,
    "BertModel": Architecture(packed={"qkv_proj": ("query", "key", "value")}),
    # vLLM's deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2): MLA's q_a/kv_a projections fused when q_lora_rank is set;
    # the router is built with quant_config=None (its tensors, e_score_correction_bias included for topk_method
    # "noaux_tc", load as they are stored).
    **{name: Architecture(
        packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
        never_quantized=(r".*\.mlp\.gate$",)) for name in (
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")},
}
# Modules vLLM builds as embeddings or ParallelLMHead, never as LinearBase: the Linear schemes skip them.
NOT_LINEAR = re.compile(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|position_embeddings|"
                        r"token_type_embeddings|embed_positions|lm_head|embed_out)$")

# vLLM's cache-scale mappers, applied in this order to every name (base_config.py, then fp8.py's suffixes).
KV_REGEX = (
    (re.compile(r"\.kv_scale$"), ".attn.k_scale"),
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
)
FP8_KV_SUFFIX = ((".k_proj.output_scale", ".attn.k_scale"), (".v_proj.output_scale", ".attn.v_scale"),
                 (".q_proj.output_scale", ".attn.q_scale"),
                 (".self_attn.prob_output_scale", ".self_attn.attn.prob_scale"))


def is_match(name: str, entry: str) -> bool:
    """compressed-tensors' ``_is_equal_or_regex_match``: ``re:`` entries by ``re.match``, others by equality."""
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


def read_headers(directory: Path) -> dict[str, SourceTensor]:
    """Every tensor of the export (the shards the index names, else every ``*.safetensors``), headers only."""
    index = directory / INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        paths = [directory / file for file in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    tensors: dict[str, SourceTensor] = {}
    for path in paths:
        tensors.update(read_tensor_index(path)[0])
    return tensors
