"""A checkpoint's files checked against its index and its config.json before any weight is read.

A conversion that trusts a wrong file writes a wrong artifact: a shard that does not hold what the index lists
(two downloads mixed), a weight of another shape than the architecture's (a config.json from another model) or FP8
codes where config.json declares no quantization (the codes would be read as bf16 values). Each check refuses
with the file, the tensor and the fix. The model-based check (:func:`check_against_model`) serves the pipeline,
which builds the model on the meta device; the config-based one (:func:`check_against_config`) serves the
model-free path, which has only config.json, and so checks only the projections whose shape the config fixes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from converters.errors import ModelConfigError, ModelNotFoundError
from converters.model.files import INDEX_NAME
from converters.model.limits import read_index_file

__all__ = ["HIGH_PRECISION_DTYPES", "check_against_config", "check_against_model", "check_index", "check_stored_dtype"]

#: the safetensors dtypes a high-precision floating weight may be stored in
HIGH_PRECISION_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_LAYER = r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.\d+\."
#: model types whose attention and MLP projections have the shapes :func:`_expected_shapes` derives
_STANDARD_ATTENTION = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2"}
_MLA = {"deepseek_v2", "deepseek_v3"}
_WRONG_CONFIG = "the weights and config.json do not belong together: use the config.json saved with these weights"


def check_index(directory: Path, found: Mapping[str, Iterable[str]]) -> None:
    """Every tensor the index lists is in the shard it names. ``found``: shard file name -> its tensor names.

    Raises:
        ModelNotFoundError: (field ``model``) a listed tensor is in another shard or in none; the message names
            the index, the tensor and both shards.
    """
    path = Path(directory) / INDEX_NAME
    if not path.is_file():
        return
    weight_map = read_index_file(path)["weight_map"]
    holders: dict[str, list[str]] = {}
    for shard, names in found.items():
        for name in names:
            holders.setdefault(name, []).append(shard)
    for name, shard in weight_map.items():
        where = holders.get(name, [])
        if shard in where:
            continue
        found_in = f"it is in {', '.join(where)}" if where else "no shard holds it"
        raise ModelNotFoundError(
            f"{INDEX_NAME} lists tensor {name!r} in {shard!r}, but {shard!r} does not hold it ({found_in}): the index "
            "and the shards come from different saves; download the checkpoint again (or fix the index's weight_map)",
            field="model")


def check_stored_dtype(file: str, name: str, dtype: str, quantized: bool) -> None:
    """A floating weight stored in 8 bits or as integers must be a quantized weight config.json declares.

    Raises:
        ModelConfigError: (field ``model``) ``name`` in ``file`` is stored as ``dtype`` but not declared quantized.
    """
    if quantized or dtype in HIGH_PRECISION_DTYPES:
        return
    raise ModelConfigError(
        f"{file}: tensor {name!r} is stored as {dtype}, but no quantization declared in config.json covers it, or "
        "its scales are missing (its codes would be read as high-precision values): give the checkpoint its "
        "quantization_config and scale tensors as written (fp8forge reads fp8 block/tensor, compressed-tensors and "
        "ModelOpt layouts; see `fp8forge analyze`), or convert from the high-precision checkpoint", field="model")


def check_against_model(file: str, name: str, shape: tuple[int, ...], dtype: str, quantized: bool,
                        target: str, expected: Any) -> None:
    """The stored tensor ``name`` (logical ``shape``; ``dtype`` as stored) against the meta model's tensor
    ``target`` (``expected``) it loads into by a plain rename.

    Raises:
        ModelConfigError: (field ``model``) the shapes differ, or a floating parameter is stored as 8-bit or
            integer codes without a declared quantization.
    """
    if tuple(shape) != tuple(expected.shape):
        raise ModelConfigError(
            f"{file}: tensor {name!r} has shape {list(shape)}, but the architecture built from config.json needs "
            f"{list(expected.shape)} for {target}: {_WRONG_CONFIG}", field="model")
    if expected.is_floating_point():
        check_stored_dtype(file, name, dtype, quantized)


def check_against_config(config: Mapping[str, Any], tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> None:
    """Each ``(file, name, logical shape)`` whose shape config.json fixes (the attention and dense MLP projections
    of the model types in ``_STANDARD_ATTENTION`` and ``_MLA``, embeddings and head) has that shape.

    Raises:
        ModelConfigError: (field ``model``) a tensor of another shape; the message names the file, the tensor,
            the shape config.json's fields give and those fields.
    """
    rules = [(re.compile(pattern), rule) for pattern, rule in _expected_shapes(config).items()]
    if not rules:
        return
    for file, name, shape in tensors:
        for pattern, (expected, why) in rules:
            if pattern.search(name) and tuple(shape) != expected:
                raise ModelConfigError(
                    f"{file}: tensor {name!r} has shape {list(shape)}, but config.json gives {list(expected)} "
                    f"({why}): {_WRONG_CONFIG}", field="model")


def _expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, int], str]]:
    """Regex of a stored weight name -> (its shape, the config fields that give it)."""
    config = config.get("text_config") or config
    model_type = config.get("model_type")
    ints = {key: value for key, value in config.items() if type(value) is int}
    hidden, heads, vocab = ints.get("hidden_size"), ints.get("num_attention_heads"), ints.get("vocab_size")
    if model_type not in _STANDARD_ATTENTION | _MLA or not hidden or not heads:
        return {}
    rules: dict[str, tuple[tuple[int, int], str]] = {}
    if vocab:
        rules[r"^(?:model\.)?embed_tokens\.weight$"] = ((vocab, hidden), "vocab_size x hidden_size")
        rules[r"^lm_head\.weight$"] = ((vocab, hidden), "vocab_size x hidden_size")
    if "intermediate_size" in ints:
        size = ints["intermediate_size"]
        for proj in ("gate_proj", "up_proj"):
            rules[_LAYER + rf"mlp\.{proj}\.weight$"] = ((size, hidden), "intermediate_size x hidden_size")
        rules[_LAYER + r"mlp\.down_proj\.weight$"] = ((hidden, size), "hidden_size x intermediate_size")
    attention = _LAYER + r"self_attn\."
    if model_type in _MLA:
        return rules | _mla_shapes(ints, attention)
    head_dim = ints.get("head_dim") or hidden // heads
    kv_heads = ints.get("num_key_value_heads") or heads
    rules[attention + r"q_proj\.weight$"] = ((heads * head_dim, hidden), "num_attention_heads x head_dim, hidden_size")
    for proj in ("k_proj", "v_proj"):
        rules[attention + rf"{proj}\.weight$"] = ((kv_heads * head_dim, hidden),
                                                  "num_key_value_heads x head_dim, hidden_size")
    rules[attention + r"o_proj\.weight$"] = ((hidden, heads * head_dim), "hidden_size, num_attention_heads x head_dim")
    return rules


def _mla_shapes(ints: Mapping[str, int], attention: str) -> dict[str, tuple[tuple[int, int], str]]:
    """DeepSeek's multi-head latent attention (``modeling_deepseek_v3``'s projections)."""
    needed = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
    if not all(ints.get(key) for key in needed):
        return {}
    hidden, heads, kv_rank = ints["hidden_size"], ints["num_attention_heads"], ints["kv_lora_rank"]
    nope, rope, value = ints["qk_nope_head_dim"], ints["qk_rope_head_dim"], ints["v_head_dim"]
    rules = {
        attention + r"kv_a_proj_with_mqa\.weight$": ((kv_rank + rope, hidden), "kv_lora_rank + qk_rope_head_dim"),
        attention + r"kv_b_proj\.weight$": ((heads * (nope + value), kv_rank),
                                            "num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank"),
        attention + r"o_proj\.weight$": ((hidden, heads * value), "hidden_size, num_attention_heads x v_head_dim"),
    }
    q_rows = heads * (nope + rope)
    if ints.get("q_lora_rank"):
        rules[attention + r"q_a_proj\.weight$"] = ((ints["q_lora_rank"], hidden), "q_lora_rank, hidden_size")
        rules[attention + r"q_b_proj\.weight$"] = ((q_rows, ints["q_lora_rank"]),
                                                   "num_attention_heads x (qk_nope + qk_rope head dims), q_lora_rank")
    else:
        rules[attention + r"q_proj\.weight$"] = ((q_rows, hidden), "num_attention_heads x (qk_nope + qk_rope head "
                                                 "dims), hidden_size")
    return rules
