"""MoE experts on TransformerEngine's grouped GEMM: ``te.GroupedLinear`` per expert GEMM, with its FP8 state.

A transformers experts module (``converters.model.experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
``forward(hidden_states, top_k_index, top_k_weights)``) is replaced by :class:`GroupedExperts`: the token-expert
pairs are sorted by expert, each expert's rows padded to a multiple of 16 (TE's FP8 row alignment, what its
``Fp8Padding`` does for delayed and current scaling; zero rows change no amax), then

    gate_up_proj(x, m_splits) -> the experts class's own gating (``act_fn(gate) * up``) -> down_proj(h, m_splits)

and each pair's output is scaled by its routing weight and added back to its token (``index_add``), as the eager
forward of transformers does. A GEMM the artifact converts is a ``te.GroupedLinear(E, in, out, bias=False)`` with
``weight{e}`` = the expert's ``[out, in]`` matrix; one it leaves out stays a :class:`TorchGroupedLinear` (high
precision, the experts' own parameter).

TE source (``transformer_engine/pytorch/module/grouped_linear.py``, 2.20 development head; copies read for this
module): ``GroupedLinear(num_gemms, in_features, out_features, ..., bias=True, params_dtype=None, device="cuda")``
registers ``weight{i}`` of shape ``[out_features, in_features]`` and runs ``forward(inp, m_splits)`` on rows grouped
contiguously by GEMM; its FP8 metadata holds ``num_gemms * 3`` forward and ``num_gemms * 2`` backward slots
(``base.py`` ``set_meta_tensor``), GEMM i's input/weight/output at ``3i``/``3i+1``/``3i+2`` (``self._offsets``,
``self._num_fp8_tensors_per_gemm``): the layout ``converters.backends.te.layout`` stores. The state is written as for
``te.Linear`` (``te_state``): ``init_fp8_metadata(num_gemms=E)`` inside a calibrating autocast, then in-place copies.

TransformerEngine is imported only through :func:`te_module`; routing and the torch grouped GEMM need no TE.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converters.backends.te.layout import TE_STATE_NAMES
from converters.backends.te.runtime import build_te_recipe, te_autocast, te_module
from converters.backends.te.state import check_state_tensors, write_state
from converters.errors import ConversionError
from converters.model.experts import EXPERT_GEMMS, find_experts
from converters.recipes import TEDelayedScalingRecipe

__all__ = ["FP8_ROW_ALIGN", "ExpertRouting", "route_tokens", "GroupedExperts", "TorchGroupedLinear",
           "check_grouped_state", "convert_experts_to_te", "apply_grouped_state"]

logger = logging.getLogger(__name__)

FP8_ROW_ALIGN = 16  # TE Fp8Padding's alignment for FP8 recipes other than MXFP8 (32)
_SLOTS = {"scale_fwd": 3, "amax_history_fwd": 3, "scale_bwd": 2, "amax_history_bwd": 2}


@dataclass(frozen=True)
class ExpertRouting:
    """Where each routed token-expert pair sits in the expert-grouped (and padded) rows."""

    token_index: torch.Tensor  #: [S] token of each pair, pairs ordered by expert
    pair_index: torch.Tensor  #: [S] flat index of each pair into top_k_index / top_k_weights
    rows: torch.Tensor  #: [S] row of each pair in the grouped input
    m_splits: list[int]  #: rows per expert (padded), what GroupedLinear takes
    num_rows: int


def route_tokens(top_k_index: torch.Tensor, num_experts: int, *, align: int = 1) -> ExpertRouting:
    """Sort the token-expert pairs by expert and lay each expert's rows out padded to a multiple of ``align``.

    Pairs routed to an expert id outside ``[0, num_experts)`` (transformers' expert-parallel sentinel) are dropped,
    as the eager forward skips them.
    """
    top_k = top_k_index.shape[-1]
    expert_ids, pair_index = torch.sort(top_k_index.reshape(-1), stable=True)
    kept = (expert_ids >= 0) & (expert_ids < num_experts)
    expert_ids, pair_index = expert_ids[kept], pair_index[kept]
    counts = torch.bincount(expert_ids, minlength=num_experts)
    padded = (counts + align - 1) // align * align
    position = torch.arange(expert_ids.numel(), device=expert_ids.device)
    rows = position - (torch.cumsum(counts, 0) - counts)[expert_ids] + (torch.cumsum(padded, 0) - padded)[expert_ids]
    m_splits = [int(n) for n in padded.tolist()]
    return ExpertRouting(token_index=pair_index // top_k, pair_index=pair_index, rows=rows, m_splits=m_splits,
                         num_rows=sum(m_splits))


class TorchGroupedLinear(nn.Module):
    """A grouped GEMM in plain torch on ``weight [E, out, in]``: for an expert GEMM left in high precision."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        chunks = inp.split(list(m_splits))
        return torch.cat([nn.functional.linear(chunk, self.weight[e]) for e, chunk in enumerate(chunks)])


class GroupedExperts(nn.Module):
    """Replaces a transformers experts module: its two GEMMs as grouped GEMMs (``forward(inp, m_splits)``).

    Takes the experts' ``act_fn`` and gating (``_apply_gate``: ``act_fn(gate) * up`` for the layouts fp8forge
    converts); its forward matches the experts' eager forward.
    """

    def __init__(self, experts: nn.Module, gate_up_proj: nn.Module, down_proj: nn.Module, *, align: int) -> None:
        super().__init__()
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.align = align
        self.act_fn = experts.act_fn
        self._gate = type(experts)._apply_gate
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = route_tokens(top_k_index, self.num_experts, align=self.align)
        rows = hidden_states.new_zeros(routing.num_rows, hidden_states.shape[-1])
        rows = rows.index_copy(0, routing.rows, hidden_states[routing.token_index])
        out = self.down_proj(self._gate(self, self.gate_up_proj(rows, routing.m_splits)), routing.m_splits)
        weighted = out[routing.rows] * top_k_weights.reshape(-1)[routing.pair_index, None]
        return torch.zeros_like(hidden_states).index_add(0, routing.token_index, weighted.to(hidden_states.dtype))


def check_grouped_state(path: str, tensors: Mapping[str, torch.Tensor], history_len: int) -> int:
    """Check one experts GEMM's GroupedLinear state (``[3E]``, ``[L,3E]``, ``[2E]``, ``[L,2E]``); returns E.

    Each expert's slots are checked as a te.Linear's (:func:`check_state_tensors`). Pure tensor check (no TE).
    Raises ConversionError naming the GEMM and the tensor.
    """
    if set(tensors) != set(TE_STATE_NAMES):
        raise ConversionError(f"{path}: scaling state has {sorted(tensors)}, expected {list(TE_STATE_NAMES)}")
    scale = tensors["scale_fwd"]
    num = scale.shape[0] // 3 if isinstance(scale, torch.Tensor) and scale.dim() == 1 else 0
    for name, width in _SLOTS.items():
        tensor = tensors[name]
        shape = (width * num,) if name.startswith("scale") else (history_len, width * num)
        if num == 0 or not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            expected = shape if num else "[3E] (E >= 1 experts)"
            raise ConversionError(f"{path}.{name}: shape {got}, expected {expected} for GroupedLinear state "
                                  f"(amax_history_len={history_len})")
    for e in range(num):
        check_state_tensors(f"{path} (expert {e})",
                            {name: tensors[name][..., width * e:width * (e + 1)] for name, width in _SLOTS.items()},
                            history_len)
    return num


def convert_experts_to_te(model: nn.Module, gemm_paths: Sequence[str], *,
                          device: str | torch.device = "cuda") -> list[str]:
    """Replace the experts modules of ``gemm_paths`` (``<experts>.<gate_up_proj|down_proj>``) by GroupedExperts.

    A listed GEMM becomes a ``te.GroupedLinear`` on ``device`` in the experts' dtype; the other GEMM of the same
    module stays a TorchGroupedLinear (moved with the model). Returns the listed paths. Raises
    BackendUnavailableError without CUDA/TE; ConversionError for a malformed or duplicate path, a module that is
    not an experts module of a layout fp8forge converts, or when the te.GroupedLinear paths after the swap differ.
    """
    te = te_module()
    wanted = _gemms_by_module(gemm_paths)
    blocks = {block.path: block for block in find_experts(model.named_modules())}
    for module_path, gemms in wanted.items():
        block = blocks.get(module_path)
        if block is None or not block.supported:
            why = block.why_not if block is not None else "no fused experts module there"
            raise ConversionError(f"{module_path}: cannot run it on TE GroupedLinear ({why})")
        experts = model.get_submodule(module_path)
        built = {gemm: _te_grouped_linear(te, getattr(experts, gemm), device) if gemm in gemms
                 else TorchGroupedLinear(getattr(experts, gemm)) for gemm in EXPERT_GEMMS}
        parent, _, name = module_path.rpartition(".")
        setattr(model.get_submodule(parent), name, GroupedExperts(experts, **built, align=FP8_ROW_ALIGN))
    converted = sorted(path for path, module in model.named_modules() if isinstance(module, te.GroupedLinear))
    if converted != sorted(gemm_paths):
        raise ConversionError(f"expected {len(gemm_paths)} te.GroupedLinear modules after the swap, found "
                              f"{len(converted)} (unexpected: {sorted(set(converted) - set(gemm_paths))[:5]})")
    logger.info("converted %d expert GEMMs to te.GroupedLinear on %s", len(converted), device)
    return list(gemm_paths)


def _gemms_by_module(gemm_paths: Sequence[str]) -> dict[str, set[str]]:
    wanted: dict[str, set[str]] = {}
    for path in gemm_paths:
        module_path, _, gemm = str(path).rpartition(".")
        if gemm not in EXPERT_GEMMS or not module_path or gemm in wanted.get(module_path, ()):
            raise ConversionError(f"converted expert GEMM {path!r} is not a distinct <experts module>.<gemm> path "
                                  f"(gemm one of {EXPERT_GEMMS})")
        wanted.setdefault(module_path, set()).add(gemm)
    return wanted


def _te_grouped_linear(te: Any, weight: nn.Parameter, device: str | torch.device) -> nn.Module:
    num, out_features, in_features = weight.shape
    grouped = te.GroupedLinear(num, in_features, out_features, bias=False, params_dtype=weight.dtype, device=device)
    if getattr(grouped, "weight0", None) is None:  # TE's single-parameter mode (NVTE_GROUPED_LINEAR_SINGLE_PARAM)
        raise ConversionError("this TE GroupedLinear holds one grouped weight, not weight0..weightN; unset "
                              "NVTE_GROUPED_LINEAR_SINGLE_PARAM to load fp8forge artifacts")
    with torch.no_grad():
        for e in range(num):
            getattr(grouped, f"weight{e}").copy_(weight[e])
            getattr(grouped, f"weight{e}").requires_grad_(weight.requires_grad)
    return grouped


def apply_grouped_state(model: nn.Module, states: Mapping[str, Mapping[str, torch.Tensor]],
                        recipe: TEDelayedScalingRecipe) -> None:
    """Load each experts GEMM's delayed-scaling state (te_layout names, GroupedLinear slot order) into the
    ``te.GroupedLinear`` at its path, as :func:`converters.backends.te.state.apply_scaling_state` does for te.Linear.

    Raises BackendUnavailableError without CUDA/TE; ConversionError for a recipe other than delayed scaling, a path
    that is not a te.GroupedLinear, or state that fails :func:`check_grouped_state` or does not match the module's
    number of GEMMs.
    """
    te = te_module()
    if not isinstance(recipe, TEDelayedScalingRecipe):
        raise ConversionError(f"only delayed scaling carries state; got a {type(recipe).__name__}")
    modules = {}
    for path, tensors in states.items():
        module = _submodule(model, path)
        if not isinstance(module, te.GroupedLinear):
            raise ConversionError(f"{path!r} is a {type(module).__name__}, not a te.GroupedLinear; "
                                  "run convert_experts_to_te first")
        num = check_grouped_state(path, tensors, recipe.amax_history_len)
        if num != module.num_gemms:
            raise ConversionError(f"{path}: state for {num} experts, the module runs {module.num_gemms}")
        modules[path] = module
    with te_autocast(te, enabled=False, calibrating=True, recipe=build_te_recipe(recipe)):
        for module in modules.values():
            module.init_fp8_metadata(num_gemms=module.num_gemms)
    for path, module in modules.items():
        write_state(path, module, states[path])


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else None
    except AttributeError:
        return None
