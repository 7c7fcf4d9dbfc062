"""Per-expert amax: what each expert GEMM sees, measured on the tokens the router sends to that expert.

A forward pre-hook on each fused experts module reads the call's own routing (``hidden_states``,
``top_k_index``) and, for every expert that received tokens, computes that expert's two GEMMs on exactly those
tokens: input, weight and output amax of ``gate_up_proj``, then of ``down_proj`` (whose input is the gated
activation). The numbers come from the routing and the weights alone, so every ``experts_implementation``
(eager, grouped_mm, batched_mm) gives the same ones; the cost is one more pass through the experts during
calibration, and the model's own forward is left untouched.

An expert that receives no token in a step records input and output amax 0 for that step, as TE's grouped
GEMM leaves the slots of an empty split (its delayed-scaling update then skips the roll and keeps the scale);
the weight amax is recorded every step, as TE casts every expert's weight. Gradients of experts are not
recorded: their backward state stays TE's initial one. With an SQNR meter (``converters.sensitivity``), each
expert's GEMMs are measured on the same routed tokens, and each unit's weight once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from converters.experts import parse_unit_path

if TYPE_CHECKING:
    from converters.sensitivity import SqnrMeter

__all__ = ["ExpertsRecorder"]


def _amax(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    return tensor.detach().abs().max().float().cpu()


class ExpertsRecorder:
    """Amax per expert GEMM unit and step, and the tokens each expert received per step.

    ``modules`` maps each experts module path to the module; ``units`` are the unit paths to record (an experts
    module with no listed unit gets no hook). The caller sets :attr:`step` before each step. ``sqnr``, if given,
    receives every unit's weight and each routed expert's GEMM inputs.
    """

    def __init__(self, modules: Mapping[str, nn.Module], units: list[str], steps: int, *,
                 sqnr: SqnrMeter | None = None) -> None:
        self.step = 0
        self.sqnr = sqnr
        self.wanted: dict[str, set[tuple[int, str]]] = {}
        for unit in units:
            parsed = parse_unit_path(unit)
            self.wanted.setdefault(parsed.module, set()).add((parsed.index, parsed.gemm))
        self.modules = {path: modules[path] for path in self.wanted}
        self.forward = {unit: torch.zeros(steps, 3) for unit in units}
        self.tokens = {path: torch.zeros(steps, module.gate_up_proj.shape[0], dtype=torch.int64)
                       for path, module in self.modules.items()}

    def hooks(self) -> list[tuple[nn.Module, Callable[..., None]]]:
        """``(module, forward pre-hook taking (module, args, kwargs))`` pairs to register."""
        return [(module, self._hook(path)) for path, module in self.modules.items()]

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            with torch.no_grad():
                self._record(path, module, hidden, top_k_index)

        return hook

    def _record(self, path: str, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        routed = top_k_index.reshape(hidden.shape[0], -1)
        num_experts = module.gate_up_proj.shape[0]
        counts = torch.bincount(routed.flatten().cpu(), minlength=num_experts + 1)[:num_experts]
        self.tokens[path][self.step] += counts  # a module called twice in a step adds both calls' tokens
        for index, gemm in self.wanted[path]:
            unit = f"{path}.{index}.{gemm}"
            weight = getattr(module, gemm)[index]
            self.forward[unit][self.step, 1] = torch.fmax(self.forward[unit][self.step, 1], _amax(weight))
            if self.sqnr is not None:
                self.sqnr.observe_weight(unit, weight)
        for index in sorted({index for index, _ in self.wanted[path]}):
            if not counts[index]:
                continue  # input and output stay 0 this step
            tokens = (routed == index).any(dim=-1)
            x = hidden[tokens]
            gate_up = nn.functional.linear(x, module.gate_up_proj[index])
            activated = module._apply_gate(gate_up)
            down = nn.functional.linear(activated, module.down_proj[index])
            for gemm, (inp, out) in (("gate_up_proj", (x, gate_up)), ("down_proj", (activated, down))):
                unit = f"{path}.{index}.{gemm}"
                if unit in self.forward:
                    row = self.forward[unit][self.step]
                    row[0] = torch.fmax(row[0], _amax(inp))
                    row[2] = torch.fmax(row[2], _amax(out))
                    if self.sqnr is not None:
                        self.sqnr.observe(unit, self.step, inp, getattr(module, gemm)[index], output=out)

    def tokens_per_step(self, unit: str) -> torch.Tensor:
        """``[steps]``: tokens the unit's expert received at each step."""
        parsed = parse_unit_path(unit)
        return self.tokens[parsed.module][:, parsed.index].clone()
