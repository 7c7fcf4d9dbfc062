"""Schemathesis against a live `fp8forge serve` with API keys on: stateful, two users, a wall-clock budget.

The security issue's "longer run outside the suite" (tests/service/api/test_schemathesis.py is the short one inside it,
with authentication off and no worker). One run:

  server   `fp8forge serve --workers 1` on a free loopback port, its own temporary data dir, authentication
           on (FP8FORGE_AUTH_DISABLED unset), FP8FORGE_ALLOWED_MODEL_ROOTS at a temporary dir holding a tiny
           Llama. Keys from `fp8forge keys create`: users alice and bob, admin ops. The worker really
           converts: one small job per user (torchao, 1 step of 1 x 16 tokens) is run to `succeeded` before
           fuzzing starts, and the fuzzer's own jobs queue behind it.
  fuzzing  `schemathesis run` on the served /openapi.json, all phases (examples, coverage, fuzzing, stateful;
           the schema declares no OpenAPI links, so the stateful phase follows the ones schemathesis infers
           from the schema and the responses: ids from createJob and listJobs into the /v1/jobs/{job_id}
           operations), once as alice and once as bob, each for half of what is left of `--minutes`
           (schemathesis' `max-time` repeats fuzzing and stateful until it is spent). The key goes in through
           the schema's bearer scheme, so schemathesis also sends requests without it or with a wrong one
           (ignored_auth: 401). This file is also the hooks module schemathesis loads (SCHEMATHESIS_HOOKS),
           with these additions to schemathesis' own checks:
             - valid data is refused only for the semantic reasons of tests/service/api/test_schemathesis.py (its check,
               imported, replaces positive_data_acceptance);
             - keys see only their own jobs: a job id created by one key, then sent by the other, answers 404
               job_not_found (never 2xx, 3xx, 409 or 416); every request that found the caller's own job is
               replayed as the other user (404 job_not_found) and, for GET getJob, as the admin (200 with
               `request` null); GET /v1/jobs lists no job of the other user; no job id is handed to two keys;
             - schema-valid reads of one job (not in the stateful phase, which follows its own links) are
               pointed at the caller's succeeded job or at the other user's, so Range, Last-Event-ID and the
               artifact names meet real files and cross-key probes carry every generated header;
             - the caller's own delete of its set-up job goes to an id that does not exist instead (the
               other user's delete of it is sent as generated and must answer 404);
             - calibration of accepted job bodies is scaled down (steps <= 2, batch_size <= 2, seq_len <= 32),
               so the one worker gets through more jobs; refused ones are sent as generated.
  after    the server log is scanned for 'Traceback' and 'internal_error'; jobs that failed with
           internal_error (admin's GET /v1/jobs) are failures too.

The budget covers the set-up (about a minute on 2 cores) too; schemathesis lets a phase it has started finish,
so a run may end somewhat past it. Exit status 1 on any 5xx, any response that breaks the schema, any failed
check or log finding; schemathesis prints each failing case with a curl command (the key shows as [Filtered]:
the keys are in <tmp>/state.json, and the temporary dir is kept whenever the run fails). The summary at the
end: operations, cases and requests, status counts, cross-key probes, server errors (must be 0), log
findings, duration.

Run: .venv/bin/python benchmarks/fuzz_api.py [--minutes 10] [--seed 20261130] [--keep]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import requests
import schemathesis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

USERS = ("alice", "bob")
ADMIN = "ops"
STATE_ENV = "FUZZ_API_STATE"  # the JSON file the driver writes for the hooks
CALLER_ENV = "FUZZ_API_CALLER"  # the user a schemathesis pass runs as
STATS_ENV = "FUZZ_API_STATS"  # where a pass's hooks write what they counted
TOKEN_ENV = "FUZZ_API_TOKEN"  # the pass's key; the config refers to it as ${FUZZ_API_TOKEN}
JOB_READS = {"getJob", "streamJobEvents", "listArtifacts", "downloadArtifact", "headArtifact"}
# answers that say a job exists (or what state it is in): a non-owner must never get one
_REVEALING = {409, 416}
SMALL_CALIBRATION = {"steps": 2, "batch_size": 2, "seq_len": 32}
DEFAULT_CALIBRATION = {"steps": 16, "batch_size": 2, "seq_len": 128}  # what an unset field means
# the service's own bounds (CalibrationCreate's description): within them a job body is accepted
STEP_TOKENS, RUN_TOKENS = 8192, 524_288
LOG_FINDINGS = re.compile(r"Traceback|internal_error")
# what follows such a line and belongs to it: frames, chained tracebacks, the exception line
_TRACEBACK_LINE = re.compile(
    r"\s|Traceback|During handling|The above exception|[\w.]+(Error|Exception|Exit|Interrupt)\b")


# ----------------------------------------------------------------------------------------------------------
# Hooks and checks: active in the `schemathesis run` processes this script starts (SCHEMATHESIS_HOOKS).
# ----------------------------------------------------------------------------------------------------------

if os.environ.get(STATE_ENV):
    # Registers valid_data_refused_only_for_semantic_reasons (its SEMANTIC_REFUSALS table) as a check. The test
    # module builds a schemathesis config, which loads SCHEMATHESIS_HOOKS, and this file counts as loaded only
    # once it has run: without the variable meanwhile, its hooks are not registered (and run) twice.
    _hooks_module = os.environ.pop("SCHEMATHESIS_HOOKS", None)
    try:
        import tests.service.api.test_schemathesis  # noqa: F401
    finally:
        if _hooks_module is not None:
            os.environ["SCHEMATHESIS_HOOKS"] = _hooks_module


class _Hooks:
    """What the hooks of one pass share: the run's state, the job registry, counters."""

    def __init__(self, state_path: Path) -> None:
        self.state = json.loads(state_path.read_text())
        self.caller = os.environ[CALLER_ENV]
        self.by_token = {key["token"]: name for name, key in self.state["keys"].items()}
        self.registry_path = Path(self.state["registry"])
        self.lock = threading.Lock()
        self.owners: dict[str, str] = {}  # job id -> the key name that created it (both passes)
        for line in self.registry_path.read_text().splitlines() if self.registry_path.exists() else ():
            job_id, name = line.split()
            self.owners[job_id] = name
        self.rng = random.Random(self.state["seed"] + USERS.index(self.caller))
        self.session = requests.Session()
        self.requests: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.server_errors: list[dict[str, Any]] = []
        self.probes: Counter[str] = Counter()

    def others(self) -> list[str]:
        return [u for u in USERS if u != self.caller]

    def token(self, name: str) -> str:
        return self.state["keys"][name]["token"]

    def is_admin(self, name: str | None) -> bool:
        return name is not None and self.state["keys"][name]["role"] == "admin"

    def record_owner(self, job_id: str, name: str) -> str | None:
        """Register ``job_id`` as ``name``'s; returns the other owner it already had, if any."""
        with self.lock:
            known = self.owners.get(job_id)
            if known is None:
                self.owners[job_id] = name
                with self.registry_path.open("a") as fh:
                    fh.write(f"{job_id} {name}\n")
            return known if known not in (None, name) else None

    def write_stats(self) -> None:
        stats = {"caller": self.caller, "requests": dict(self.requests), "statuses": dict(self.statuses),
                 "server_errors": self.server_errors, "probes": dict(self.probes)}
        Path(os.environ[STATS_ENV]).write_text(json.dumps(stats, indent=1))


