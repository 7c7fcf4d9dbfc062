"""GPTQ rounding of a job's NVFP4 serving exports, inside the layer-sequential calibration walk.

GPTQ (:mod:`converters.serving.nvfp4_gptq`) needs each Linear's input Hessian ``2 X^T X / n``: ``in^2`` fp64 values
per fused group, too many to keep for the whole model until export (SmolLM2-135M: 0.8 GB; an 8B Llama's 14336-wide
``down_proj`` alone 1.6 GB). So each decoder layer is rounded while it is in memory, as an ``after_layer`` of
:func:`~converters.calibration.sequential.calibrate_layer_by_layer`, and only the three tensors the export writes
per weight (packed codes, E4M3 block scales, global scale: about 0.56 bytes a weight) go to a file of that layer in
the run's rounded-weights directory; the serving writer copies them in place of its round-to-nearest cast
(:attr:`~converters.serving.selection.ServingSelection.rounded`).

The Hessians come from a second stream of hidden states, the one the already-rounded layers give (llm-compressor's
sequential pipeline does the same): per layer, the stream runs through the layer once with hooks on each fused
group's shared input, the groups are rounded, then the stream runs once more with the layer's weights replaced by
their rounded values to become the next layer's input. The calibration's own stream, and so every amax and scale
of the job, stays the high-precision model's. Cost: two more forwards of each layer over the calibration batches,
one copy of the cached hidden states, one layer's Hessians, and GPTQ's column loop.

The scales are the writer's, chosen from the weight before any rounding (each format's ``rounding_scales``: for
compressed-tensors the fused group's global scale and the recipe's ``nvfp4_weight_scales`` block scales, for
ModelOpt its ``weight_scale_2`` and block scales). Formats whose steps differ are a ``rounding_family`` each
(``nvfp4`` and ``nvfp4-a16`` are one), and each family has its own stream: its Hessians come from the inputs its
own rounded layers give, as if it were the job's only export (a stream of another family's codes costs a ModelOpt
export measurably: docs/benchmarks/nvfp4-gptq-job-2026-12-04.md). The forwards and the copy of the hidden states
are per family. MoE expert matrices are rounded expert by expert, each from the tokens routed to it
(:mod:`converters.calibration.gptq_experts`).

In a data-parallel walk (torch.distributed ranks, each running its share of the steps), each group's Hessian is the
SUM over the ranks of their steps' ``X^T X`` and rows, rank 0 rounds and broadcasts the codes, and every rank runs
its steps of the stream with them; rank 0 alone stores the files (it writes the export). A resume record
(:mod:`converters.distributed.resume`) keeps each family's stream and the rounded files per finished layer, so a
restarted job continues at its first unfinished layer (:meth:`GptqRounding.resume`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from safetensors.torch import save_file

from converters.calibration.gptq_experts import ExpertCalls, ExpertMatrices, expert_matrices
from converters.calibration.kv_cache import unrecorded
from converters.calibration.layer_replay import under
from converters.calibration.sequential import LayerPass
from converters.casts.emulation import max_abs
from converters.model.experts import EXPERT_GEMMS, unit_path
from converters.model.threads import one_intra_op_thread
from converters.serving.nvfp4 import pack_e2m1_codes
from converters.serving.nvfp4_codes import dequantize_stepped
from converters.serving.nvfp4_gptq import ROUNDED_TENSORS, HessianAccumulator, gptq_codes_stepped
from converters.serving.selection import ServingSelection

__all__ = ["ROUNDED_DIR", "GptqRounding"]

#: the rounded-weights directory, under the run's staging directory (removed once the serving exports are written)
ROUNDED_DIR = ".rounded-weights"


class GptqRounding:
    """``after_layer`` callback: round each decoder layer's NVFP4-exported Linears by GPTQ and store the results.

    ``exports``: the job's NVFP4 serving formats (each with a ``rounding_family``) and their selections, in the job's
    order. ``directory``: where the per-layer files go (None: a rank that does not write the export keeps none).
    ``scale_dtype``: the model's dtype, the one the writer computes scales in. ``block_scales``: the recipe's
    ``nvfp4_weight_scales``, for the report. ``ranked``: one rank of a data-parallel walk (the default process
    group's collectives combine the ranks). ``stays_high_precision(path)``: whether a Linear the calibration has just
    measured will be left out of the conversion (``min_sqnr_db``); it and its fused group are neither rounded nor
    rounded in the stream.
    """

    def __init__(self, exports: Iterable[tuple[Any, ServingSelection]], directory: Path | None,
                 scale_dtype: torch.dtype, *, block_scales: str = "rtn", act_order: bool = True,
                 ranked: bool = False, stays_high_precision: Callable[[str], bool] | None = None) -> None:
        #: family -> (a format of it, Linear path -> on-disk weight key)
        self.families: dict[str, tuple[Any, dict[str, str]]] = {}
        self.group_of: dict[str, list[str]] = {}  #: Linear path -> the quantized members of its fused group
        #: family -> expert unit -> its on-disk matrices, in the order of the unit's rows
        self.expert_keys: dict[str, dict[str, list[str]]] = {}
        for fmt, selection in exports:
            self.families.setdefault(fmt.rounding_family, (fmt, {}))[1].update(selection.quantized)
            units = self.expert_keys.setdefault(fmt.rounding_family, {})
            for key, unit in selection.experts.items():
                matrix_keys = units.setdefault(unit, [])
                if key not in matrix_keys:
                    matrix_keys.append(key)
            for members in selection.fused_groups:
                self.group_of.update({member: list(members) for member in members})
        self.directory, self.scale_dtype = directory, scale_dtype
        self.block_scales, self.act_order = block_scales, act_order
        self.stays_high_precision = stays_high_precision or (lambda path: False)
        self.ranked = ranked and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self.leader = not self.ranked or torch.distributed.get_rank() == 0
        #: family -> on-disk weight key -> its file in ``directory``
        self.rounded: dict[str, dict[str, str]] = {family: {} for family in self.families}
        self.seconds = 0.0  #: wall seconds spent here (the extra forwards and the rounding)
        self._streams: dict[str, list[torch.Tensor]] | None = None  #: family -> its rounded stream

    def __call__(self, layer_pass: LayerPass) -> None:
        started = time.perf_counter()
        if self._streams is None:  # the first layer's inputs: no layer before it is rounded
            self._streams = {family: list(layer_pass.inputs) for family in self.families}
        device = layer_pass.inputs[0].device  # a resume record's streams were read to host memory
        self._streams = {family: [hidden.to(device) for hidden in stream] for family, stream in self._streams.items()}
        for family, (_, keys) in self.families.items():
            stream = self._streams[family]
            paths = [path for path in keys if under(path, layer_pass.path) and not self._left_out(path)]
            experts = self._experts_in(layer_pass, family)
            replaced = self._round_layer(layer_pass, family, paths, experts, stream) if paths or experts else {}
            with _weights_replaced(layer_pass, replaced):
                self._streams[family] = self._forward(layer_pass, stream)
        self.seconds += time.perf_counter() - started

    def _experts_in(self, layer_pass: LayerPass, family: str) -> list[ExpertMatrices]:
        """The layer's experts modules ``family`` rounds (none that ends in high precision)."""
        units = {unit: keys for unit, keys in self.expert_keys[family].items() if under(unit, layer_pass.path)}
        return [matrices for matrices in expert_matrices(units) if not self._experts_left_out(matrices)]

    def _round_layer(self, layer_pass: LayerPass, family: str, paths: list[str], experts: list[ExpertMatrices],
                     stream: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Round the layer's Linears ``paths`` (by fused group) and ``experts`` from their Hessians on ``stream`` and
        store them; returns the rounded values by parameter path (for the stream's next pass)."""
        fmt, keys = self.families[family]
        groups = self._groups(paths)
        calls = [ExpertCalls(layer_pass.layer.get_submodule(_relative(layer_pass, matrices.path)))
                 for matrices in experts]
        hessians = self._hessians(layer_pass, groups, stream, calls)
        rounded, replaced = {}, {}
        for group in groups:
            for path, result in self._round_group(layer_pass, fmt, group, hessians).items():
                rounded[keys[path]] = result
                replaced[f"{path}.weight"] = result[1]
        for matrices, module_calls in zip(experts, calls, strict=True):
            expert_rounded, expert_replaced = self._round_experts(fmt, matrices, module_calls)
            rounded.update(expert_rounded)
            replaced.update(expert_replaced)
        self._save(layer_pass.index, family, rounded)
        return replaced

    def streams(self) -> dict[str, list[torch.Tensor]]:
        """Each family's stream after the last layer rounded: the next layer's input (for a resume record)."""
        return dict(self._streams or {})

    def layer_files(self, index: int) -> dict[str, dict[str, str]]:
        """Family -> weight key -> file of layer ``index``'s rounded weights (those this process stored)."""
        prefix = f"layer-{index:05d}-"
        files = {family: {key: name for key, name in rounded.items() if name.startswith(prefix)}
                 for family, rounded in self.rounded.items()}
        return {family: named for family, named in files.items() if named}

    def resume(self, streams: dict[str, list[torch.Tensor]], finished: list[dict[str, dict[str, str]]]) -> None:
        """Continue after a resume record's finished layers: their streams' last outputs (this process's steps)
        and the files of the weights they rounded (already back in ``directory``)."""
        self._streams = streams
        for files in finished:
            for family, named in files.items():
                self.rounded.setdefault(family, {}).update(named)

    def summary(self) -> dict[str, Any]:
        """The report's record of the rounding: method, weights rounded per family, seconds."""
        return {"method": "gptq", "act_order": self.act_order, "block_scales": self.block_scales,
                "weights": {family: len(keys) for family, keys in self.rounded.items()},
                "seconds": round(self.seconds, 3)}

    def _left_out(self, path: str) -> bool:
        """Whether ``path`` ends in high precision: it or a member of its fused group stays so (the serving
        selection leaves a partly quantized group out whole: engines fuse its projections)."""
        return any(self.stays_high_precision(member) for member in self.group_of.get(path, [path]))

    def _experts_left_out(self, matrices: ExpertMatrices) -> bool:
        """Whether an experts module ends in high precision (the selection keeps it whole: one unit in high
        precision leaves every unit there)."""
        return any(self.stays_high_precision(unit_path(matrices.path, expert, gemm)) for expert, gemm in matrices.units)

    def _groups(self, paths: list[str]) -> list[list[str]]:
        """``paths`` by fused group, in layer order; a group's first member is where its Hessian is recorded."""
        groups: list[list[str]] = []
        seen: set[str] = set()
        for path in paths:
            if path not in seen:
                group = [member for member in self.group_of.get(path, [path]) if member in paths]
                groups.append(group)
                seen.update(group)
        return groups

    def _hessians(self, layer_pass: LayerPass, groups: list[list[str]], stream: list[torch.Tensor],
                  calls: list[ExpertCalls]) -> dict[str, HessianAccumulator]:
        """Each group's input Hessian over ``stream``, for every member (a fused group's members share their
        input); ``calls`` record what their experts modules receive in the same forward."""
        hessians, handles = {}, []
        for group in groups:
            module = _linear(layer_pass, group[0])
            accumulator = HessianAccumulator(module.in_features, module.weight.device)
            hessians.update({member: accumulator for member in group})
            handles.append(module.register_forward_pre_hook(
                lambda _, args, accumulator=accumulator: accumulator.add(args[0].detach())))
        try:
            with ExitStack() as recording:
                for module_calls in calls:
                    recording.enter_context(module_calls.recording())
                self._forward(layer_pass, stream)
        finally:
            for handle in handles:
                handle.remove()
        self._all_ranks(list({id(accumulator): accumulator for accumulator in hessians.values()}.values()))
        return hessians

    def _all_ranks(self, accumulators: list[HessianAccumulator]) -> None:
        """In a data-parallel walk, each accumulator becomes the SUM over every rank's steps (one collective for
        the row counts); nothing otherwise."""
        if not self.ranked:
            return
        rows = torch.tensor([accumulator.rows for accumulator in accumulators], dtype=torch.int64)
        torch.distributed.all_reduce(rows)
        for accumulator, total in zip(accumulators, rows.tolist(), strict=True):
            accumulator.sum.copy_(_all_ranks_sum(accumulator.sum))
            accumulator.rows = total

    def _round_group(self, layer_pass: LayerPass, fmt: Any, group: list[str],
                     hessians: dict[str, HessianAccumulator]) -> dict[str, tuple[list[torch.Tensor], torch.Tensor]]:
        """Each member of ``group`` under ``fmt``'s scales: its three written tensors and its rounded values (fp32)."""
        weights = {path: _linear(layer_pass, path).weight.detach().to(self.scale_dtype) for path in group}
        amax = max(float(max_abs(weight).float()) for weight in weights.values()) + 0.0  # the writer's weight_amax
        matrix = hessians[group[0]].matrix
        return {path: self._round(fmt, weight, matrix, amax) for path, weight in weights.items()}

    def _round_experts(self, fmt: Any, matrices: ExpertMatrices, calls: ExpertCalls
                       ) -> tuple[dict[str, tuple[list[torch.Tensor], torch.Tensor]], dict[str, torch.Tensor]]:
        """An experts module's matrices, expert by expert: the rounded tensors per on-disk key, and the module's
        fused parameters with the rounded values in place (for the stream)."""
        module = calls.module
        fused = {gemm: getattr(module, gemm).detach().clone() for gemm in EXPERT_GEMMS}
        rounded = {}
        for expert in matrices.experts:  # every rank in the same order: the reductions pair up
            inputs = dict(zip(EXPERT_GEMMS, calls.inputs(expert), strict=True))
            wanted = [gemm for gemm in EXPERT_GEMMS if (expert, gemm) in matrices.units]
            accumulators = {gemm: HessianAccumulator(inputs[gemm].shape[-1], fused[gemm].device) for gemm in wanted}
            for gemm, accumulator in accumulators.items():
                accumulator.add(inputs[gemm])
            self._all_ranks(list(accumulators.values()))
            for gemm, accumulator in accumulators.items():
                if not accumulator.rows:
                    continue  # no token reached the expert: the writer rounds it to nearest
                weight = getattr(module, gemm)[expert].detach().to(self.scale_dtype)
                amax = float(max_abs(weight).float()) + 0.0  # the unit's: its matrices share it
                keys = matrices.units[(expert, gemm)]
                results = [self._round(fmt, rows, accumulator.matrix, amax) for rows in weight.chunk(len(keys))]
                rounded.update(zip(keys, results, strict=True))
                fused[gemm][expert] = torch.cat([values for _, values in results]).to(fused[gemm].dtype)
        return rounded, {f"{matrices.path}.{gemm}": value for gemm, value in fused.items()}

    def _round(self, fmt: Any, weight: torch.Tensor, matrix: torch.Tensor, amax: float
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``weight`` under ``fmt``'s scales by GPTQ with the Hessian ``matrix``: its three written tensors and its
        rounded values (fp32); rank 0 rounds, every rank gets its codes."""
        step, scales = fmt.rounding_scales(weight, amax)
        if self.leader:
            with one_intra_op_thread():
                codes = gptq_codes_stepped(weight, matrix, step, act_order=self.act_order)
        else:
            codes = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
        if self.ranked:  # rank 0's codes on every rank: the streams of all ranks see the same rounding
            codes = _from_rank_0(codes)
        return [pack_e2m1_codes(codes), *scales], dequantize_stepped(codes, step)

    def _forward(self, layer_pass: LayerPass, stream: list[torch.Tensor]) -> list[torch.Tensor]:
        """The layer's outputs on ``stream``, in the dtype the layers hand each other; the KV-cache recorder does
        not see them (the job's KV scales are the high-precision stream's, as every other scale)."""
        storage = layer_pass.outputs[0].dtype if layer_pass.outputs else None
        with torch.no_grad(), unrecorded(layer_pass.layer):
            return [_hidden(layer_pass.call(layer_pass.layer, step, hidden), storage)
                    for step, hidden in enumerate(stream)]

    def _save(self, index: int, family: str, rounded: dict[str, tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Store ``rounded`` (on-disk weight key -> its tensors) in the layer's file of ``family``."""
        if self.directory is None or not rounded:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"layer-{index:05d}-{family}.safetensors"
        tensors = {f"{key}:{label}": tensor.cpu().contiguous()
                   for key, (written, _) in rounded.items() for label, tensor in zip(ROUNDED_TENSORS, written,
                                                                                     strict=True)}
        save_file(tensors, self.directory / name)
        self.rounded[family].update(dict.fromkeys(rounded, name))


def _relative(layer_pass: LayerPass, path: str) -> str:
    return path[len(layer_pass.path) + 1:]


def _linear(layer_pass: LayerPass, path: str) -> torch.nn.Module:
    return layer_pass.layer.get_submodule(_relative(layer_pass, path))


def _hidden(output: Any, dtype: torch.dtype | None) -> torch.Tensor:
    hidden = output[0] if isinstance(output, tuple) else output
    return hidden.to(dtype) if dtype is not None else hidden


def _all_ranks_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, through host memory (the job's process group may be gloo on a GPU job)."""
    host = tensor.cpu()
    torch.distributed.all_reduce(host)
    return host.to(tensor.device)


def _from_rank_0(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank, through host memory."""
    host = tensor.cpu()
    torch.distributed.broadcast(host, src=0)
    return host.to(tensor.device)


@contextmanager
def _weights_replaced(layer_pass: LayerPass, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The layer's parameters hold ``values`` (model path -> value) for the block; their own values after it."""
    kept = {}
    for path, value in values.items():
        parameter = layer_pass.layer.get_parameter(_relative(layer_pass, path))
        kept[path] = parameter.data
        parameter.data = value.to(parameter.dtype)
    try:
        yield
    finally:
        for path, data in kept.items():
            layer_pass.layer.get_parameter(_relative(layer_pass, path)).data = data
