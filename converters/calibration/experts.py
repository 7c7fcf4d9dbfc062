"""Per-expert amax: what each expert GEMM sees, measured on the tokens the router sends to that expert.

A forward pre-hook on each fused experts module reads the call's own routing (``hidden_states``,
``top_k_index``) and, for every expert that received tokens, computes that expert's two GEMMs on exactly those
tokens: input, weight and output amax of ``gate_up_proj``, then of ``down_proj`` (whose input is the gated
activation). The numbers come from the routing and the weights alone, so every ``experts_implementation``
(eager, grouped_mm, batched_mm) gives the same ones; the cost is one more pass through the experts during
calibration, and the model's own forward is left untouched.

An expert that receives no token in a step records input and output amax 0 for that step, as TE's grouped
GEMM leaves the slots of an empty split (its delayed-scaling update then skips the roll and keeps the scale);
the weight amax is recorded every step, as TE casts every expert's weight. With an SQNR meter
(``converters.calibration.sensitivity``), each expert's GEMMs are measured on the same routed tokens, and each unit's
weight
once.

With ``backward``, a hook on the experts module's output receives the gradient of the module's output ``G``
and works each routed expert's GEMM gradients out from it on the same tokens: the experts module sums
``w * y`` over a token's experts (``w`` its routing weight), so ``down_proj``'s grad_output is ``w * G`` on the
expert's tokens, its grad_input that times the expert's ``down_proj`` weight; ``gate_up_proj``'s grad_output is
the gradient through the gate (autograd on the recomputed activation), its grad_input that times its weight.
These are what TE's GroupedLinear casts in backward (its grad_input slots stay unwritten, as for a te.Linear).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from converters.model.experts import parse_unit_path

if TYPE_CHECKING:
    from converters.calibration.sqnr_meter import SqnrMeter

__all__ = ["ExpertsRecorder", "routing"]


def _amax(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    return tensor.detach().abs().max().float().cpu()


def routing(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index, top_k_weights)`` of an experts module call, given by position or name."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    return tuple(args[i] if len(args) > i else kwargs[name] for i, name in enumerate(names))


class ExpertsRecorder:
    """Amax per expert GEMM unit and step, and the tokens each expert received per step.

    ``modules`` maps each experts module path to the module; ``units`` are the unit paths to record (an experts
    module with no listed unit gets no hook). The caller sets :attr:`step` before each step. ``sqnr``, if given,
    receives every unit's weight and each routed expert's GEMM inputs.
    """

    def __init__(self, modules: Mapping[str, nn.Module], units: list[str], steps: int, *,
                 sqnr: SqnrMeter | None = None, backward: bool = False) -> None:
        self.step = 0
        self.sqnr = sqnr
        self.wanted: dict[str, set[tuple[int, str]]] = {}
        for unit in units:
            parsed = parse_unit_path(unit)
            self.wanted.setdefault(parsed.module, set()).add((parsed.index, parsed.gemm))
        self.modules = {path: modules[path] for path in self.wanted}
        self.forward = {unit: torch.zeros(steps, 3) for unit in units}
        #: ``[steps, 2]`` per unit: grad_output, grad_input amax (None: no backward recorded)
        self.backward = {unit: torch.zeros(steps, 2) for unit in units} if backward else None
        self.tokens = {path: torch.zeros(steps, module.gate_up_proj.shape[0], dtype=torch.int64)
                       for path, module in self.modules.items()}

    def hooks(self) -> list[tuple[nn.Module, Callable[..., None]]]:
        """``(module, forward pre-hook taking (module, args, kwargs))`` pairs to register."""
        return [(module, self._hook(path)) for path, module in self.modules.items()]

    def gradient_hooks(self) -> list[tuple[nn.Module, Callable[..., None]]]:
        """``(module, forward hook taking (module, args, kwargs, output))`` pairs to register when recording the
        backward: each hooks the output's gradient of that call."""
        if self.backward is None:
            return []
        return [(module, self._gradient_hook(path)) for path, module in self.modules.items()]

    def _gradient_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor) -> None:
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            hidden, top_k_index, top_k_weights = (t.detach() for t in routing(args, kwargs))
            step = self.step  # the gradient arrives in this step's backward, after the forward hooks ran

            def on_gradient(grad: torch.Tensor) -> None:
                self._record_gradients(path, module, step, hidden, top_k_index, top_k_weights, grad)

            output.register_hook(on_gradient)

        return hook

    def _record_gradients(self, path: str, module: nn.Module, step: int, hidden: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor, grad: torch.Tensor) -> None:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        grad = grad.reshape(-1, grad.shape[-1])
        routed = top_k_index.reshape(hidden.shape[0], -1)
        weights = top_k_weights.reshape(hidden.shape[0], -1)
        for index in sorted({index for index, _ in self.wanted[path]}):
            chosen = routed == index
            tokens = chosen.any(dim=-1)
            if not tokens.any():
                continue  # no gradient reached this expert: 0, as for its forward
            gate_up_weight = module.gate_up_proj[index].detach()
            down_weight = module.down_proj[index].detach()
            with torch.enable_grad():
                gate_up = nn.functional.linear(hidden[tokens], gate_up_weight).requires_grad_()
                activated = module._apply_gate(gate_up)
            grad_down_out = grad[tokens] * (weights * chosen).sum(dim=-1)[tokens, None].to(grad.dtype)
            grad_down_in = grad_down_out @ down_weight
            (grad_gate_up_out,) = torch.autograd.grad(activated, gate_up, grad_outputs=grad_down_in)
            grad_gate_up_in = grad_gate_up_out @ gate_up_weight
            for gemm, (out, inp) in (("gate_up_proj", (grad_gate_up_out, grad_gate_up_in)),
                                     ("down_proj", (grad_down_out, grad_down_in))):
                unit = f"{path}.{index}.{gemm}"
                if unit in self.backward:
                    values = torch.stack([_amax(out), _amax(inp)])
                    self.backward[unit][step] = torch.fmax(self.backward[unit][step], values)

    def _hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden, top_k_index, _ = routing(args, kwargs)
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
