"""KV-cache amax: the keys and values each attention layer hands its attention kernel, recorded during calibration.

Where the engines quantize the KV cache, and so what the amax must describe:

- vLLM: the model computes ``q, k = self.rotary_emb(positions, q, k)`` and calls its ``Attention`` layer with the
  rotated keys (``vllm/model_executor/models/llama.py``, ``LlamaAttention.forward``); ``Attention.forward(query,
  key, value)`` stores them in the cache, which the backend quantizes with ``layer._k_scale``/``_v_scale``
  (``vllm/attention/layer.py`` @ 5d4420da433893084e40e5ec8ead7ea37a9dfcc9: "1. Store the input key and value
  tensors in the KV cache"). Keys are quantized **after RoPE** (and after any q/k norm), per KV head before any
  GQA repetition; values as the v projection gives them. The scales are per tensor: ``BaseKVCacheMethod.
  process_weights_after_loading`` raises "Only support per-tensor scaling factor for fp8 KV cache" for anything
  else (``vllm/model_executor/layers/quantization/kv_cache.py`` @ 190900b94284ee14676b875615eebe967fd76b66).
- compressed-tensors 0.20.1 (what llm-compressor calibrates with): ``QuantizedKVCache.forward`` observes the
  ``key_states``/``value_states`` the attention module passes to ``cache.update`` (``compressed_tensors/modeling/
  kvcache.py``), which transformers calls right after ``apply_rotary_pos_emb``: the same post-RoPE keys.

How: transformers 5.24 attention modules call their kernel through ``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)(module, query, key, value, ...)`` with ``key``/``value``
``[batch, kv_heads, seq, head_dim]`` after RoPE and the cache update, before ``repeat_kv`` (sdpa and eager both
repeat inside the kernel: ``integrations/sdpa_attention.py``, ``models/llama/modeling_llama.py``). Inside
:func:`recording_kv_amax` the active implementation's entry is wrapped by one that records the amax of ``key`` and
``value`` for the attention modules of the recorded model, keyed by module path, then calls the kernel unchanged.
Calibration runs one prefill per batch, so the cache holds exactly the batch's own tokens. Because the key is the
module object, the recording works whether the whole model runs (``record_amax``) or one decoder layer at a time
(``calibrate_layer_by_layer``, which runs the same attention modules); the amax is the running max over all
steps, as compressed-tensors' static observer keeps it.

The recorder also keeps each layer's queries, keys and values and, once the layer has seen every step, chooses its
scales by the attention-output error they cause (:mod:`converters.calibration.kv_search`). Layer-sequential
calibration runs every step through one layer, then puts it back on the meta device (``release_layer``) and loads
the next: when an attention module is called, any other module with kept calls whose parameters are on the meta
device is done, and its search runs then (the kernels read only the module's attributes, not its weights), so at
most two layers' calls are held. In a whole-model pass nothing is released and every layer's calls are held
until :meth:`KvCacheRecorder.results` (at most :data:`SEARCH_BUFFER_BYTES` a layer: the calls past it add to
the amax but not to the search, and the report says how many steps were searched).

A rank of a data-parallel job (:mod:`converters.distributed`) runs its share of the steps: at each layer's end it
exchanges :meth:`KvCacheRecorder.state` with the other ranks, folds theirs in with :meth:`KvCacheRecorder.merge`
(the amax: a max, exact) and runs the layer's search with :meth:`KvCacheRecorder.finish` given its steps' numbers
and a gather over the ranks (:func:`~converters.calibration.kv_search.search_kv_scales`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converters.calibration.kv_search import Gather, KvSearch, KvStep, search_kv_scales
from converters.errors import CalibrationDataError

__all__ = ["KvAmax", "KvCacheRecorder", "SEARCH_BUFFER_BYTES", "recording_kv_amax", "unrecorded"]

#: the most bytes of one layer's queries, keys and values kept for its scale search (256 MiB: 4096 tokens of a
#: 8192-wide model in fp32 with 8 KV heads of 128 fit)
SEARCH_BUFFER_BYTES = 256 << 20

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: attention module -> (the recorder it feeds, its path in the recorded model); read without the lock by the kernel
_ACTIVE: dict[nn.Module, tuple[KvCacheRecorder, str]] = {}
#: attention implementation name -> (the function the wrapper replaced, or None for eager; recorders using it)
_INSTALLED: dict[str, tuple[Callable | None, int]] = {}


@dataclass(frozen=True, kw_only=True)
class KvAmax:
    """The keys' and values' amax of one attention layer over every calibration step (fp32, CPU)."""

    key: torch.Tensor  #: ``[kv_heads]``: each KV head's amax of the post-RoPE keys
    value: torch.Tensor  #: ``[kv_heads]``: each KV head's amax of the values
    dtype: torch.dtype  #: the dtype the keys and values had (the KV-cache scales are computed in it)
    search: KvSearch | None = None  #: the clipping chosen by attention-output error (None: amax / 448)

    @property
    def key_amax(self) -> float:
        return float(self.key.max())

    @property
    def value_amax(self) -> float:
        return float(self.value.max())

    @property
    def key_clip(self) -> float:
        """The key amax the scale is computed from: ``key_amax * key_ratio`` in float32."""
        return _clip(self.key_amax, self.search.key_ratio if self.search else 1.0)

    @property
    def value_clip(self) -> float:
        return _clip(self.value_amax, self.search.value_ratio if self.search else 1.0)


def _clip(amax: float, ratio: float) -> float:
    return float(torch.tensor(amax, dtype=torch.float32) * torch.tensor(ratio, dtype=torch.float32))


class KvCacheRecorder:
    """Running per-head amax of keys and values, per attention module path (see the module docstring)."""

    def __init__(self, expected: list[str], modules: dict[str, nn.Module] | None = None) -> None:
        self.expected = expected  #: attention module paths that must be recorded (``*Attention`` classes)
        self._modules = modules or {}  #: path -> module, to see a released (meta-device) layer
        self._key: dict[str, torch.Tensor] = {}
        self._value: dict[str, torch.Tensor] = {}
        self._dtype: dict[str, torch.dtype] = {}
        self._steps: dict[str, list[KvStep]] = {}  #: calls kept for the scale search, until the layer is done
        self._held: dict[str, int] = {}  #: bytes those calls hold
        self._full: set[str] = set()  #: paths whose buffer a call did not fit: later calls are not kept either
        self._search: dict[str, KvSearch] = {}

    def observe(self, path: str, key: torch.Tensor, value: torch.Tensor, *, query: torch.Tensor | None = None,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        """Add one attention call's keys and values to the amax and, with ``query`` and ``attend``, to the search."""
        if key.dim() != 4 or value.dim() != 4:
            raise CalibrationDataError(
                f"{path}: the attention kernel received keys of shape {tuple(key.shape)}, not [batch, kv_heads, "
                "seq, head_dim]; KV-cache scales cannot be recorded for this model", field="kv_cache")
        for store, tensor in ((self._key, key), (self._value, value)):
            amax = tensor.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
            store[path] = amax if path not in store else torch.fmax(store[path], amax)
        self._dtype[path] = key.dtype
        if query is None or attend is None:
            return
        for done in [other for other in self._steps if other != path and _released(self._modules.get(other))]:
            self.finish(done)
        size = sum(tensor.numel() * tensor.element_size() for tensor in (query, key, value))
        # the first calls, up to the first that does not fit: a prefix of the steps, which the ranks of a
        # data-parallel job can cut again to the one process's prefix (kv_search._within)
        if path not in self._steps or (path not in self._full and self._held[path] + size <= SEARCH_BUFFER_BYTES):
            self._steps.setdefault(path, []).append(KvStep(query.detach(), key.detach(), value.detach(), attend))
            self._held[path] = self._held.get(path, 0) + size
        else:
            self._full.add(path)

    def finish(self, path: str, *, numbers: list[int] | None = None, gather: Gather | None = None) -> None:
        """Choose ``path``'s scales from the calls kept so far and let them go (its layer has seen every step).

        A rank of a data-parallel job passes the job's numbers of its steps (the calls were its steps in that
        order) and a ``gather`` over the ranks, after :meth:`merge` made the amax the job's; every rank must call
        it, in the same order of paths (a collective)."""
        steps = self._steps.pop(path, [])
        self._held.pop(path, None)
        self._full.discard(path)
        if gather is not None:
            numbers = list(range(len(steps))) if numbers is None else numbers[:len(steps)]
            self._search[path] = search_kv_scales(steps, float(self._key[path].max()), float(self._value[path].max()),
                                                  numbers=numbers, budget=SEARCH_BUFFER_BYTES, gather=gather)
        elif steps:
            self._search[path] = search_kv_scales(steps, float(self._key[path].max()), float(self._value[path].max()))

    def state(self, owned: Callable[[str], bool] = lambda path: True) -> dict[str, KvAmax]:
        """What was recorded so far for the attention paths ``owned`` selects: amax, dtype and the search where it
        ran (the values are this recorder's own tensors: copy before changing them)."""
        return {path: KvAmax(key=self._key[path], value=self._value[path], dtype=self._dtype[path],
                             search=self._search.get(path)) for path in self._key if owned(path)}

    def merge(self, states: list[dict[str, KvAmax]]) -> None:
        """Fold other recorders' :meth:`state` into this one: each path's amax the max of all (exact, whatever the
        order), and a search a state carries replaces this one's (a resume record's finished layer). Raises
        ValueError for a path whose head count or dtype differs between states (the states of another model)."""
        for state in states:
            for path, amax in state.items():
                if path in self._key:
                    if amax.key.shape != self._key[path].shape or amax.dtype != self._dtype[path]:
                        raise ValueError(f"{path}: a KV state of {tuple(amax.key.shape)} heads in {amax.dtype} "
                                         f"cannot merge into {tuple(self._key[path].shape)} in {self._dtype[path]}")
                    self._key[path] = torch.fmax(self._key[path], amax.key)
                    self._value[path] = torch.fmax(self._value[path], amax.value)
                else:
                    self._key[path], self._value[path] = amax.key.clone(), amax.value.clone()
                    self._dtype[path] = amax.dtype
                if amax.search is not None:
                    self._search[path] = amax.search

    def results(self) -> dict[str, KvAmax]:
        """Each recorded attention module's amax and chosen clipping; raises CalibrationDataError when an expected
        one never ran."""
        for path in list(self._steps):
            self.finish(path)
        missing = [path for path in self.expected if path not in self._key]
        if missing or not self._key:
            raise CalibrationDataError(
                f"no keys or values were recorded for {', '.join(missing) or 'any attention layer'}: its attention "
                "does not call transformers' ALL_ATTENTION_FUNCTIONS, so fp8forge cannot compute KV-cache scales "
                "for this model; convert without kv_cache", field="kv_cache")
        return {path: KvAmax(key=self._key[path], value=self._value[path], dtype=self._dtype[path],
                             search=self._search.get(path))
                for path in sorted(self._key, key=_natural)}


