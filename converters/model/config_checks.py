"""Bounds on the model configs fp8forge accepts, checked on ``config.json``'s raw JSON before transformers builds
anything from it.

Building a model from its config costs time and memory in proportion to what the config declares, even on the
meta device: a ``config.json`` of 10,000 layers took a minute and 390 MB to build, and nothing stopped one of a
million. So every count a config declares (layers, widths and head counts, experts, vocabulary) is bounded, and so
are the parameters they add up to, estimated from the same fields. The defaults admit the largest public models
with room to spare: Llama-3.1-405B (126 layers, hidden 16,384, intermediate 53,248), DeepSeek-V3 and Kimi-K2 (256
and 384 experts, about 1T parameters), Qwen3-Next (512 experts), Gemma 3 (a 262,208-token vocabulary), XLM-V
(901,629 tokens). The service's settings raise them (``FP8FORGE_MAX_MODEL_*``).

The same walk refuses what transformers would crash on rather than refuse: a count of the wrong type (``"many"``,
``-1``, a list where an integer goes), JSON nested deeper than any config, and ``architectures`` that do not name
model classes (``AutoTokenizer``, ``PreTrainedModel``, ``os.system``). The file itself is read within the bounds of
:mod:`converters.model.limits`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from converters.errors import ModelConfigError
from converters.model.limits import MAX_CONFIG_DEPTH, json_type_name, read_config_json

__all__ = ["ConfigLimits", "check_config", "check_architectures", "estimate_parameters", "read_config_file",
           "load_checked_config"]

_ARCHITECTURE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

@dataclass(frozen=True, kw_only=True)
class ConfigLimits:
    """The largest model config accepted.

    Attributes:
        max_layers: layers of one stack (``num_hidden_layers``, ``n_layer``, ``decoder_layers``, ...).
        max_dim: widths and head counts (``hidden_size``, ``intermediate_size``, ``head_dim``, ...).
        max_experts: experts of an MoE layer (``num_experts``, ``n_routed_experts``, ...).
        max_vocab: ``vocab_size``.
        max_parameters: parameters estimated from those fields (embeddings, attention, MLP or experts).
    """

    max_layers: int = 1_000
    max_dim: int = 262_144
    max_experts: int = 2_048
    max_vocab: int = 2_097_152
    max_parameters: int = 4_000_000_000_000

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{item.name} must be a positive integer, got {value!r}")


# kind -> (ConfigLimits attribute, what it counts, the service setting that raises it)
_KINDS = {
    "layers": ("max_layers", "layers", "FP8FORGE_MAX_MODEL_LAYERS"),
    "dim": ("max_dim", "", "FP8FORGE_MAX_MODEL_DIM"),
    "experts": ("max_experts", "experts", "FP8FORGE_MAX_MODEL_EXPERTS"),
    "vocab": ("max_vocab", "tokens", "FP8FORGE_MAX_MODEL_VOCAB"),
}
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads")
_FFN = ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim")
_HEAD_DIMS = ("head_dim", "d_kv", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "moe_intermediate_size", "shared_expert_intermediate_size")
_STACK = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_MORE_STACKS = ("num_encoder_layers", "num_decoder_layers", "encoder_layers", "decoder_layers",
                "num_nextn_predict_layers")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MORE_EXPERTS = ("n_shared_experts", "num_shared_experts", "num_experts_per_tok")
# field -> (kind, smallest value, whether a per-layer or per-modality list of values is accepted)
_FIELDS: dict[str, tuple[str, int, bool]] = {
    **{name: ("layers", 0, False) for name in (*_STACK, *_MORE_STACKS)},
    **{name: ("dim", 1, True) for name in (*_HIDDEN, *_HEADS)},
    **{name: ("dim", 0, True) for name in (*_FFN, *_HEAD_DIMS)},
    **{name: ("experts", 0, True) for name in (*_EXPERTS, *_MORE_EXPERTS)},
    "vocab_size": ("vocab", 1, False),
}


def read_config_file(path: Path, limits: ConfigLimits | None = None, *, shown: str = "config.json") -> dict[str, Any]:
    """Read a model's ``config.json`` and check it (:func:`check_config`) without transformers; returns its JSON.

    Raises:
        ModelConfigError: refused by :func:`read_config_json` or by :func:`check_config`.
    """
    config = read_config_json(path, shown=shown)
    check_config(config, limits, shown=shown)
    return config


def check_config(config: Mapping[str, Any], limits: ConfigLimits | None = None, *, shown: str = "config.json"
                 ) -> None:
    """Refuse a config (its raw JSON) that declares a count out of :class:`ConfigLimits` or of the wrong type.

    Every object in the config is checked (a multimodal model's ``text_config``, ``vision_config``, ...), and the
    parameters of all of them together are estimated (:func:`estimate_parameters`).

    Raises:
        ModelConfigError: naming the field (dotted path), its value, the limit and the setting that raises it.
    """
    limits = limits or ConfigLimits()
    sections = list(_sections(config, shown))
    for where, section in sections:
        _check_section(where, section, limits, shown)
    total = sum(estimate_parameters(section) for _, section in sections)
    if total > limits.max_parameters:
        raise ModelConfigError(
            f"{shown} declares a model of about {total:,} parameters, above the limit of {limits.max_parameters:,}; "
            "the service's FP8FORGE_MAX_MODEL_PARAMETERS raises it", field="model")


def _sections(config: Mapping[str, Any], shown: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every JSON object in ``config`` with its dotted path; refuses nesting beyond :data:`MAX_CONFIG_DEPTH`."""
    stack: list[tuple[str, Any, int]] = [("", config, 1)]
    while stack:
        where, value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise ModelConfigError(f"{shown}: {where} nests JSON more than {MAX_CONFIG_DEPTH} levels deep",
                                   field="model")
        if isinstance(value, dict):
            yield where, value
            stack.extend((f"{where}.{key}" if where else str(key), item, depth + 1) for key, item in value.items()
                         if isinstance(item, (dict, list)))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item, depth + 1) for index, item in enumerate(value)
                         if isinstance(item, (dict, list)))


