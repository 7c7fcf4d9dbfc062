"""Artifact storage throughput: the object store next to the local disk, for uploads and for API downloads.

One run, on one machine, against moto's standalone S3 server on loopback (started here; `--endpoint` and
`--bucket` point the run at another S3-compatible store, credentials from AWS_*):

  upload     `--files` files of `--size-mib` MiB each. local: what a worker on the local storage does to make
             its attempt's files durable where the API reads them: it writes them to the data dir (a copy, page
             cache, no fsync; publishing is then a rename). s3: ObjectArtifacts.upload, what a worker does
             before publishing: multipart parts of `--part-mib` MiB, `--concurrency` at once, each part's
             SHA-256, the whole file hashed as sent, the store's checksum read back. The process's peak RSS
             growth during the upload is printed beside it (the upload's memory bound is about
             (concurrency + 1) x part size).
  download   every file once through GET /v1/jobs/{id}/artifacts/{name} on a real uvicorn: local disk,
             s3 streamed through the API, s3 redirected (307 to a pre-signed URL, the client then reads from
             the store), and the store read directly with boto3 (no API) as the store's own ceiling.

Ratios are against local. moto keeps objects in memory and answers from one Python process, so its numbers
show what the API and the upload path cost around a store, not what AWS S3 or MinIO deliver.

Run: .venv/bin/python benchmarks/bench_storage.py [--files 2] [--size-mib 128] [--part-mib 16] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import httpx  # noqa: E402

from converters.artifact.layout import sha256_file  # noqa: E402
from service.artifacts import ArtifactDirs  # noqa: E402
from service.artifacts.s3 import ObjectArtifacts  # noqa: E402
from service.config import Settings  # noqa: E402
from service.jobs import JobStatus  # noqa: E402
from service.store import JobStore  # noqa: E402
from tests.object_store_server import AWS_ENV, moto_server  # noqa: E402
from tests.service_helpers import live_app  # noqa: E402

_MiB = 1 << 20


def _write_random(path: Path, size: int) -> None:
    with path.open("wb") as fh:
        for _ in range(size // _MiB):
            fh.write(os.urandom(_MiB))


def _listing(directory: Path) -> list[dict[str, Any]]:
    return [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(directory.iterdir())]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _succeeded_job(store: JobStore, artifacts: list[dict[str, Any]]) -> str:
    """A job row that succeeded with attempt 1 and these artifacts (what a worker's outcome records)."""
    job, _ = store.create_job({"model": "bench"}, request_hash=uuid.uuid4().hex)
    store.claim_next("bench")
    store.set_status(job.id, JobStatus.SUCCEEDED, owner="bench", artifacts=artifacts)
    return job.id


def _download_all(client: httpx.Client, job_id: str, artifacts: list[dict[str, Any]]) -> float:
    """Seconds to read every artifact once through the API (following a redirect), checking sizes."""
    started = time.perf_counter()
    for entry in artifacts:
        got = 0
        with client.stream("GET", f"/v1/jobs/{job_id}/artifacts/{entry['name']}", follow_redirects=True) as r:
            assert r.status_code == 200, r.read()
            for chunk in r.iter_raw(_MiB):
                got += len(chunk)
        assert got == entry["bytes"], (entry, got)
    return time.perf_counter() - started


def _direct_read(storage: ObjectArtifacts, job_id: str, artifacts: list[dict[str, Any]]) -> float:
    started = time.perf_counter()
    for entry in artifacts:
        body = storage.client.get_object(Bucket=storage.bucket, Key=f"{storage.attempt_prefix(job_id, 1)}"
                                                                    f"{entry['name']}")["Body"]
        while body.read(_MiB):
            pass
    return time.perf_counter() - started


@contextlib.contextmanager
def _store(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, str]]:
    """(endpoint, bucket): the one given, or moto started here with a fresh bucket."""
    if args.endpoint:
        yield args.endpoint, args.bucket
        return
    for name, value in AWS_ENV.items():
        os.environ.setdefault(name, value)
    with moto_server(tmp / "moto.log") as server:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.client().create_bucket(Bucket=bucket)
        yield server.endpoint, bucket