def _released(module: nn.Module | None) -> bool:
    """Whether layer-sequential calibration has put ``module`` back on the meta device (it will not run again)."""
    parameter = next(module.parameters(), None) if module is not None else None
    return parameter is not None and parameter.is_meta


def _natural(path: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in path.split(".")]


def _eager_of(module: nn.Module) -> Callable:
    """The model file's own ``eager_attention_forward`` (what the module passes as get_interface's default)."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise CalibrationDataError(
            f"{type(module).__name__} runs eager attention but its module defines no eager_attention_forward; "
            "load the model with attn_implementation='sdpa' to record KV-cache scales", field="kv_cache")
    return function


def _recording(original: Callable | None) -> Callable:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> Any:
        kernel = original or _eager_of(module)
        entry = _ACTIVE.get(module)
        if entry is not None:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return kernel(module, q, k, v, *args, **kwargs)[0]  # the same mask, scaling and window

            entry[0].observe(entry[1], key, value, query=query, attend=attend)
        return kernel(module, query, key, value, *args, **kwargs)

    return attention


def _implementations(model: nn.Module) -> set[str]:
    """The attention implementations the model's modules dispatch to (composite models may mix them)."""
    names = {getattr(getattr(module, "config", None), "_attn_implementation", None) for module in model.modules()}
    return {name for name in names if isinstance(name, str)}