_HOOKS = _Hooks(Path(os.environ[STATE_ENV])) if os.environ.get(STATE_ENV) else None
if _HOOKS is not None:
    atexit.register(_HOOKS.write_stats)


def _operation_id(case: Any) -> str:
    return str(case.operation.definition.raw.get("operationId", case.operation.label))


def _caller_of(response: Any) -> str | None:
    header = response.request.headers.get("Authorization", "") if response.request is not None else ""
    token = header[len("Bearer "):] if header.startswith("Bearer ") else None
    return _HOOKS.by_token.get(token) if _HOOKS is not None and token else None


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _error_code(body: Any) -> str | None:
    return body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if _HOOKS is None or case.meta is None:
        return
    op = _operation_id(case)
    positive = case.meta.generation.mode.is_positive
    if op == "createJob" and positive and isinstance(case.body, dict):
        _shrink_calibration(case.body)
    if op in JOB_READS and positive and case.meta.phase.name != "stateful":
        _point_at_a_real_job(case)
    own_job = _HOOKS.state["jobs"][_HOOKS.caller]["id"]
    if op == "deleteJob" and str((case.path_parameters or {}).get("job_id")) == own_job:
        case.path_parameters["job_id"] = uuid.uuid4().hex  # keep the job the reads above point at


def _shrink_calibration(body: dict[str, Any]) -> None:
    """Scale an accepted calibration down to SMALL_CALIBRATION; one the service would refuse stays as it is."""
    calibration = body.get("calibration")
    if not isinstance(calibration, dict):
        return
    sizes = {k: calibration.get(k) for k in SMALL_CALIBRATION}
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1) for v in sizes.values()):
        return
    steps, batch, seq = (sizes[k] or DEFAULT_CALIBRATION[k] for k in SMALL_CALIBRATION)
    if batch * seq > STEP_TOKENS or steps * batch * seq > RUN_TOKENS:
        return  # a semantic refusal the fuzzer is testing
    for key, small in SMALL_CALIBRATION.items():
        if sizes[key] is not None:
            calibration[key] = min(sizes[key], small)