def run(args: argparse.Namespace, tmp: Path) -> None:
    src = tmp / "attempt"
    src.mkdir()
    for n in range(args.files):
        _write_random(src / f"model-{n:05d}.safetensors", args.size_mib * _MiB)
    artifacts = _listing(src)
    total_mib = sum(a["bytes"] for a in artifacts) / _MiB
    db = f"sqlite:///{tmp / 'jobs.db'}"
    with _store(args, tmp) as (endpoint, bucket):
        common = dict(database_url=db, auth_disabled=True, ui_enabled=False)
        local = Settings(data_dir=tmp / "local", **common)
        s3 = Settings(data_dir=tmp / "s3", artifact_store="s3", s3_bucket=bucket, s3_endpoint_url=endpoint,
                      s3_prefix="bench", s3_part_size_bytes=args.part_mib * _MiB,
                      s3_upload_concurrency=args.concurrency, **common)
        store = JobStore(db)

        local_id = _succeeded_job(store, artifacts)
        final = ArtifactDirs(local.jobs_dir).final_dir(local_id)
        final.mkdir(parents=True)
        started = time.perf_counter()
        for entry in artifacts:
            shutil.copyfile(src / entry["name"], final / entry["name"])
        local_up = time.perf_counter() - started

        storage = ObjectArtifacts.from_settings(s3)
        s3_id = _succeeded_job(store, artifacts)
        scratch = storage.attempt_dir(s3_id, 1)
        scratch.parent.mkdir(parents=True)
        os.symlink(src, scratch)  # the attempt's files, where a worker's pipeline would have written them
        rss_before = _peak_rss_mib()
        started = time.perf_counter()
        storage.upload(s3_id, 1, artifacts)
        s3_up = time.perf_counter() - started
        rss_growth = _peak_rss_mib() - rss_before
        os.unlink(scratch)

        down: dict[str, float] = {}
        for label, settings, job_id in (("local", local, local_id), ("s3 streamed", s3, s3_id),
                                        ("s3 redirect", s3.model_copy(update={"artifact_downloads": "redirect"}),
                                         s3_id)):
            with live_app(settings) as client:
                _download_all(client, job_id, artifacts)  # warm-up: page cache, connections
                down[label] = min(_download_all(client, job_id, artifacts) for _ in range(args.repeats))
        down["store direct (boto3)"] = min(_direct_read(storage, s3_id, artifacts) for _ in range(args.repeats))
        store.close()

    print(f"{args.files} file(s) x {args.size_mib} MiB = {total_mib:.0f} MiB; parts of {args.part_mib} MiB, "
          f"{args.concurrency} at once; store {endpoint if args.endpoint else 'moto_server on loopback'}")
    print(f"{'upload':<24}{'MiB/s':>10}{'ratio':>8}")
    print(f"{'local (write data dir)':<24}{total_mib / local_up:>10.0f}{1.0:>8.2f}")
    print(f"{'s3 (ObjectArtifacts)':<24}{total_mib / s3_up:>10.0f}{local_up / s3_up:>8.2f}"
          f"   peak RSS growth {rss_growth:.0f} MiB")
    print(f"{'download (best of ' + str(args.repeats) + ')':<24}{'MiB/s':>10}{'ratio':>8}")
    for label, seconds in down.items():
        print(f"{label:<24}{total_mib / seconds:>10.0f}{down['local'] / seconds:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2, help="files per attempt (default: %(default)s)")
    parser.add_argument("--size-mib", type=int, default=128, help="size of each file (default: %(default)s)")
    parser.add_argument("--part-mib", type=int, default=16, help="multipart part size (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4, help="parts in flight (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="downloads of each kind; the best is shown")
    parser.add_argument("--endpoint", default="", help="an S3-compatible endpoint instead of moto")
    parser.add_argument("--bucket", default="", help="its bucket (with --endpoint)")
    args = parser.parse_args()
    if args.endpoint and not args.bucket:
        parser.error("--endpoint needs --bucket")
    with tempfile.TemporaryDirectory(prefix="fp8forge-bench-storage-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
