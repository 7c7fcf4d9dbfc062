"""One rank's side of a data-parallel, resumable layer-sequential calibration (the ``boundary`` of
:func:`converters.calibration.sequential.calibrate_layer_by_layer`).

Each rank runs its share of the calibration steps (:func:`~converters.distributed.ranks.steps_of_rank`) through
every layer. At each layer's end the ranks combine what the layer recorded, so that every rank holds the whole
job's figures before the next layer:

* **amax** (per Linear and per step, ``[steps, 3]``; a step is run by one rank and is 0 on the others): a MAX
  all-reduce, which leaves every value exactly the one-rank run's; TE's delayed-scaling history is computed from
  these per-step amax in step order afterwards, so it is the one-rank run's too. The tokens each expert received
  per step: a SUM all-reduce (integers, exact).
* **KV-cache amax** (per head, a running max over steps): a MAX all-reduce, exact. Then each attention layer's
  clipping search (:mod:`converters.calibration.kv_search`) runs here, every rank on its own steps: the per-step
  error sums of all ranks are gathered and added in step order, so the chosen KV scales are the one-rank run's.
* **SQNR sums** (signal and noise per layer, recipe and operand): a SUM in rank order, equal to the one-rank run's
  within float reordering (the dB figures are rounded to 0.01).

Then, once the walk's ``after_layer`` work is done (GPTQ rounding: :mod:`converters.calibration.gptq_rounding`),
the layer is written to the resume record (:mod:`converters.distributed.resume`) when there is one: every rank its
steps' outputs (and of each GPTQ family's stream), rank 0 the layer's rounded weights and the reduced record once all
have. A restart (any number of ranks, any hosts reaching the record) reloads the finished layers instead of running
them and continues at the first unfinished one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

from converters.calibration.amax import AmaxRecorder, LayerAmax
from converters.calibration.kv_cache import KvAmax, KvCacheRecorder
from converters.calibration.sequential import Resumed, under
from converters.calibration.sqnr_arithmetic import MeasuredChannels
from converters.distributed.ranks import RankInfo, every_rank, from_leader, steps_of_rank
from converters.distributed.resume import LayerRecord, ResumeStore
from converters.model.experts import parse_unit_path

if TYPE_CHECKING:
    from converters.calibration.gptq_rounding import GptqRounding
    from converters.calibration.sqnr_meter import SqnrMeter

__all__ = ["RankedLayerWalk"]


class RankedLayerWalk:
    """The between-layers work of one rank (see the module docstring); ``store`` None: no resume record."""

    def __init__(self, info: RankInfo, store: ResumeStore | None, stack_path: str, *,
                 kv: KvCacheRecorder | None = None, meter: SqnrMeter | None = None,
                 rounding: GptqRounding | None = None) -> None:
        self.info = info
        self.world_size = info.world_size
        self.store = store
        self.stack_path = stack_path
        self.kv = kv
        self.meter = meter
        self.rounding = rounding
        self._done: LayerRecord | None = None  #: the reduced layer, recorded once its after_layer work is done
        self._outputs: list[torch.Tensor] = []
        if meter is not None and info.world_size > 1:
            # a layer's sampled rows wait for the reduced history (use_step_amax): no flush before the layer's end
            meter.flush_rows = meter.pending_bytes = sys.maxsize
            meter.agree_channels = self._agree_channels
        self._steps: list[int] = []

    def steps(self, total: int) -> list[int]:
        self._steps = steps_of_rank(self.info.rank, self.info.world_size, total)
        return self._steps

    def resume(self, layers: int) -> Resumed | None:
        """The finished layers of the record, restored into the KV recorder and the meter; None with none."""
        if self.store is None:
            return None
        if self.info.leader:
            self.store.open(writer=True)
        if self.world_size > 1:  # rank 0's record is the job's, wherever the others' output would have put theirs
            self.store = ResumeStore(Path(from_leader(self.info, str(self.store.directory))), self.store.job)
        self._barrier()  # the others read only after rank 0 has kept or replaced the record
        records = self.store.finished(layers) if self.store.open(writer=False) else []
        # every rank must start at the same layer: the fewest any of them found (all read the same files)
        count = self._reduce_int(len(records), torch.distributed.ReduceOp.MIN if self.world_size > 1 else None)
        records = records[:count]
        if not records:
            return None
        amax: dict[str, LayerAmax] = {}
        for record in records:
            amax.update({path: LayerAmax(**parts) for path, parts in record.amax.items()})
            if self.kv is not None:
                self.kv.merge([record.kv])
            if self.meter is not None:
                self.meter.replace_sums(record.sqnr)
        hidden = self.store.load_outputs(count - 1, self._steps)
        if self.rounding is not None:
            streams = {family: self.store.load_outputs(count - 1, self._steps, stream=family)
                       for family in self.rounding.families}
            if self.rounding.directory is not None:
                self.store.restore_rounded(records, self.rounding.directory)
            self.rounding.resume(streams, [record.rounded for record in records])
        return Resumed(next_layer=count, amax=amax, hidden=hidden)

    def layer_done(self, index: int, recorder: AmaxRecorder, outputs: list[torch.Tensor]) -> None:
        """The layer's figures reduced over the ranks (recorded by :meth:`layer_finished`)."""
        layer_path = f"{self.stack_path}.{index}"
        self._reduce_recorder(recorder)
        kv = self._reduce_kv(lambda path: under(path, layer_path))
        sqnr = self._reduce_sqnr(recorder, lambda path: under(path, layer_path))
        if self.store is None:
            return
        amax = {path: {name: getattr(layer, name) for name in ("forward", "backward", "tokens")
                       if getattr(layer, name) is not None} for path, layer in recorder.results().items()}
        self._done, self._outputs = LayerRecord(index=index, amax=amax, sqnr=sqnr, kv=kv), outputs

    def layer_finished(self, index: int) -> None:
        """The layer in the resume record, with what GPTQ rounding made of it, when there is a record."""
        record, outputs = self._done, self._outputs
        self._done, self._outputs = None, []
        if record is None:  # no resume record
            return
        self.store.save_outputs(index, self._steps, outputs)
        if self.rounding is not None:
            for family, stream in self.rounding.streams().items():
                self.store.save_outputs(index, self._steps, stream, stream=family)
        self._barrier()  # every rank's outputs are on disk before rank 0 says the layer is finished
        if self.info.leader:
            if self.rounding is not None:
                rounded = self.rounding.layer_files(index)
                self.store.save_rounded([self.rounding.directory / name for files in rounded.values()
                                         for name in set(files.values())])
                record = replace(record, rounded=rounded)
            self.store.save_layer(record)

    def head_done(self, recorder: AmaxRecorder) -> None:
        """The head runs after the last layer and is not recorded: a restart past every layer runs it again."""
        self._reduce_recorder(recorder)
        layers = self.stack_path + "."
        self._reduce_sqnr(recorder, lambda path: not path.startswith(layers))

    def _agree_channels(self, path: str, chosen: MeasuredChannels) -> MeasuredChannels:
        """Rank 0's choice of the channels the meter samples in a wide Linear: it made it from step 0's output, as
        the one-process run does. Every rank calls a Linear at its first step, in the same order, so this collective
        inside the forward lines up; an experts unit keeps its own choice (a rank may route no token to an expert,
        and would miss the collective)."""
        if parse_unit_path(path) is not None:
            return chosen
        rows, weights = from_leader(self.info, (chosen.rows, chosen.weights))
        return MeasuredChannels(rows=rows, weights=weights, amax=chosen.amax)

    def _reduce_recorder(self, recorder: AmaxRecorder) -> None:
        """MAX over the ranks of every per-step amax, SUM of the experts' tokens, in place in ``recorder``."""
        maxed = [*recorder.forward.values(), *(recorder.backward or {}).values()]
        summed: list[torch.Tensor] = []
        if recorder.experts is not None:
            maxed += [*recorder.experts.forward.values(), *(recorder.experts.backward or {}).values()]
            summed += list(recorder.experts.tokens.values())
        if self.world_size == 1:
            return
        for tensors, op in ((maxed, torch.distributed.ReduceOp.MAX), (summed, torch.distributed.ReduceOp.SUM)):
            if tensors:
                flat = self._all_reduce(torch.cat([tensor.reshape(-1) for tensor in tensors]), op)
                for tensor, part in zip(tensors, flat.split([tensor.numel() for tensor in tensors]), strict=True):
                    tensor.copy_(part.reshape(tensor.shape))

    def _reduce_kv(self, owned: Callable[[str], bool]) -> dict[str, KvAmax]:
        """This layer's KV amax, MAX over the ranks, then its attention layers' scale searches over every rank's
        steps (collectives: every rank runs the layer's attention paths in the same, sorted order)."""
        if self.kv is None:
            return {}
        recorded = self.kv.state(owned)
        if self.world_size > 1 and recorded:
            parts = [tensor.clone() for amax in recorded.values() for tensor in (amax.key, amax.value)]
            flat = self._all_reduce(torch.cat(parts), torch.distributed.ReduceOp.MAX)
            reduced = iter(flat.split([tensor.numel() for tensor in parts]))
            self.kv.merge([{path: KvAmax(key=next(reduced), value=next(reduced), dtype=amax.dtype)
                            for path, amax in recorded.items()}])
        for path in sorted(recorded):
            self.kv.finish(path, numbers=self._steps, gather=self._gather_all)
        return self.kv.state(owned)

    def _gather_all(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order."""
        return [item for rank_items in every_rank(self.info, items) for item in rank_items]

    def _reduce_sqnr(self, recorder: AmaxRecorder, owned: Callable[[str], bool]
                     ) -> list[tuple[str, str, str, float, float]]:
        """This layer's SQNR sums over the ranks, added in rank order. The meter first measures what waits, with
        delayed scaling's history taken from the reduced per-step input amax (``recorder``'s, already reduced)."""
        if self.meter is None:
            return []
        if self.world_size > 1:
            inputs = {**recorder.forward, **(recorder.experts.forward if recorder.experts is not None else {})}
            for path, amax in inputs.items():
                self.meter.use_step_amax(path, amax[:, 0])
        self.meter.flush()
        sums = self.meter.sums_of(owned)
        if self.world_size == 1:
            return sums
        merged: dict[tuple[str, str, str], list[float]] = {}
        for rank_sums in every_rank(self.info, sums):
            for path, label, what, signal, noise in rank_sums:
                total = merged.setdefault((path, label, what), [0.0, 0.0])
                total[0], total[1] = total[0] + signal, total[1] + noise
        sums = [(*key, signal, noise) for key, (signal, noise) in merged.items()]
        self.meter.replace_sums(sums)
        return sums

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """``tensor`` reduced over the ranks, on the CPU (NCCL reduces on the rank's GPU)."""
        if torch.distributed.get_backend() == "nccl":
            on_device = tensor.to(f"cuda:{self.info.local_rank}")
            torch.distributed.all_reduce(on_device, op=op)
            return on_device.cpu()
        torch.distributed.all_reduce(tensor, op=op)
        return tensor

    def _reduce_int(self, value: int, op: Any) -> int:
        if op is None:
            return value
        return int(self._all_reduce(torch.tensor([value], dtype=torch.int64), op)[0])

    def _barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()