def _point_at_a_real_job(case: Any) -> None:
    """The caller's succeeded job (6 in 10), the other user's (3 in 10), or the generated id (1 in 10)."""
    draw = _HOOKS.rng.random()
    if draw >= 0.9:
        return
    owner = _HOOKS.caller if draw < 0.6 else _HOOKS.rng.choice(_HOOKS.others())
    job = _HOOKS.state["jobs"][owner]
    case.path_parameters["job_id"] = job["id"]
    if "name" in case.path_parameters:
        case.path_parameters["name"] = _HOOKS.rng.choice(job["artifacts"])


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    if _HOOKS is None:
        return
    op = _operation_id(case)
    with _HOOKS.lock:
        _HOOKS.requests[op] += 1
        _HOOKS.statuses[str(response.status_code)] += 1
        if response.status_code >= 500 and len(_HOOKS.server_errors) < 50:
            _HOOKS.server_errors.append({
                "operation": op, "method": case.method, "url": response.request.url,
                "status": response.status_code, "body": response.content[:600].decode(errors="replace"),
                "curl": case.as_curl_command(base_url=_HOOKS.state["base_url"]),
            })


@schemathesis.check
def keys_see_only_their_jobs(ctx: Any, response: Any, case: Any) -> None:
    """A job exists only for the key that created it (and the admin); see the module docstring."""
    if _HOOKS is None:
        return None
    caller = _caller_of(response)
    if caller is None:
        return None
    op, status, body = _operation_id(case), response.status_code, None
    if op == "createJob" and status in (200, 202):
        body = _json(response)
        other = _HOOKS.record_owner(str(body["id"]), caller) if isinstance(body, dict) and "id" in body else None
        assert other is None, f"job {body['id']} was created by {other} and handed to {caller} as well"
    if op == "listJobs" and status == 200 and not _HOOKS.is_admin(caller):
        body = _json(response)
        foreign = [j["id"] for j in (body or {}).get("data", []) if _HOOKS.owners.get(j.get("id"), caller) != caller]
        assert not foreign, f"GET /v1/jobs as {caller} lists other users' jobs: {foreign}"
    job_id = str((case.path_parameters or {}).get("job_id", ""))
    owner = _HOOKS.owners.get(job_id)
    if owner is None or _HOOKS.is_admin(caller):
        return None
    if owner != caller:
        _HOOKS.probes["foreign"] += 1
        _assert_not_found(response, f"{caller} sent {owner}'s job {job_id}")
    elif 200 <= status < 400 or status in _REVEALING:
        _replay_as_others(case, response, job_id)
    return None


