"""A safetensors checkpoint loaded into a meta-device model one group of tensors at a time.

The layer-sequential pipeline keeps only one decoder layer in memory, so it never calls
``from_pretrained`` on the whole model. It still loads through transformers' own machinery:
``convert_and_load_state_dict_in_model`` with the model's own conversion mapping
(``get_model_conversion_mapping``), so renamed heads and per-expert MoE tensors fused into 3-D parameters
arrive exactly as ``from_pretrained`` would produce them, and no second copy of that mapping lives here.

Tensors are read one by one through ``safe_open`` slices; files are opened for one load (through
``converters.model.files``, which follows no link after its check) and closed after it, so the pages read
stay out of the process once a group is released.
``Checkpoint.read`` instead reads a group's tensors with ``pread``
into plain memory (no file mapping; thread-safe) and ``load(tensors=...)`` then places them: the
layer-sequential prefetch of a quantized source (``Checkpoint.read_ahead``; a plain source's next layer
goes to the kernel's readahead instead).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from converters.errors import ModelNotFoundError
from converters.model.consistency import check_against_model, check_index, check_stored_dtype
from converters.model.files import INDEX_NAME, SINGLE_FILE_NAME, is_plain_file_name, open_model_file, pinned_model_path
from converters.model.limits import read_index_file
from converters.model.quantized import source_quantization
from converters.model.quantized.stored import StoredWeights
from converters.model.safetensors_stream import SourceTensor, read_tensor, read_tensor_index
from converters.model.sources import build_meta_model
from converters.third_party_noise import transformers_progress_off

__all__ = ["weight_files", "Checkpoint", "load_dequantized_model", "release", "unit_keys", "module_keys",
           "return_freed_memory", "held_bytes"]



def weight_files(directory: Path) -> list[Path]:
    """The safetensors files that hold a checkpoint's weights: the shards its index names, else the single file.

    Other ``*.safetensors`` files in the directory (consolidated originals, adapters) are not weights of
    this checkpoint and are ignored. Raises ModelNotFoundError for a missing file or a malformed index.
    """
    directory = Path(directory)
    index = directory / INDEX_NAME
    if not index.is_file():
        if (directory / SINGLE_FILE_NAME).is_file():
            return [directory / SINGLE_FILE_NAME]
        raise ModelNotFoundError(
            f"{directory} has neither {SINGLE_FILE_NAME} nor {INDEX_NAME}; fp8forge reads safetensors checkpoints "
            "written by save_pretrained"
        )
    try:
        names = sorted(set(read_index_file(index)["weight_map"].values()))  # bounded: converters.model.limits
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelNotFoundError(f"{index}: not a safetensors index (needs a weight_map object): {exc}") from exc
    for name in names:
        # The index names files next to it; anything else would read outside the checkpoint.
        if not is_plain_file_name(name) or not (directory / name).is_file():
            raise ModelNotFoundError(f"{index}: shard {name!r} is not a file in {directory}")
    return [directory / name for name in names]


class Checkpoint:
    """The on-disk tensors of a checkpoint, mapped onto the in-memory names of ``model`` (a meta model).

    Args:
        directory: the model directory (config.json + safetensors).
        model: the model built from the config on the meta device; loads replace its meta tensors.
        dtype: the dtype weights are loaded in (the checkpoint's own, as ``from_pretrained`` uses).
        device: where loaded tensors are placed.
    """

    def __init__(self, directory: Path, model: nn.Module, *, dtype: torch.dtype, device: torch.device | str) -> None:
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.directory = Path(directory)
        self.model = model
        self.dtype = dtype
        self.device = torch.device(device)
        self.mapping = get_model_conversion_mapping(model)
        renamings = [entry for entry in self.mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in self.mapping if isinstance(entry, WeightConverter)]
        meta_state = model.state_dict()
        prefix = model.base_model_prefix
        self.file_of: dict[str, Path] = {}
        self.target_of: dict[str, str] = {}
        self.source_of: dict[str, SourceTensor] = {}  #: where each stored tensor's bytes lie (for :meth:`read`)
        in_file: dict[Path, list[str]] = {}
        for path in weight_files(self.directory):
            # A corrupt header is refused with its reason before the Rust reader maps it.
            sources, _ = read_tensor_index(path)
            self.source_of.update(sources)
            with pinned_model_path(path) as pinned, safe_open(pinned, framework="pt") as handle:
                in_file[path] = list(handle.keys())
        check_index(self.directory, {path.name: names for path, names in in_file.items()})
        quantization = source_quantization(self.directory)
        #: a quantized source's weights, dequantized one at a time as they load (None: a high-precision source)
        self.stored = StoredWeights.of(quantization, self.source_of) if quantization is not None else None
        for path, names in in_file.items():
            for name in names:
                key = self.stored.logical_name(name) if self.stored is not None else name
                if key is None:  # a scale: part of its weight, not a tensor of the model
                    continue
                self.file_of[key] = path
                # The same two-step rename transformers' loader applies (convert_and_load_state_dict_in_model).
                target, converter = rename_source_key(key, renamings, converters, prefix, meta_state)
                if target not in meta_state and key in meta_state:
                    target, converter = rename_source_key(key, [], [], prefix, meta_state)
                self.target_of[key] = target
                self._check(path, name, key, converter, target, meta_state.get(target))
        self.tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})

    def _check(self, path: Path, name: str, key: str, converter: str | None, target: str,
               expected: torch.Tensor | None) -> None:
        """The stored tensor against the meta model's ``expected`` it loads into: its shape (where no converter
        reshapes it), and FP8 or integer codes only where the source's quantization covers them."""
        quantized = self.stored is not None and key in self.stored.stored
        dtype = self.source_of[name].dtype
        if converter is not None:  # experts stacked, fused projections split: transformers checks the shapes
            if dtype.startswith("F8"):
                check_stored_dtype(path.name, name, dtype, quantized)
            return
        if expected is None:  # not a tensor of this model (transformers ignores it, so does the conversion)
            return
        shape = self.stored.logical_shape(key, self.source_of) if quantized else self.source_of[name].shape
        check_against_model(path.name, name, shape, dtype, quantized, target, expected)

    def _dequantized(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The weights among ``keys`` that the source stores quantized, each dequantized to the model's dtype."""
        if self.stored is None:
            return {}
        return {key: self.stored.dequantize(key, self.source_of, self.dtype) for key in keys
                if key in self.stored.stored}

    @property
    def on_disk_targets(self) -> set[str]:
        return set(self.target_of.values())

    def on_disk_name(self, target: str) -> str | None:
        """The on-disk key stored for the in-memory tensor ``target`` when it is a plain rename, else None."""
        keys = [key for key, mapped in self.target_of.items() if mapped == target]
        return keys[0] if len(keys) == 1 else None

    def disk_keys_for(self, targets: Iterable[str]) -> list[str]:
        """On-disk keys whose in-memory target is one of ``targets``, in file order."""
        wanted = set(targets)
        return [key for key, target in self.target_of.items() if target in wanted]

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The on-disk tensors that :meth:`load` of ``keys`` would read, each read with ``pread`` into its own memory.

        Thread-safe and independent of the model (the layer-sequential prefetch calls it in a background thread
        for the next layer); hand the result to ``load(keys, tensors=...)``. Raises OSError on a short read.
        """
        wanted, _ = self._with_ties(keys)
        disk_keys = self.disk_keys_for(wanted)
        dequantized = self._dequantized(disk_keys)
        return {key: dequantized[key] if key in dequantized else read_tensor(self.source_of[key]) for key in disk_keys}

    def read_ahead(self, keys: Iterable[str]) -> dict[str, torch.Tensor] | None:
        """Get ready what :meth:`load` of ``keys`` will read, from a background thread: a quantized source's
        weights are read and dequantized (:meth:`read`, handed to ``load(keys, tensors=...)``); a plain source's
        byte ranges go to the kernel's readahead (``posix_fadvise(WILLNEED)``) and None is returned, so that the
        load maps them from the page cache. A plain read here would copy the bytes once more than the load does,
        on the cores the forward is using: a 0.5B-width job's calibration took about 10% longer with it on a 2-core
        machine (a layer's load 0.10-0.16 s against 0.03 s).
        Where the platform has no ``posix_fadvise``, :meth:`read`; a file system that refuses the advice only loses
        the readahead (it is a hint). Raises OSError when a file cannot be opened."""
        if self.stored is not None or not hasattr(os, "posix_fadvise"):
            return self.read(keys)
        wanted, _ = self._with_ties(keys)
        ranges: dict[Path, list[tuple[int, int]]] = {}
        for key in self.disk_keys_for(wanted):
            source = self.source_of[key]
            ranges.setdefault(source.path, []).append((source.start, source.nbytes))
        for path, spans in ranges.items():
            descriptor = open_model_file(path)
            try:
                for start, length in spans:
                    os.posix_fadvise(descriptor, start, length, os.POSIX_FADV_WILLNEED)
            except OSError:  # e.g. EINVAL where the file system has no readahead: the load reads it all the same
                pass
            finally:
                os.close(descriptor)
        return None

    def load(self, keys: Iterable[str], *, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Materialize the model's tensors named ``keys`` (in-memory state-dict names) from the checkpoint.

        ``tensors`` are on-disk tensors already read by :meth:`read`; the keys it lacks are read here. Tied
        parameters are loaded from whichever twin the checkpoint holds and shared; buffers the checkpoint
        does not hold (rotary frequencies, position ids) are computed by the model's own ``_init_weights``.
        Raises ModelNotFoundError when the checkpoint lacks a parameter or holds a tensor of another shape.
        """
        keys = set(keys)
        wanted, ties = self._with_ties(keys)
        info = self._convert_and_load(self.disk_keys_for(wanted), tensors or {})
        if info.mismatched_keys or info.conversion_errors:
            raise ModelNotFoundError(
                f"{self.directory}: checkpoint tensors do not fit the architecture built from config.json "
                f"(shape mismatches: {sorted(info.mismatched_keys)[:3]}, conversion errors: "
                f"{list(info.conversion_errors)[:3]})"
            )
        for target, source in ties.items():
            loaded, other = (source, target) if _is_real(self.model, source) else (target, source)
            _set_tensor(self.model, other, self.model.get_parameter(loaded))
        self._initialize_missing(keys | set(ties) | set(ties.values()))
        if self.stored is not None:
            return_freed_memory()

    def _with_ties(self, keys: Iterable[str]) -> tuple[set[str], dict[str, str]]:
        """``keys`` with each tied pair reduced to the twin the checkpoint holds, and the ties involved."""
        wanted = set(keys)
        ties = {target: source for target, source in self.tied.items() if target in wanted or source in wanted}
        present = self.on_disk_targets
        for target, source in ties.items():
            wanted.discard(target)
            wanted.discard(source)
            wanted.add(source if source in present or target not in present else target)
        return wanted, ties

    def _convert_and_load(self, disk_keys: list[str], tensors: dict[str, torch.Tensor]) -> Any:
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        config = LoadStateDictConfig(
            pretrained_model_name_or_path=str(self.directory),
            device_map={"": self.device},
            dtype=self.dtype,
            dtype_plan=self.model._get_dtype_plan(self.dtype),
            weight_mapping=self.mapping,
        )
        tensors = {**tensors, **self._dequantized(key for key in disk_keys if key not in tensors)}
        by_file: dict[Path, list[str]] = {}
        for key in disk_keys:
            if key not in tensors:
                by_file.setdefault(self.file_of[key], []).append(key)
        # Each file is opened without following a link (converters.model.files) and mapped by safe_open through
        # its /proc/self/fd entry; the descriptors close once mapped.
        with ExitStack() as pinned:
            handles = [safe_open(pinned.enter_context(pinned_model_path(path)), framework="pt") for path in by_file]
        try:
            slices: dict[str, Any] = {key: handle.get_slice(key)
                                      for handle, keys in zip(handles, by_file.values(), strict=True) for key in keys}
            slices.update((key, tensors[key]) for key in disk_keys if key in tensors)
            with transformers_progress_off():
                info, _ = convert_and_load_state_dict_in_model(self.model, slices, config)
        finally:
            del handles  # unmaps the files: the pages read do not stay in this process
        return info

    def _initialize_missing(self, keys: set[str]) -> None:
        """Compute meta buffers with the model's own init; refuse a parameter the checkpoint lacks."""
        missing_params = []
        owners: dict[int, nn.Module] = {}
        for name, tensor, module, is_buffer in _named_tensors(self.model):
            if name not in keys or tensor.device.type != "meta":
                continue
            if not is_buffer:
                missing_params.append(name)
                continue
            leaf = name.rpartition(".")[2]
            module._buffers[leaf] = torch.empty_like(tensor, device=self.device)
            owners[id(module)] = module
        if missing_params:
            raise ModelNotFoundError(
                f"{self.directory}: the checkpoint lacks {len(missing_params)} weight(s) the architecture needs, "
                f"e.g. {sorted(missing_params)[:3]}"
            )
        if owners:
            from transformers import initialization

            with torch.no_grad(), initialization.guard_torch_init_functions():
                for module in owners.values():
                    self.model._init_weights(module)


def load_dequantized_model(directory: Path, config: Any, sources: Any, dtype: torch.dtype) -> nn.Module:
    """A quantized checkpoint's whole model on the CPU, every weight dequantized to ``dtype`` as it loads, through
    the loader of the layer-sequential mode (``from_pretrained`` would build the quantizer's FP8 modules instead).
    ``sources``: the :class:`~converters.model.sources.ModelSourceOptions` the config was read with."""
    model = build_meta_model(config, sources)
    with torch.no_grad():
        Checkpoint(directory, model, dtype=dtype, device="cpu").load(unit_keys(model, lambda name: True))
    return model.eval()


#: glibc's allocator, where there is one (its malloc_trim), for :func:`return_freed_memory`
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


#: freed bytes a caller may leave in the allocator's arenas before :func:`return_freed_memory` trims: a trim costs
#: milliseconds whatever was freed, more than a small layer's whole forward
_TRIM_AFTER_BYTES = 32 * 2**20
_untrimmed_bytes = 0


def return_freed_memory(freed_bytes: int | None = None) -> None:
    """Hand the heap pages freed since the last call back to the system.

    Dequantizing a layer frees its codes and fp32 intermediates (several MiB each) between long-lived
    allocations; glibc keeps such freed pages in its arenas, so without a trim the process's resident memory
    climbed by about 13 MiB a layer (benchmarks/bench_quantized_source.py, 1024-wide Llama) instead of staying flat.
    ``freed_bytes``: what the caller just freed; the trim then waits until ``_TRIM_AFTER_BYTES`` have been freed
    (a model of small layers trims every few layers, still flat in depth). None trims now.
    """
    global _untrimmed_bytes
    if freed_bytes is not None:
        _untrimmed_bytes += freed_bytes
        if _untrimmed_bytes < _TRIM_AFTER_BYTES:
            return
    _untrimmed_bytes = 0
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    if trim is not None:
        trim(0)


def held_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers that are not on the meta device."""
    return sum(tensor.nbytes for tensor in [*module.parameters(), *module.buffers()] if tensor.device.type != "meta")


def release(module: nn.Module) -> None:
    """Put every parameter and buffer of ``module`` back on the meta device, freeing its memory.

    New meta tensors are set in place of the old ones (no ``.data`` swap), so a tensor shared with a
    module outside ``module`` (a tied embedding) is left untouched there.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                     requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = torch.empty_like(buffer, device="meta")


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, bool]]:
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None:
                yield prefix + name, param, module, False
        for name, buffer in module._buffers.items():
            if buffer is not None:
                yield prefix + name, buffer, module, True


def _is_real(model: nn.Module, name: str) -> bool:
    return model.get_parameter(name).device.type != "meta"


def _set_tensor(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_path) if module_path else model, leaf, value)


def unit_keys(model: nn.Module, belongs: Callable[[str], bool]) -> set[str]:
    """The state-dict names (parameters and buffers, persistent or not) for which ``belongs(name)`` is true."""
    return {name for name, *_ in _named_tensors(model) if belongs(name)}


def module_keys(module: nn.Module, path: str) -> set[str]:
    """The model state-dict names of ``module``'s tensors when it sits at ``path`` (``unit_keys`` of that subtree)."""
    return {f"{path}.{name}" for name, *_ in _named_tensors(module)}

