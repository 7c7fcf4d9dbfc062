"""What a worker has learned about its running conversion child so far."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from service.jobs import Stage
from service.workers.messages import ChildResult

__all__ = ["PENDING_EVENTS", "RunWatch"]

PENDING_EVENTS = 1000  # kept while the store is unreachable; the oldest go first


@dataclass
class RunWatch:
    stage: Stage | None = None
    done: int = 0
    total: int = 0
    stage_started: float | None = None
    durations: list[tuple[str, float]] = field(default_factory=list)
    result: ChildResult | None = None
    cancel_at: float | None = None
    shutdown_at: float | None = None
    lost: bool = False
    last_progress_event: float = 0.0
    last_progress_step: str | None = None  #: the ``step`` the last progress event named (a new one is always sent)
    store_failing_since: float | None = None
    pending_events: deque[tuple[str, dict[str, Any]]] = field(default_factory=lambda: deque(maxlen=PENDING_EVENTS))