def _assert_not_found(response: Any, what: str) -> None:
    status = response.status_code
    assert not (200 <= status < 400 or status in _REVEALING), f"{what}: answered {status} (must be 404)"
    if status == 404 and response.request.method != "HEAD":  # a HEAD answer has no body
        code = _error_code(_json(response))
        assert code == "job_not_found", f"{what}: 404 with code {code!r}, not job_not_found"


def _replay_as_others(case: Any, response: Any, job_id: str) -> None:
    """Send the request that found the caller's job as the other user (404) and, for getJob, as the admin."""
    for name in _HOOKS.others():
        replayed = _replay(response, name)
        _HOOKS.probes["replayed"] += 1
        what = f"{case.method} {response.request.url} found {_HOOKS.caller}'s job; as {name} it"
        assert replayed.status_code == 404, f"{what} answered {replayed.status_code} (must be 404)"
        code = _error_code(_json(replayed)) if case.method != "HEAD" else "job_not_found"
        assert code == "job_not_found", f"{what} answered 404 with code {code!r}"
    if _operation_id(case) == "getJob" and response.status_code == 200:
        replayed = _replay(response, ADMIN)
        body = _json(replayed)
        assert replayed.status_code == 200 and isinstance(body, dict), \
            f"GET /v1/jobs/{job_id} as the admin answered {replayed.status_code}"
        assert body.get("request") is None, f"the admin was shown {_HOOKS.caller}'s request of job {job_id}"


def _replay(response: Any, name: str) -> Any:
    request = response.request.copy()
    request.headers["Authorization"] = f"Bearer {_HOOKS.token(name)}"
    replayed = _HOOKS.session.send(request, stream=True, timeout=30, allow_redirects=False)
    try:
        # a body is read only when small: an event stream a leak opened would never end
        if replayed.status_code != 200 or "event-stream" not in replayed.headers.get("content-type", ""):
            replayed._content = replayed.raw.read(1 << 20, decode_content=True)
    finally:
        replayed.close()
    return replayed


# ----------------------------------------------------------------------------------------------------------
# The driver: server, keys, jobs, the schemathesis passes, the report.
# ----------------------------------------------------------------------------------------------------------

def _config_toml(args: argparse.Namespace, max_time: int, report_dir: Path) -> str:
    # positive_data_acceptance is replaced by the semantic-refusal check; every other check stays on
    return f"""\
seed = {args.seed}
max-time = {max_time}
workers = 1
request-timeout = 30
suppress-health-check = ["all"]

[reports]
directory = "{report_dir}"
json = {{ enabled = true }}

[auth.openapi.apiKey]
bearer = "${{{TOKEN_ENV}}}"

[generation]
mode = "all"

[checks]
positive_data_acceptance = {{ enabled = false }}

[phases.stateful]
enabled = true
max-steps = 8

# an event stream of a job still queued ends only with the job: read it for a few seconds
[[operations]]
include-operation-id = "streamJobEvents"
request-timeout = 3
"""


