"""GPTQ rounding of a decoder layer's MoE expert matrices, each expert's Hessians from the tokens routed to it.

An expert GEMM sees only the tokens the router sends to that expert, so each expert has its own Hessians: its
``gate_up_proj`` inputs are those tokens' hidden states, its ``down_proj`` inputs their gated activations. A forward
pre-hook on the fused experts module keeps each call's hidden states and routing (what the module receives on the
rounded stream, kept until the layer is rounded: as much memory as one more copy of the layer's hidden states); the
Hessians are then built one expert at a time, so a layer holds one expert's two Hessians at once (Qwen3-30B-A3B:
2048^2 + 768^2 fp64 values, 38 MB), not every expert's (5 GB).
All Hessians come from the layer's weights before any of its matrices is rounded, as for the Linears
(:mod:`converters.calibration.gptq_rounding`).

The on-disk matrices of a unit (a Mixtral ``w1`` and ``w3``, a Qwen ``gate_proj`` and ``up_proj``) are row blocks of
the fused ``gate_up_proj[e]`` in the order :func:`~converters.serving.selection.expert_disk_keys` lists them; each
is rounded under its own scales with the unit's weight amax, as the writer quantizes it. An expert no calibration
token reached has no Hessian and keeps round to nearest (the writer's cast).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from converters.calibration.experts import routing
from converters.model.experts import parse_unit_path

__all__ = ["ExpertCalls", "ExpertMatrices", "expert_matrices"]


@dataclass
class ExpertMatrices:
    """One experts module's units to round: ``units[(expert, gemm)]`` = the unit's on-disk keys in row order."""

    path: str
    units: dict[tuple[int, str], list[str]] = field(default_factory=dict)

    @property
    def experts(self) -> list[int]:
        return sorted({index for index, _ in self.units})


def expert_matrices(unit_keys: dict[str, list[str]]) -> list[ExpertMatrices]:
    """``unit_keys`` (unit path -> its on-disk keys) by experts module, in module order."""
    modules: dict[str, ExpertMatrices] = {}
    for unit, keys in unit_keys.items():
        parsed = parse_unit_path(unit)
        modules.setdefault(parsed.module, ExpertMatrices(parsed.module)).units[(parsed.index, parsed.gemm)] = keys
    return [modules[path] for path in sorted(modules)]


class ExpertCalls:
    """What an experts module received in the calls of a block: hidden states and routing, one pair per call."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden, top_k_index, _ = routing(args, kwargs)
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        self.calls.append((hidden, top_k_index.detach().reshape(hidden.shape[0], -1)))

    def inputs(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert's ``gate_up_proj`` and ``down_proj`` inputs (rows: its routed tokens), from its weights as
        they are now."""
        hidden = [states[(routed == expert).any(dim=-1)] for states, routed in self.calls]
        gate_up = self.module.gate_up_proj
        x = torch.cat(hidden) if hidden else gate_up.new_empty(0, gate_up.shape[-1])
        with torch.no_grad():
            activated = self.module._apply_gate(nn.functional.linear(x, gate_up[expert]))
        return x, activated
