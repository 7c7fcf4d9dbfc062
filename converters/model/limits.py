"""Bounds on every structure a client's model directory makes fp8forge parse, checked before it is parsed: the
config file (bytes and JSON values; what the config declares is checked by :mod:`converters.model.config_checks`),
the index (``model.safetensors.index.json``: bytes and entries) and each safetensors header (bytes and tensors).
JSON is counted before ``json.loads`` builds it (:func:`parse_bounded_json`): a file within the byte limit can
still be millions of empty lists, each a Python object, and parsing one took seconds and a gigabyte.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, BinaryIO

from converters.errors import Fp8ForgeError, ModelConfigError, ModelNotFoundError
from converters.model.files import open_model_file

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_INDEX_ENTRIES",
    "MAX_SHARD_TENSORS",
    "JsonTooLarge",
    "parse_bounded_json",
    "read_index_file",
    "read_safetensors_header",
    "weight_file_error",
    "json_type_name",
    "read_config_json",
]

#: Real configs are kilobytes (the largest, with ImageNet-21k's label names, under one MB).
MAX_CONFIG_BYTES = 16 << 20
#: Real configs nest four or five levels (a text config's rope parameters); JSON nested deeper is refused.
MAX_CONFIG_DEPTH = 32
#: Real configs hold at most thousands of JSON values (the largest, ImageNet-21k's two label maps, about 90,000).
MAX_CONFIG_NODES = 500_000
#: Real indexes are megabytes (DeepSeek-V3's, about 91,000 tensors over 163 shards, under 10 MB).
MAX_INDEX_BYTES = 64 << 20
#: Tensors one index may list: DeepSeek-V3 lists about 91,000, Kimi-K2 about 140,000.
MAX_INDEX_ENTRIES = 262_144
#: The safetensors library refuses headers over 100 MB; so do fp8forge's readers.
MAX_HEADER_BYTES = 100_000_000
#: Tensors one safetensors file may hold: a real shard holds at most a few thousand, a whole small model a few more.
MAX_SHARD_TENSORS = 50_000
# JSON values (keys included) one header entry takes, generously (name, dtype, shape and its sizes, offsets), and
# what __metadata__ may add: the bound on a header's values before it is parsed.
_NODES_PER_TENSOR = 24
_METADATA_NODES = 4_096


def read_config_json(path: Path, *, shown: str = "config.json") -> dict[str, Any]:
    """A config file's JSON object, read within bounds but not checked against ``config_checks.ConfigLimits`` (for
    readers after the check: a worker's copy of the config into its artifact): a regular file (a FIFO or a device is
    refused, not waited on) of at most :data:`MAX_CONFIG_BYTES` and :data:`MAX_CONFIG_NODES` values.

    Raises:
        ModelConfigError: not a regular file, too large, or not a JSON object.
    """
    data = _read_regular_file(path, MAX_CONFIG_BYTES, shown, ModelConfigError)
    if len(data) > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{shown} is larger than {MAX_CONFIG_BYTES >> 20} MiB; a model config is kilobytes",
                               field="model")
    try:
        config = parse_bounded_json(data, max_nodes=MAX_CONFIG_NODES)
    except JsonTooLarge as exc:
        raise ModelConfigError(f"{shown} {exc.why}; a model config holds a few thousand values: use the "
                               "config.json saved with the model", field="model") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelConfigError(f"{shown} is not valid JSON ({type(exc).__name__})", field="model") from exc
    if not isinstance(config, dict):
        raise ModelConfigError(f"{shown} must hold a JSON object, not {json_type_name(config)}", field="model")
    return config


def _read_regular_file(path: Path, limit: int, shown: str, error: type[Fp8ForgeError]) -> bytes:
    """At most ``limit + 1`` bytes of ``path``, a regular file (a FIFO or a device is refused, not waited on)."""
    try:
        descriptor = open_model_file(path)  # no link followed after its check (converters.model.files)
    except OSError as exc:
        raise error(f"cannot open {shown} ({exc.strerror})", field="model") from exc
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise error(f"{shown} is not a regular file", field="model")
        return file.read(limit + 1)


class JsonTooLarge(ValueError):
    """JSON refused by :func:`parse_bounded_json` before it was parsed; ``why`` completes "<the file> ..."."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# A JSON string, escapes included; one that runs to the end of the data matches too, so no search ever fails
# and backtracks over the rest of the data (which made stripping quadratic)
_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def parse_bounded_json(data: bytes, *, max_nodes: int, max_depth: int = MAX_CONFIG_DEPTH) -> Any:
    """``json.loads(data)`` once a scan of its tokens shows at most ``max_nodes`` values and keys, nested at most
    ``max_depth`` deep: what ``json`` would build is counted before anything is built.

    Every value or key follows a ``[``, ``{``, ``,`` or ``:`` outside the strings (or is the whole document), so
    counting those bounds what the parse makes. Stripping the strings costs a regex match per string; more quotes
    than twice ``max_nodes`` (escaped quotes included: a config or header holds few) are refused before it.

    Raises:
        JsonTooLarge: more values or deeper nesting than allowed (``why`` says which).
        ValueError: not JSON (``JSONDecodeError``, ``UnicodeDecodeError``).
    """
    if data.count(b'"') > 2 * max_nodes:
        raise JsonTooLarge(f"holds more than {max_nodes:,} JSON strings (at most {max_nodes:,} values are read)")
    bare = _STRING.sub(b"0", data)
    nodes = 1 + sum(bare.count(token) for token in (b",", b":", b"[", b"{"))
    if nodes > max_nodes:
        raise JsonTooLarge(f"holds about {nodes:,} JSON values, more than the {max_nodes:,} read")
    brackets = bare.translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * max_depth:  # shallower otherwise, whatever the order
        depth = deepest = 0
        for byte in brackets:
            depth += 1 if byte in b"[{" else -1
            deepest = max(deepest, depth)
        if deepest > max_depth:
            raise JsonTooLarge(f"nests JSON more than {max_depth} levels deep")
    try:
        return json.loads(data)
    except RecursionError as exc:  # unreachable after the depth check; kept as the parse's own guard
        raise JsonTooLarge(f"nests JSON more than {max_depth} levels deep") from exc


