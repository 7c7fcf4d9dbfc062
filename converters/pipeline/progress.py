"""How progress is counted and worded, in one place: the API's ``progress`` events carry the words
(:func:`progress_event` adds ``text``) and the CLI's bars print the same words, so the two read alike.

An event is plain data: ``stage``, ``done`` / ``total`` counted in ``unit`` (:class:`Unit`), and where they apply
``step`` (what the stage does now), ``shards_done`` / ``shards_total`` (weight files written) and ``bytes_done`` /
``bytes_total`` (tensor bytes written). Torch-free: the service imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from converters.analysis.render import human_bytes

__all__ = ["DETAIL_KEYS", "LOAD_STEP", "RESOLVE_STEPS", "SMOOTHING_STEPS", "START_STEP", "Unit", "progress_event",
           "progress_text"]


class Unit(str, enum.Enum):
    """What a stage's ``done`` / ``total`` count."""

    STEP = "step"  #: a stage's own steps (resolve's, export's), or whole-model calibration's batches
    LAYER = "layer"  #: decoder layers, and the head pass as one more (layer-by-layer calibration, the quality pass)
    TASK = "task"  #: the tasks of a job split into tasks (a requantize job: plan, weight amax, shard writes, finish)


#: The optional fields of an event, in the order an event lists them.
DETAIL_KEYS = ("step", "shards_done", "shards_total", "bytes_done", "bytes_total")

#: What resolve does, in order, as its progress names each step (the whole-model mode adds ``LOAD_STEP``). Reading
#: the config is where transformers' model code is imported: on a small model, most of the stage.
RESOLVE_STEPS = ("finding the model files", "reading config.json (imports the model's transformers code)",
                 "building the model on the meta device", "indexing the weight files")
LOAD_STEP = "loading the weights"
#: What calibrate does first with ``nvfp4_smoothing``: the search's layer walk, then the smoothed copy's write (the
#: calibration's own walk follows, counting the layers again)
SMOOTHING_STEPS = ("searching each layer's NVFP4 smoothing scales", "writing the smoothed copy of the source")
#: What a service's conversion process does before resolve's first step: it starts and imports torch.
START_STEP = "starting the conversion process (imports torch)"


def progress_event(stage: str, done: int, total: int, unit: Unit | str = Unit.STEP, **detail: Any) -> dict[str, Any]:
    """The data of one ``progress`` event: the counts, the ``detail`` given (keys of :data:`DETAIL_KEYS`; None
    values left out) and ``text``, its words.

    Raises:
        ValueError: a detail key that is not one of :data:`DETAIL_KEYS`.
    """
    unknown = set(detail) - set(DETAIL_KEYS)
    if unknown:
        raise ValueError(f"unknown progress detail {sorted(unknown)}; known: {', '.join(DETAIL_KEYS)}")
    event = {"stage": str(stage), "done": int(done), "total": int(total), "unit": Unit(unit).value,
             **{key: detail[key] for key in DETAIL_KEYS if detail.get(key) is not None}}
    event["text"] = progress_text(event)
    return event


def progress_text(event: Mapping[str, Any]) -> str:
    """One event in words: ``calibrate: 3/9 layers``, ``resolve: 1/4 steps, now reading config.json``,
    ``convert: 2/8 shards, 1.2 GiB of 4.8 GiB written``. Where every task of the stage is a shard's write, the
    shards alone are counted."""
    done, total, unit = event["done"], event["total"], event.get("unit", Unit.STEP.value)
    shards = (event["shards_done"], event["shards_total"]) if "shards_total" in event else None
    parts = [] if shards == (done, total) else [f"{done}/{total} {_plural(unit, total)}"]
    if shards is not None:
        parts.append(f"{shards[0]}/{shards[1]} {_plural('shard', shards[1])}")
    if "bytes_total" in event:
        parts.append(f"{human_bytes(event['bytes_done'])} of {human_bytes(event['bytes_total'])} written")
    if event.get("step"):
        parts.append(f"now {event['step']}")
    return f"{event['stage']}: {', '.join(parts)}"


def _plural(unit: str, count: int) -> str:
    return unit if count == 1 else f"{unit}s"