def _check_section(where: str, section: Mapping[str, Any], limits: ConfigLimits, shown: str) -> None:
    prefix = f"{where}." if where else ""
    for name, value in section.items():
        path = f"{prefix}{name}"
        if name in _FIELDS and value is not None:
            _check_count(path, value, *_FIELDS[name], limits, shown)
        elif name == "architectures" and value is not None:
            _check_architecture_names(path, value, shown)
        elif name == "model_type" and not isinstance(value, str):
            raise ModelConfigError(f"{shown}: {path} must be a string, not {json_type_name(value)}", field="model")
        elif (name.endswith("_config") or name == "auto_map") and not isinstance(value, (dict, type(None))):
            raise ModelConfigError(f"{shown}: {path} must be a JSON object, not {json_type_name(value)}", field="model")


def _check_count(path: str, value: Any, kind: str, low: int, lists: bool, limits: ConfigLimits, shown: str) -> None:
    attribute, unit, setting = _KINDS[kind]
    values = value if lists and isinstance(value, list) else [value]
    for item in values:
        if not isinstance(item, int) or isinstance(item, bool):
            what = "a whole number or a list of them" if lists else "a whole number"
            raise ModelConfigError(f"{shown}: {path} must be {what}, not {json_type_name(item)}", field="model")
        if item < low:
            raise ModelConfigError(f"{shown}: {path} is {item}; it must be at least {low}", field="model")
        limit = getattr(limits, attribute)
        if item > limit:
            raise ModelConfigError(
                f"{shown}: {path} is {item:,}, above the limit of {limit:,}{' ' + unit if unit else ''}; "
                f"the service's {setting} raises it", field="model")


