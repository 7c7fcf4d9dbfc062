"""API keys and job ownership on a real uvicorn server, per-key limits on real SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service.api.auth import KeyRing, hash_token, key_entry
from service.config import Settings, SettingsError
from service.errors import TooManyJobs
from service.jobs import Job, JobStatus
from service.store import JobStore
from tests.service_helpers import fp8forge_command, live_app, make_store

JOB = {"model": "demo/tiny-llama", "recipe": {"backend": "ao"},
       "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16, "texts": ["alice's private calibration text"]}}
TOKENS = {"alice": "fp8f_alice-token", "alice2": "fp8f_alice-rotated", "bob": "fp8f_bob-token", "root": "fp8f_root"}
KINDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\n" + "\n".join([
        key_entry("alice", "user", TOKENS["alice"]), key_entry("alice", "user", TOKENS["alice2"]),
        key_entry("root", "admin", TOKENS["root"]),
    ]) + "\n")
    return Settings(data_dir=tmp_path / "data", workers=0, api_keys_file=keys, max_queued_jobs_per_key=3,
                    api_keys=(key_entry("bob", "user", TOKENS["bob"]),))


@pytest.fixture
def client(settings: Settings):
    with live_app(settings) as client:
        yield client


def _submit(client, who: str, **headers: str) -> dict:
    response = client.post("/v1/jobs", json=JOB, headers={**_auth(who), **headers})
    assert response.status_code == 202, response.text
    return response.json()


def test_every_v1_route_needs_a_valid_bearer_key(client) -> None:
    job = _submit(client, "alice")
    attempts = [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", f"/v1/jobs/{job['id']}"),
                ("GET", f"/v1/jobs/{job['id']}/events"), ("GET", f"/v1/jobs/{job['id']}/artifacts"),
                ("POST", f"/v1/jobs/{job['id']}/cancel"), ("DELETE", f"/v1/jobs/{job['id']}"),
                ("POST", "/v1/analyze")]
    for headers in ({}, {"Authorization": "Bearer fp8f_not-a-key"}, {"Authorization": f"Basic {TOKENS['bob']}"},
                    {"Authorization": "Bearer"}, {"Authorization": f"bearer {hash_token(TOKENS['bob'])}"}):
        for method, path in attempts:
            response = client.request(method, path, headers=headers, json=JOB if method == "POST" else None)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "unauthorized"
    # the scheme is case-insensitive, as RFC 7235 says; health checks need no key
    assert client.get("/v1/jobs", headers={"Authorization": f"bearer {TOKENS['bob']}"}).status_code == 200
    assert client.get("/healthz").status_code == 200


def test_a_job_is_invisible_to_other_keys(client) -> None:
    job = _submit(client, "alice")
    base = f"/v1/jobs/{job['id']}"
    for method, path in [("GET", base), ("GET", f"{base}/events"), ("GET", f"{base}/artifacts"),
                         ("GET", f"{base}/artifacts/model.safetensors"), ("HEAD", f"{base}/artifacts/x"),
                         ("POST", f"{base}/cancel"), ("DELETE", base)]:
        response = client.request(method, path, headers=_auth("bob"))
        missing = client.request(method, "/v1/jobs/" + "0" * 32 + path[len(base):], headers=_auth("bob"))
        assert response.status_code == missing.status_code == 404, (method, path)
        if method != "HEAD":  # the same answer as for a job that does not exist, apart from the id
            assert response.json()["error"]["code"] == missing.json()["error"]["code"] == "job_not_found"
    assert client.get("/v1/jobs", headers=_auth("bob")).json()["data"] == []
    assert client.get(base, headers=_auth("alice")).json()["status"] == "queued"  # bob's cancel did nothing


def test_owner_sees_the_request_admin_sees_the_job_without_it(client) -> None:
    job = _submit(client, "alice")
    bobs = _submit(client, "bob")
    assert job["request"]["calibration"]["texts"] == JOB["calibration"]["texts"]
    as_admin = client.get(f"/v1/jobs/{job['id']}", headers=_auth("root")).json()
    assert as_admin["id"] == job["id"] and as_admin["request"] is None
    listed = client.get("/v1/jobs", headers=_auth("root")).json()["data"]
    assert {j["id"] for j in listed} == {job["id"], bobs["id"]} and all(j["request"] is None for j in listed)
    # a rotated key of the same name owns the same jobs
    rotated = client.get(f"/v1/jobs/{job['id']}", headers=_auth("alice2")).json()
    assert rotated["request"] == job["request"]
    assert [j["id"] for j in client.get("/v1/jobs", headers=_auth("alice2")).json()["data"]] == [job["id"]]
    # an admin may cancel and delete anyone's job
    assert client.post(f"/v1/jobs/{bobs['id']}/cancel", headers=_auth("root")).json()["status"] == "cancelled"
    assert client.delete(f"/v1/jobs/{bobs['id']}", headers=_auth("root")).status_code == 204


def test_idempotency_keys_are_per_owner(client) -> None:
    first = _submit(client, "alice", **{"Idempotency-Key": "nightly-1"})
    again = _submit(client, "alice2", **{"Idempotency-Key": "nightly-1"})
    other = _submit(client, "bob", **{"Idempotency-Key": "nightly-1"})
    assert again["id"] == first["id"] and other["id"] != first["id"]


def test_queued_jobs_per_key_are_limited_with_retry_after(client, settings: Settings) -> None:
    ids = [_submit(client, "alice")["id"] for _ in range(settings.max_queued_jobs_per_key)]
    refused = client.post("/v1/jobs", json=JOB, headers=_auth("alice"))
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) > 0 and refused.json()["error"]["code"] == "too_many_jobs"
    assert client.post("/v1/jobs", json=JOB, headers=_auth("bob")).status_code == 202  # others are not held up
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=_auth("alice"))
    assert client.post("/v1/jobs", json=JOB, headers=_auth("alice")).status_code == 202


def test_worker_ids_reach_clients_only_as_opaque_names(client, settings: Settings) -> None:
    job = _submit(client, "alice")
    store = JobStore(settings.store_url)
    try:
        store.claim_next("gpu-host-7.internal:4242:abcdef")
        running = [e.data for e in store.events.after(job["id"]) if e.data.get("status") == "running"]
    finally:
        store.close()
    shown = client.get(f"/v1/jobs/{job['id']}", headers=_auth("alice")).json()["worker_id"]
    assert shown.startswith("w-") and "gpu-host" not in shown and "4242" not in shown
    assert running == [{"status": "running", "attempt": 1, "worker": shown}]  # the event stream says the same


@pytest.mark.parametrize("kind", KINDS)
def test_workers_run_at_most_the_per_key_number_of_a_keys_jobs(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        alice = [store.create_job({"n": i}, request_hash=f"a{i}", owner="alice")[0] for i in range(3)]
        bob = store.create_job({"n": 9}, request_hash="b", owner="bob")[0]
        local = store.create_job({"n": 10}, request_hash="l")[0]  # a server without keys: never limited
        claimed = [store.claim_next(f"w{i}", max_running_per_owner=2) for i in range(5)]
        assert [j.id if j else None for j in claimed] == [alice[0].id, alice[1].id, bob.id, local.id, None]
        store.set_status(alice[0].id, JobStatus.SUCCEEDED, owner="w0")
        assert store.claim_next("w5", max_running_per_owner=2).id == alice[2].id


@pytest.mark.parametrize("kind", KINDS)
def test_workers_claiming_at_the_same_instant_keep_the_running_limit(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        for round_ in range(4):
            for i in range(6):
                store.create_job({"n": i, "round": round_}, request_hash=f"a{round_}-{i}", owner="alice")
            start = threading.Barrier(6)

            def claim(worker: str, start: threading.Barrier = start) -> Job | None:
                start.wait()
                return store.claim_next(worker, max_running_per_owner=2)

            with ThreadPoolExecutor(6) as pool:
                claimed = [job for job in pool.map(claim, [f"w{round_}-{i}" for i in range(6)]) if job is not None]
            assert len(claimed) == 2, f"round {round_}: {len(claimed)} of alice's jobs started, the limit is 2"
            for job in claimed:  # clear the round: nothing left running or queued
                store.set_status(job.id, JobStatus.SUCCEEDED, owner=job.worker_id)
            for job in store.list_jobs(owner="alice", status=JobStatus.QUEUED)[0]:
                store.set_status(job.id, JobStatus.CANCELLED)


@pytest.mark.parametrize("kind", KINDS)
def test_the_queued_limit_holds_in_the_store(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        for i in range(2):
            store.create_job({"n": i}, request_hash=f"a{i}", owner="alice", max_queued=2)
        with pytest.raises(TooManyJobs):
            store.create_job({"n": 2}, request_hash="a2", owner="alice", max_queued=2)
        # a retry with an Idempotency-Key that already has its job returns that job, limit or not
        store.set_status(store.list_jobs()[0][0].id, JobStatus.CANCELLED)
        kept, created = store.create_job({"n": 3}, request_hash="a3", owner="alice", max_queued=2,
                                         idempotency_key="k")
        again, created_again = store.create_job({"n": 3}, request_hash="a3", owner="alice", max_queued=2,
                                                idempotency_key="k")
        assert created and not created_again and again.id == kept.id
        assert store.create_job({"n": 4}, request_hash="b", owner="bob", max_queued=2)[1]


@pytest.mark.parametrize("entry, complaint", [
    ("alice:user", "name:role:sha256"),
    ("alice:owner:" + "0" * 64, "role 'owner'"),
    ("al ice:user:" + "0" * 64, "key name"),
    ("alice:user:fp8f_the-token-itself", "never the token itself"),
])
def test_malformed_key_entries_are_refused_naming_the_line(tmp_path: Path, entry: str, complaint: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(key_entry("root", "admin", "t") + "\n" + entry + "\n")
    with pytest.raises(SettingsError, match=f"{keys}:2: .*{complaint}"):
        KeyRing.from_settings(Settings(data_dir=tmp_path, api_keys_file=keys))


def test_no_key_and_auth_on_says_how_to_create_one_or_turn_it_off(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"fp8forge keys create NAME.*FP8FORGE_AUTH_DISABLED=1"):
        KeyRing.from_settings(Settings(data_dir=tmp_path))
    assert KeyRing.from_settings(Settings(data_dir=tmp_path, auth_disabled=True)).authenticate(None).local


def _cli(args: list[str], data_dir: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("FP8FORGE_")}
    return subprocess.run([*fp8forge_command(), *args], capture_output=True, text=True, timeout=120,
                          env={**clean, "FP8FORGE_DATA_DIR": str(data_dir), **env})


def test_keys_create_stores_only_the_hash_and_the_server_accepts_the_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = _cli(["keys", "create", "carol", "--role", "admin"], data)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    stored = (data / "api_keys").read_text()
    assert token not in stored and hash_token(token) in stored and stored.startswith("carol:admin:")
    assert (data / "api_keys").stat().st_mode & 0o777 == 0o600
    listed = _cli(["keys", "list"], data)
    assert listed.returncode == 0 and listed.stdout.startswith("carol\tadmin\t")
    with live_app(Settings(data_dir=data, workers=0)) as client:
        assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_serve_refuses_to_start_without_keys_or_open_to_the_network_without_auth(tmp_path: Path) -> None:
    no_keys = _cli(["serve", "--workers", "0", "--port", "1"], tmp_path)
    assert no_keys.returncode == 2 and "fp8forge keys create NAME" in no_keys.stderr
    exposed = _cli(["serve", "--workers", "0", "--host", "0.0.0.0", "--port", "1"], tmp_path,
                   FP8FORGE_AUTH_DISABLED="1")
    assert exposed.returncode == 2 and "loopback" in exposed.stderr and "Traceback" not in exposed.stderr


def test_errors_do_not_reveal_the_servers_model_roots(tmp_path: Path) -> None:
    secret_root = tmp_path / "srv-models-of-team-x"
    (secret_root / "m").mkdir(parents=True)
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True, allowed_model_roots=(secret_root,))
    with live_app(settings) as client:
        for model in ("/etc", str(tmp_path), "/nonexistent/model"):
            for path, body in (("/v1/jobs", {"model": model}), ("/v1/analyze", {"model": model})):
                response = client.post(path, json=body)
                assert response.status_code == 422, response.text
                error = response.json()["error"]
                assert error["code"] == "invalid_model_reference" and error["field"] == "model"
                assert "srv-models-of-team-x" not in response.text and "FP8FORGE_ALLOWED_MODEL_ROOTS" in response.text