def read_index_file(path: Path, *, shown: str = "model.safetensors.index.json") -> dict[str, Any]:
    """Read a checkpoint's safetensors index: a regular file of at most :data:`MAX_INDEX_BYTES` holding a JSON
    object whose ``weight_map`` maps at most :data:`MAX_INDEX_ENTRIES` tensor names to file names (strings).

    Returns the whole index object (``weight_map`` checked; ``metadata`` as the file has it).

    Raises:
        ModelConfigError: larger, or more entries, than the limits (the message says how to fix it).
        ModelNotFoundError: not a regular file, not JSON, or no ``weight_map`` object of strings.
    """
    data = _read_regular_file(path, MAX_INDEX_BYTES, shown, ModelNotFoundError)
    if len(data) > MAX_INDEX_BYTES:
        raise ModelConfigError(f"{shown} is larger than {MAX_INDEX_BYTES >> 20} MiB; a real index is megabytes: use "
                               "the index saved with the checkpoint", field="model")
    try:
        index = parse_bounded_json(data, max_nodes=2 * MAX_INDEX_ENTRIES + _METADATA_NODES)
    except JsonTooLarge as exc:
        raise ModelConfigError(f"{shown} {exc.why}; an index lists at most {MAX_INDEX_ENTRIES:,} tensors: use the "
                               "index saved with the checkpoint", field="model") from exc
    except ValueError as exc:
        raise ModelNotFoundError(f"{shown} is not a safetensors index: not valid JSON ({type(exc).__name__})",
                                 field="model") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise ModelNotFoundError(f"{shown} is not a safetensors index: it needs a weight_map object of tensor "
                                 "names to file names", field="model")
    if len(weight_map) > MAX_INDEX_ENTRIES:
        raise ModelConfigError(f"{shown} lists {len(weight_map):,} tensors, more than the {MAX_INDEX_ENTRIES:,} "
                               "fp8forge reads: use the index saved with the checkpoint", field="model")
    return index


def weight_file_error(name: str, why: str) -> ModelNotFoundError:
    """The error of a weight file that is not a well-formed safetensors file, naming it and what is wrong."""
    return ModelNotFoundError(f"weight file {name!r} is not a valid safetensors file: {why}; replace it with an "
                              "intact copy (e.g. download it again)")


def read_safetensors_header(file: BinaryIO, *, name: str) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file open as ``file`` (``name``: its file name, for messages) and the
    offset its data starts at. At most :data:`MAX_HEADER_BYTES` are read, and at most :data:`MAX_SHARD_TENSORS`
    entries parsed; the entries themselves are not checked.

    Raises:
        ModelNotFoundError: shorter than a header, a length past the file's end, not a JSON object.
        ModelConfigError: a header larger, or with more tensors, than the limits.
    """
    size = os.fstat(file.fileno()).st_size
    prefix = file.read(8)
    if len(prefix) < 8:
        raise weight_file_error(name, f"{size} bytes is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > size - 8:
        raise weight_file_error(name, f"its header claims {length} bytes, more than the file's {size - 8} after the "
                                      "length")
    if length > MAX_HEADER_BYTES:
        raise ModelConfigError(f"weight file {name!r} has a header of {length:,} bytes, more than the "
                               f"{MAX_HEADER_BYTES:,} the safetensors format allows", field="model")
    try:
        header = parse_bounded_json(file.read(length),
                                    max_nodes=MAX_SHARD_TENSORS * _NODES_PER_TENSOR + _METADATA_NODES, max_depth=8)
    except JsonTooLarge as exc:
        raise ModelConfigError(f"the header of weight file {name!r} {exc.why}; {_FEWER_TENSORS}",
                               field="model") from exc
    except ValueError as exc:
        raise weight_file_error(name, f"its header is not JSON ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise weight_file_error(name, "its header is not a JSON object")
    tensors = len(header) - ("__metadata__" in header)
    if tensors > MAX_SHARD_TENSORS:
        raise ModelConfigError(f"weight file {name!r} holds {tensors:,} tensors; {_FEWER_TENSORS}", field="model")
    return header, 8 + length


_FEWER_TENSORS = (f"fp8forge reads at most {MAX_SHARD_TENSORS:,} tensors from one file (a real shard holds a few "
                  "thousand): save the checkpoint in shards (save_pretrained's max_shard_size)")


def json_type_name(value: Any) -> str:
    # the value itself is not repeated: a config may be a link to a file the client must not read through us
    if isinstance(value, bool):
        return "true or false"
    return {str: "a string", int: "an integer", float: "a number with a fraction", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)
