"""The ``fp8forge serve`` and ``fp8forge worker`` subcommands.

Only ``argparse`` is imported at module level: ``fp8forge analyze`` builds the same parser and must not pay
for (or require) the web stack.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from service.cli.keys import create_first_key
from service.config import SettingsError, load_settings
from service.workers.procs import configure_logging  # the service stack: not at the CLI's start-up

if TYPE_CHECKING:
    from service.config import Settings

__all__ = ["register", "run_serve", "run_worker", "main"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``worker`` to the ``fp8forge`` parser; each sets ``func(args) -> exit code``."""
    serve = subparsers.add_parser(
        "serve", help="run the REST API and local workers",
        description="Start the HTTP API and, by default, local worker processes sharing the job store "
                    "(SQLite under FP8FORGE_DATA_DIR unless FP8FORGE_DATABASE_URL is set).",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--workers", type=int, default=None, metavar="N",
                       help="local worker processes; 0 runs the API only (default: FP8FORGE_WORKERS, "
                            "else one per GPU, or one)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="level of fp8forge's own log lines, the workers' included (default: %(default)s)")
    serve.add_argument("--first-key", default=None, metavar="NAME",
                       help="with API keys on and none configured yet (a fresh data directory), create an admin key "
                            "NAME and print it once instead of refusing to start (the Docker image's default)")
    serve.set_defaults(func=run_serve)

    worker = subparsers.add_parser(
        "worker", help="run one conversion worker",
        description="Claim and run conversion jobs from the shared job store, one at a time. Run one per GPU; "
                    "stop with SIGTERM or Ctrl-C (a running job is requeued). On a host of its own it needs "
                    "FP8FORGE_DATABASE_URL and, without a shared disk, FP8FORGE_ARTIFACT_STORE=s3 with the "
                    "FP8FORGE_S3_* settings (docs/deployment.md).",
    )
    worker.add_argument("--gpu", default=None, metavar="ID", help="CUDA device this worker uses")
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="level of fp8forge's own log lines, its conversions' included (default: %(default)s)")
    worker.set_defaults(func=run_worker)


def _settings(**overrides: object) -> Settings | None:
    try:
        return load_settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        print(f"fp8forge: {exc}", file=sys.stderr)
        return None


def _storage_reachable(settings: Settings) -> bool:
    """Check an object store at start-up, so a wrong bucket or credentials stop the process with a message."""
    if settings.artifact_store == "local":
        return True
    from service.artifacts import (  # the service stack (fastapi): not at the CLI's start-up
        ArtifactStoreUnavailable,
        open_storage,
    )  # the service stack (fastapi): not at the CLI's start-up

    try:
        open_storage(settings).check()
    except ArtifactStoreUnavailable as exc:
        print(f"fp8forge: {exc.message}; check FP8FORGE_S3_BUCKET, FP8FORGE_S3_ENDPOINT_URL and the AWS_* "
              "credentials", file=sys.stderr)
        return False
    return True


def run_serve(args: argparse.Namespace) -> int:
    """Run the API in this process and the worker pool beside it until SIGINT/SIGTERM."""
    settings = _settings(workers=args.workers)
    if settings is None or not _storage_reachable(settings):
        return 2
    if settings.auth_disabled and not _is_loopback(args.host):
        print(f"fp8forge: FP8FORGE_AUTH_DISABLED lets anyone who reaches {args.host} run and read every job; it is "
              "only allowed on a loopback address (--host 127.0.0.1). Create keys with `fp8forge keys create NAME` "
              "to serve on the network.", file=sys.stderr)
        return 2

    import uvicorn

    from service.main import create_app  # the service stack (fastapi, sqlalchemy): not at the CLI's start-up
    from service.store import JobStore  # the service stack (sqlalchemy): not at the CLI's start-up
    from service.workers.pool import default_worker_count, make_executor  # the service stack: not at the CLI's start-up

    configure_logging(args.log_level, "api")
    try:
        if args.first_key:
            create_first_key(settings, args.first_key)
        app = create_app(settings)  # reads the API keys: refuse to start without any, rather than refuse everyone
    except SettingsError as exc:
        print(f"fp8forge: {exc}", file=sys.stderr)
        return 2
    JobStore.from_settings(settings).close()  # create the schema once, before several processes race to
    count = settings.workers if settings.workers is not None else default_worker_count()
    pool = make_executor(settings, count, log_level=args.log_level)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            pool.begin_stop()  # before the graceful wait: a worker stopped by the same Ctrl-C stays stopped
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    # log_config=None: uvicorn's loggers (start-up, access lines) go through configure_logging's one handler, so
    # they carry the timestamp and [api] tag every other line has, instead of uvicorn's own untimed format
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                            timeout_graceful_shutdown=5)
    server = Server(config)
    pool.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    finally:
        pool.stop()
    return 0 if server.started else 1  # not started: e.g. the port is taken (uvicorn logged why)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_worker(args: argparse.Namespace) -> int:
    """Run one worker in this process until SIGINT/SIGTERM."""
    settings = _settings()
    if settings is None or not _storage_reachable(settings):
        return 2
    from service.workers.worker import worker_process_main  # the service stack: not at the CLI's start-up

    worker_process_main(settings, gpu=args.gpu, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m service.cli.serve serve``); ``fp8forge`` is the usual one."""
    parser = argparse.ArgumentParser(prog="fp8forge")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
