"""An API key may hold FP8FORGE_MAX_EVENT_STREAMS_PER_KEY event streams open; more get 429 with Retry-After, and a
stream's slot is released when it closes: the client goes away, or the job ends. Real uvicorn, real HTTP streams."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from service.api.auth import key_entry
from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from tests.service_helpers import live_app, wait_for

TOKENS = {"alice": "fp8f_alice-token", "bob": "fp8f_bob-token"}


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def _open(client: httpx.Client, stack: contextlib.ExitStack, job_id: str, who: str) -> httpx.Response:
    """Open the job's event stream and leave it open (the stack closes it); reads only the headers."""
    return stack.enter_context(client.stream("GET", f"/v1/jobs/{job_id}/events", headers=_auth(who)))


def test_a_key_holds_at_most_its_streams_and_gets_them_back_when_they_close(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", workers=0, max_event_streams_per_key=2,
                        api_keys=tuple(key_entry(name, "user", token) for name, token in TOKENS.items()))
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        jobs = {who: store.create_job({"model": "demo/tiny-llama"}, request_hash=who, owner=who)[0].id
                for who in TOKENS}
        with contextlib.ExitStack() as alice_streams:
            first = _open(client, alice_streams, jobs["alice"], "alice")
            second = _open(client, alice_streams, jobs["alice"], "alice")
            assert first.status_code == second.status_code == 200

            with client.stream("GET", f"/v1/jobs/{jobs['alice']}/events", headers=_auth("alice")) as refused:
                assert refused.status_code == 429  # (a stream would never end: the job is queued)
                refused.read()
            assert refused.json()["error"]["code"] == "too_many_streams"
            assert "FP8FORGE_MAX_EVENT_STREAMS_PER_KEY" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) > 0
            with contextlib.ExitStack() as bob_streams:  # another key has streams of its own
                assert _open(client, bob_streams, jobs["bob"], "bob").status_code == 200
            assert client.get("/healthz").status_code == 200

        def reopened() -> bool:  # the server notices the closed connections, then frees their slots
            with client.stream("GET", f"/v1/jobs/{jobs['alice']}/events", headers=_auth("alice")) as response:
                return response.status_code == 200

        wait_for(reopened, timeout=10, what="alice's closed streams to be released")

        def open_when_free(stack: contextlib.ExitStack) -> httpx.Response:
            # The server frees a closed stream's slot when it notices the disconnect: one freed slot (all that
            # reopened() proves) does not mean both are, so each stream waits for its own.
            def attempt() -> httpx.Response | None:
                response = _open(client, stack, jobs["alice"], "alice")
                return response if response.status_code == 200 else None

            return wait_for(attempt, timeout=10, what="a free event-stream slot")

        with contextlib.ExitStack() as streams:  # the streams of a job that ends end, and release their slots
            opened = [open_when_free(streams) for _ in range(2)]
            store.set_status(jobs["alice"], JobStatus.CANCELLED, event={"reason": "cancel requested"})
            assert all(b"cancelled" in response.read() for response in opened)
            wait_for(reopened, timeout=10, what="the ended streams to be released")
        store.close()