def _install(names: set[str]) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in names:
        original, users = _INSTALLED.get(name, (ALL_ATTENTION_FUNCTIONS.get(name), 0))
        if users == 0:
            # a local override of the shared interface; the module's own default is used for "eager"
            ALL_ATTENTION_FUNCTIONS[name] = _recording(original)
        _INSTALLED[name] = (original, users + 1)


def _uninstall(names: set[str]) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in names:
        original, users = _INSTALLED[name]
        if users > 1:
            _INSTALLED[name] = (original, users - 1)
            continue
        del _INSTALLED[name]
        del ALL_ATTENTION_FUNCTIONS[name]
        if ALL_ATTENTION_FUNCTIONS.get(name) is not original:  # it was a local override itself: put it back
            ALL_ATTENTION_FUNCTIONS[name] = original


@contextmanager
def recording_kv_amax(model: nn.Module) -> Iterator[KvCacheRecorder]:
    """Record every attention layer's key and value amax while the block runs ``model`` (or its layers).

    ``model`` may be the meta-device model that layer-sequential calibration loads layer by layer: its
    modules are registered on entry and recorded whenever they run. Several recorders (threads, nested
    blocks) may be active at once; each sees only its own model's modules. Read :meth:`KvCacheRecorder.
    results` after the block.
    """
    modules = {module: path for path, module in model.named_modules() if path}
    expected = [path for module, path in modules.items() if type(module).__name__.endswith("Attention")]
    recorder = KvCacheRecorder(expected, {path: module for module, path in modules.items()})
    names = _implementations(model)
    with _LOCK:
        _install(names)
        _ACTIVE.update({module: (recorder, path) for module, path in modules.items()})
    try:
        yield recorder
    finally:
        with _LOCK:
            for module in modules:
                if _ACTIVE.get(module, (None,))[0] is recorder:
                    del _ACTIVE[module]
            _uninstall(names)


@contextmanager
def unrecorded(module: nn.Module) -> Iterator[None]:
    """Run ``module`` (a decoder layer, say) unseen by any KV recorder for the block: a pass over other hidden
    states than the calibration's own (GPTQ's rounded stream) must not move the job's KV scales."""
    with _LOCK:
        paused = {child: _ACTIVE.pop(child) for child in module.modules() if child in _ACTIVE}
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE.update(paused)