def _check_architecture_names(path: str, value: Any, shown: str) -> None:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ModelConfigError(f"{shown}: {path} must be a list of class names (strings)", field="model")
    for name in value:
        if not _ARCHITECTURE.fullmatch(name):
            raise ModelConfigError(f"{shown}: {path} holds {name[:64]!r}, which is not a class name", field="model")



def _largest(section: Mapping[str, Any], names: tuple[str, ...]) -> int:
    """The largest value of ``names`` in ``section`` (a per-layer list counts its largest item); 0 when absent."""
    found = [0]
    for name in names:
        value = section.get(name)
        found += [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, int)]
    return max(found)


def estimate_parameters(section: Mapping[str, Any]) -> int:
    """An upper estimate of the parameters one config object declares (0 when it declares no width).

    Embeddings and an untied head, then per layer the attention projections (4 x hidden x the attention width)
    and either a gated MLP (3 x hidden x intermediate) or every expert's and the shared experts' MLPs. Enough to
    refuse a config of absurd size before anything is built; not a parameter count.
    """
    hidden = _largest(section, _HIDDEN)
    if not hidden:
        return 0
    layers = _largest(section, _STACK) + sum(_largest(section, (name,)) for name in _MORE_STACKS)
    heads = _largest(section, ("num_attention_heads", "n_head", "num_heads")) or 1
    head_dim = _largest(section, ("head_dim", "d_kv", "v_head_dim")) or hidden // heads
    ffn = _largest(section, _FFN) or 4 * hidden
    experts = _largest(section, _EXPERTS)
    expert_ffn = _largest(section, ("moe_intermediate_size",)) or ffn
    shared = (_largest(section, ("shared_expert_intermediate_size",))
              or _largest(section, ("n_shared_experts", "num_shared_experts")) * expert_ffn)
    mlp = 3 * hidden * (experts * expert_ffn + shared) if experts else 3 * hidden * ffn
    attention = 4 * hidden * max(hidden, heads * head_dim)
    return 2 * _largest(section, ("vocab_size",)) * hidden + layers * (attention + mlp)


def check_architectures(config: Mapping[str, Any], shown: str = "config.json") -> None:
    """Refuse ``architectures`` naming a transformers object that is not a model class (``AutoTokenizer``,
    ``PreTrainedModel`` or an abstract ``*PreTrainedModel`` base, a function); names transformers does not have
    are left to the Auto classes or remote code, as before.

    Raises:
        ModelConfigError: naming the entry.
    """
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    for name in config.get("architectures") or ():
        found = getattr(transformers, name, None)
        if found is None:
            continue
        is_model = isinstance(found, type) and (
            issubclass(found, _BaseAutoModelClass)
            or (issubclass(found, transformers.PreTrainedModel) and not found.__name__.endswith("PreTrainedModel")))
        if not is_model:
            raise ModelConfigError(
                f"{shown}: architectures names {name!r}, which is not a model class; name the class that loads the "
                "checkpoint, e.g. LlamaForCausalLM", field="model")


def load_checked_config(directory: Path, sources: Any) -> Any:
    """``AutoConfig.from_pretrained(directory)`` once the raw ``config.json`` passes :func:`read_config_file`
    (with ``sources.config_limits``) and :func:`check_architectures`.

    Raises:
        ModelConfigError: the config is out of bounds, or transformers refuses a field (a wrong type, a
            contradiction): transformers' own message.
        ValueError, OSError: as ``AutoConfig`` raises them (an unknown architecture, remote code needed).
    """
    from transformers import AutoConfig

    raw = read_config_file(Path(directory) / "config.json", getattr(sources, "config_limits", None))
    check_architectures(raw)
    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=sources.trust_remote_code)
    except (ValueError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - the config is the client's; whatever transformers trips on is theirs
        raise ModelConfigError(f"transformers cannot read config.json: {type(exc).__name__}: {exc}",
                               field="model") from exc