def _create_key(data_dir: Path, name: str, role: str) -> str:
    from tests.service_helpers import fp8forge_command

    env = {**os.environ, "FP8FORGE_DATA_DIR": str(data_dir)}
    out = subprocess.run([*fp8forge_command(), "keys", "create", name, "--role", role], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def _run_setup_jobs(base_url: str, tokens: dict[str, str], models: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Submit a small job per user (all at once: the worker runs them in turn), wait for each to succeed; then
    one analysis, to start the analysis process.

    Returns each user's job id and artifact names. Raises SystemExit when one fails or takes over 600 s.
    """
    body = {"recipe": {"backend": "ao"}, "calibration": {"steps": 1, "batch_size": 1, "seq_len": 16}}
    jobs = {}
    with requests.Session() as http:
        def call(method: str, path: str, user: str, **kwargs: Any) -> Any:
            response = http.request(method, f"{base_url}{path}", timeout=60,
                                    headers={"Authorization": f"Bearer {tokens[user]}"}, **kwargs)
            response.raise_for_status()
            return response.json()

        ids = {user: call("POST", "/v1/jobs", user, json={"model": model, **body})["id"]
               for user, model in models.items()}
        deadline = time.monotonic() + 600
        for user, job_id in ids.items():
            while (job := call("GET", f"/v1/jobs/{job_id}", user))["status"] not in ("succeeded", "failed",
                                                                                     "cancelled"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"setup job {job_id} did not finish in 600 s: {job}")
                time.sleep(0.5)
            if job["status"] != "succeeded":
                raise SystemExit(f"setup job {job_id} ended {job['status']}: {job.get('error')}")
            listed = call("GET", f"/v1/jobs/{job_id}/artifacts", user)
            jobs[user] = {"id": job_id, "artifacts": [a["name"] for a in listed["data"]]}
        # the first analysis starts the analysis process (torch, transformers): not on the first pass's clock
        call("POST", "/v1/analyze", USERS[0], json={"model": "demo/tiny-llama"})
    return jobs


def _run_pass(args: argparse.Namespace, tmp: Path, state_path: Path, base_url: str, user: str, token: str,
              max_time: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """One `schemathesis run` as ``user``; returns its exit status, the hooks' counts and its JSON report."""
    report_dir = tmp / f"report-{user}"
    config = tmp / f"schemathesis-{user}.toml"
    config.write_text(_config_toml(args, max_time, report_dir))
    stats_path = tmp / f"stats-{user}.json"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(Path(__file__).resolve()), STATE_ENV: str(state_path),
           CALLER_ENV: user, STATS_ENV: str(stats_path), TOKEN_ENV: token, "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config), "run",
           f"{base_url}/openapi.json"]
    print(f"\n=== schemathesis as {user}, max-time {max_time} s ===", flush=True)
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    reports = sorted(report_dir.glob("*.json")) if report_dir.exists() else []
    report = json.loads(reports[-1].read_text()) if reports else {}
    return rc, stats, report


def _internal_error_jobs(base_url: str, token: str) -> list[dict[str, Any]]:
    """Jobs (any owner) that failed with internal_error, read as the admin."""
    found, cursor = [], None
    with requests.Session() as http:
        http.headers["Authorization"] = f"Bearer {token}"
        while True:
            params = {"status": "failed", "limit": 200, **({"cursor": cursor} if cursor else {})}
            page = http.get(f"{base_url}/v1/jobs", params=params, timeout=60).json()
            found += [j for j in page["data"] if (j.get("error") or {}).get("code") == "internal_error"]
            cursor = page.get("next_cursor")
            if not cursor:
                return found


def _log_findings(log: Path) -> list[str]:
    """Lines of the server log that mention a traceback or an internal error, each with the traceback after it."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    found, n = [], 0
    while n < len(lines):
        if not LOG_FINDINGS.search(lines[n]):
            n += 1
            continue
        end = n + 1
        while end < len(lines) and (not lines[end].strip() or _TRACEBACK_LINE.match(lines[end])):
            end += 1
        start = n - 1 if n > 0 and lines[n].startswith("Traceback") else n  # with the line that logged it
        found.append("\n".join(lines[start:min(end, n + 80)]))
        n = end
    return found


def _summary(args, started: float, passes: list[tuple[str, int, dict, dict]], log_findings: list[str],
             failed_jobs: list[dict], operations: int) -> bool:
    requests_ = Counter()
    statuses = Counter()
    probes = Counter()
    server_errors = []
    for _, _, stats, _ in passes:
        requests_.update(stats.get("requests", {}))
        statuses.update(stats.get("statuses", {}))
        probes.update(stats.get("probes", {}))
        server_errors += stats.get("server_errors", [])
    print("\n=== fuzz_api summary ===")
    for user, rc, stats, report in passes:
        cases = _report_cases(report)
        print(f"  pass as {user}: schemathesis exit {rc}, {cases}, {sum(stats.get('requests', {}).values())} "
              f"requests{'' if stats else ' (the hooks wrote no counts)'}")
    print(f"  operations: {operations} in the schema, {len(requests_)} called")
    print(f"  requests by operation: {dict(sorted(requests_.items()))}")
    print(f"  statuses: {dict(sorted(statuses.items()))}")
    print(f"  cross-key probes: {probes.get('foreign', 0)} foreign job ids sent, "
          f"{probes.get('replayed', 0)} replays as the other user")
    print(f"  server errors (5xx): {sum(v for k, v in statuses.items() if k.startswith('5'))}")
    for err in server_errors:
        print(f"    {err['status']} {err['operation']} {err['method']} {err['url']}\n      {err['body'][:300]}\n"
              f"      {err['curl']}")
    print(f"  server log: {len(log_findings)} Traceback/internal_error finding(s)")
    for text in log_findings[:20]:
        print("    " + text.replace("\n", "\n    "))
    print(f"  jobs failed with internal_error: {len(failed_jobs)}")
    for job in failed_jobs[:20]:
        print(f"    {job['id']}: {job['error']}")
    print(f"  duration: {time.monotonic() - started:.0f} s (budget {args.minutes} min)")
    ok = (all(rc == 0 for _, rc, _, _ in passes) and not server_errors and not log_findings and not failed_jobs
          and not any(k.startswith("5") for k in statuses) and all(stats for _, _, stats, _ in passes))
    print(f"  result: {'PASS' if ok else 'FAIL'}")
    return ok


def _report_cases(report: dict[str, Any]) -> str:
    cases = report.get("test_cases", {})
    return (f"{cases.get('generated', '?')} cases ({cases.get('with_failures', '?')} failing, "
            f"{cases.get('unique_failures', '?')} unique failures, {cases.get('errored', '?')} errored), "
            f"stop: {report.get('stop_reason', '?')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10, help="wall-clock budget (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--keep", action="store_true", help="keep the temporary dir even when the run passes")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.minutes * 60

    from tests.service_helpers import ServeProcess, build_tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="fp8forge-fuzz-"))
    data_dir, models = tmp / "data", tmp / "models"
    build_tiny_llama(models / "tiny-llama")
    keys = {name: {"token": _create_key(data_dir, name, "user"), "role": "user"} for name in USERS}
    keys[ADMIN] = {"token": _create_key(data_dir, ADMIN, "admin"), "role": "admin"}
    server = ServeProcess(data_dir, workers=1, env={
        "FP8FORGE_ALLOWED_MODEL_ROOTS": str(models), "FP8FORGE_MAX_QUEUED_JOBS_PER_KEY": "1000",
        "FP8FORGE_CONVERSION_THREADS": "1"})
    server.env.pop("FP8FORGE_AUTH_DISABLED")  # authentication on
    passes: list[tuple[str, int, dict, dict]] = []
    ok = False
    try:
        server.start()
        print(f"fp8forge serve on {server.base_url}, data in {tmp}; running one small job per user", flush=True)
        # alice's model is a local path under the allowed root, bob's the built-in demo
        jobs = _run_setup_jobs(server.base_url, {user: keys[user]["token"] for user in USERS},
                               {"alice": str(models / "tiny-llama"), "bob": "demo/tiny-llama"})
        registry = tmp / "job_owners.txt"
        registry.write_text("".join(f"{job['id']} {user}\n" for user, job in jobs.items()))
        state_path = tmp / "state.json"
        state_path.write_text(json.dumps({"base_url": server.base_url, "keys": keys, "jobs": jobs,
                                          "registry": str(registry), "seed": args.seed}, indent=1))
        schema = requests.get(f"{server.base_url}/openapi.json", timeout=30).json()
        operations = sum(1 for ops in schema["paths"].values() for m in ops if m != "parameters")
        for n, user in enumerate(USERS):
            max_time = max(30, int((deadline - time.monotonic()) / (len(USERS) - n)))
            rc, stats, report = _run_pass(args, tmp, state_path, server.base_url, user, keys[user]["token"], max_time)
            passes.append((user, rc, stats, report))
        failed_jobs = _internal_error_jobs(server.base_url, keys[ADMIN]["token"])
    finally:
        server.stop()
    ok = _summary(args, started, passes, _log_findings(server.log), failed_jobs, operations)
    if ok and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"  kept: {tmp} (server log {server.log.name}, keys in state.json, reports report-*/)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
