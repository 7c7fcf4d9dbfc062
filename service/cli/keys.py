"""``fp8forge keys``: create API keys for the service (only their SHA-256 is stored) and list them.

Only ``argparse`` is imported at module level, as in ``service.cli.serve``.
"""

from __future__ import annotations

import argparse
import os
import sys

from service.config import SettingsError, load_settings, make_private_dir

__all__ = ["register", "create_first_key"]


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser(
        "keys", help="create and list API keys",
        description="API keys for `fp8forge serve`. A key is shown once, when it is created; the key file keeps "
                    "only its SHA-256. Several keys may share a name (rotation): they own the same jobs.",
    )
    actions = keys.add_subparsers(dest="keys_command", required=True)
    create = actions.add_parser("create", help="create a key and add it to the key file")
    create.add_argument("name", help="who the key belongs to; jobs are owned by this name")
    create.add_argument("--role", choices=["user", "admin"], default="user",
                        help="admin sees every job (not their requests); default: %(default)s")
    create.add_argument("--file", default=None, metavar="PATH",
                        help="key file to append to (default: FP8FORGE_API_KEYS_FILE, else <data dir>/api_keys)")
    create.set_defaults(func=_create)
    listing = actions.add_parser("list", help="list the names and roles in the key file")
    listing.add_argument("--file", default=None, metavar="PATH", help="key file (default as for create)")
    listing.set_defaults(func=_list)


def _key_file(args: argparse.Namespace):
    from pathlib import Path

    from service.api.auth import default_keys_file  # the API stack (fastapi): not at the CLI's start-up

    if args.file:
        return Path(args.file)
    try:
        return default_keys_file(load_settings())
    except SettingsError as exc:
        print(f"fp8forge: {exc}", file=sys.stderr)
        return None


def _append_key(path, name: str, role: str) -> str:
    """Create a key, append its entry to the key file at ``path``; returns the token. Raises SettingsError."""
    from service.api.auth import key_entry, new_token  # the API stack (fastapi): not at the CLI's start-up

    token = new_token()
    entry = key_entry(name, role, token)
    make_private_dir(path.parent)  # the data dir, when this is the first thing to create it
    # the file holds hashes only, yet nobody else needs to read it
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(entry + "\n")
    return token


def _create(args: argparse.Namespace) -> int:
    path = _key_file(args)
    if path is None:
        return 2
    try:
        token = _append_key(path, args.name, args.role)
    except SettingsError as exc:
        print(f"fp8forge: {exc}", file=sys.stderr)
        return 2
    print(f"fp8forge: added {args.role} key for {args.name!r} to {path}; a running server reads keys at start-up, "
          "so restart it. The key (shown only now):", file=sys.stderr)
    print(token)
    return 0


def create_first_key(settings, name: str) -> None:
    """``fp8forge serve --first-key NAME``: with authentication on and no key configured anywhere (a fresh data
    volume), create an admin key NAME in the key file and print it once, so that a server started with nothing
    prepared (the Docker image) comes up usable instead of refusing to start. Does nothing otherwise.

    Raises:
        SettingsError: NAME is not a valid key name, or the key file is malformed.
    """
    from service.api.auth import KeyRing, default_keys_file  # the API stack (fastapi): not at the CLI's start-up

    if settings.auth_disabled:
        return
    try:
        KeyRing.from_settings(settings)
        return  # some key is configured already
    except SettingsError:
        path = default_keys_file(settings)
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        if settings.api_keys or any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines()):
            raise  # keys that do not parse: say so, never add to them
    token = _append_key(path, name, "admin")
    print(f"fp8forge: no API key was configured, so an admin key {name!r} was created in {path} (only its SHA-256 "
          f"is stored). Send it as `Authorization: Bearer <key>`; it is shown only now:\n{token}\n"
          "More keys: `fp8forge keys create NAME` with the same data directory (docs/security.md).",
          file=sys.stderr, flush=True)


def _list(args: argparse.Namespace) -> int:
    path = _key_file(args)
    if path is None:
        return 2
    if not path.exists():
        print(f"fp8forge: no key file at {path}; create a key with `fp8forge keys create NAME`", file=sys.stderr)
        return 1
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, role, digest = (line.strip().split(":") + ["", "", ""])[:3]
            print(f"{name}\t{role}\tsha256:{digest[:12]}…")
    return 0
