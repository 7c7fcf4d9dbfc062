"""Host faults: work that failed because of the host it ran on (its disk filled up, its worker was lost) is retried
on another host.

The fault is charged to the host that held the work (``jobs.host``, ``job_tasks.host``): its name is added to the
row's ``failed_hosts`` (a JSON list) and ``host_faults`` counts the fault. Such a retry uses up none of the row's
attempts: ``max_attempts`` grows by one (attempt numbers name attempt directories and object-store prefixes, so
they are never reused). A row has ``HOST_FAULT_RETRIES`` such retries of its own; after those, or when the host is
unknown (a claim that named none), a host fault counts as an attempt like any other failure, so nothing loops for
ever.

A claim leaves a row whose failed hosts include the claimer's while a live worker on a host not among them could
take it. When every live worker's host has failed it, it may go back to one of them, once ``retry_after`` has
passed (a back-off that doubles with each host fault). The preference for the host that read a task's source
(``TaskQueue.claim``) only orders what a claimer may take, so it never sends a retry back to the host that failed.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

__all__ = ["HOST_FAULT_RETRIES", "HostFault", "avoided_by", "charge", "live_hosts", "public_host_name", "this_host"]

#: Host-fault retries a job or task has beyond its attempts.
HOST_FAULT_RETRIES = 3
_BACKOFF_S, _MAX_BACKOFF_S = 2.0, 60.0


def this_host(data_dir: Path | str) -> str:
    """The name a worker's host goes by in the store: the machine and the data directory its scratch lives in.

    Workers that share a data directory share its disk, so they share its faults; two workers on one machine
    with data directories of their own do not. The directory is hashed, so no server path is stored (task
    listings show hosts). The name also says whose cache holds which source (``job_tasks.host``).
    """
    digest = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:8]
    return f"{socket.gethostname()}/{digest}"


def public_host_name(host: str | None) -> str | None:
    """What a job's events say of a host: a stable opaque name (the stored one names a machine)."""
    return None if host is None else "h-" + hashlib.sha256(host.encode()).hexdigest()[:12]


def failed_hosts(stored: str | None) -> list[str]:
    return list(json.loads(stored)) if stored else []


@dataclass(frozen=True)
class HostFault:
    """A host fault charged to a row: the columns that requeue it, and what its event says."""

    values: dict[str, Any]
    event: dict[str, Any]


def charge(row: Mapping[str, Any], db_now: sa.ColumnElement[float]) -> HostFault | None:
    """The values that requeue ``row`` (its ``host``, ``failed_hosts``, ``host_faults`` and ``max_attempts``) as
    the retry of a fault of its host; None when its host is unknown or it has had its host-fault retries."""
    host, faults = row["host"], row["host_faults"] or 0
    if host is None or faults >= HOST_FAULT_RETRIES:
        return None
    failed = failed_hosts(row["failed_hosts"])
    if host not in failed:
        failed.append(host)
    backoff = min(_BACKOFF_S * 2 ** faults, _MAX_BACKOFF_S)
    values = {"failed_hosts": json.dumps(failed), "host_faults": faults + 1, "max_attempts": row["max_attempts"] + 1,
              "retry_after": db_now + backoff}
    event = {"host": public_host_name(host), "failed_hosts": [public_host_name(h) for h in failed],
             "host_faults": faults + 1}
    return HostFault(values, event)


def live_hosts(conn: sa.Connection, workers: sa.Table, db_now: sa.ColumnElement[float], within_s: float) -> set[str]:
    """The hosts of the workers that heartbeated within ``within_s`` seconds."""
    query = sa.select(workers.c.host).distinct().where(workers.c.host.is_not(None),
                                                       workers.c.heartbeat_at >= db_now - within_s)
    return set(conn.execute(query).scalars())


def avoided_by(table: sa.Table, host: str, others: Collection[str], db_now: sa.ColumnElement[float],
               ) -> sa.ColumnElement[bool]:
    """True for the rows of ``table`` that ``host`` must leave: it failed them, and a live worker on one of
    ``others`` (the other live hosts) has not, or their back-off has not passed."""
    failed = sa.func.coalesce(table.c.failed_hosts, "")
    elsewhere = [sa.not_(_lists(failed, other)) for other in others]
    waiting = sa.and_(table.c.retry_after.is_not(None), table.c.retry_after > db_now)
    return sa.and_(_lists(failed, host), sa.or_(*elsewhere, waiting))


def _lists(failed: sa.ColumnElement[str], host: str) -> sa.ColumnElement[bool]:
    """Whether the JSON list ``failed`` holds ``host``: its JSON string after ``[`` or ``, `` (inside a JSON string
    a quote is always escaped, so neither can match within another name)."""
    quoted = json.dumps(host)
    return sa.or_(failed.contains("[" + quoted, autoescape=True), failed.contains(", " + quoted, autoescape=True))
