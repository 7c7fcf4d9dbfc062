"""API keys: who is calling, and whether they may see a job.

A key is a random bearer token; the server keeps only its SHA-256 (a token has 256 bits of randomness, so a
fast hash is enough: there is no password to brute-force). Keys come from ``api_keys_file`` (by default
``<data_dir>/api_keys`` when it exists) and the ``api_keys`` setting, one ``name:role:sha256`` entry each.
Several keys may share a name, so a key can be rotated without its owner losing their jobs.

Each job belongs to the name of the key that created it. Other callers get 404 for it, exactly as for a job
that does not exist, so ids cannot be probed; an ``admin`` sees every job, but a job's ``request`` (its
calibration texts) only ever goes to its owner. With ``auth_disabled`` every caller is the local admin.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from service.config import Settings, SettingsError
from service.errors import Unauthorized
from service.jobs import Job

__all__ = [
    "ApiKey", "ApiKeyBearer", "Caller", "CallerDep", "KeyRing", "LOCAL_CALLER", "ROLES", "hash_token", "key_entry",
    "new_token", "require_caller",
]

ROLES = ("user", "admin")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
TOKEN_PREFIX = "fp8f_"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_entry(name: str, role: str, token: str) -> str:
    """The ``name:role:sha256`` line that stores ``token`` (the token itself is never written)."""
    entry = f"{name}:{role}:{hash_token(token)}"
    _parse_entry(entry, "the new key")
    return entry


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: str
    digest: str


@dataclass(frozen=True)
class Caller:
    """Who sent a request. ``local`` marks the single caller of a server run with ``auth_disabled``."""

    name: str
    admin: bool
    local: bool = False

    @property
    def owner(self) -> str | None:
        """What a job this caller creates is stored under (None: no owner, no per-key limits)."""
        return None if self.local else self.name

    def may_see(self, job: Job) -> bool:
        return self.local or self.admin or job.owner == self.name

    def may_read_request(self, job: Job) -> bool:
        return self.local or job.owner == self.name


#: the one caller of a server run with ``auth_disabled`` (and of in-process callers such as tests)
LOCAL_CALLER = Caller("local", admin=True, local=True)


def _parse_entry(entry: str, where: str) -> ApiKey:
    parts = entry.strip().split(":")
    if len(parts) != 3:
        raise SettingsError(f"{where}: an API key entry is 'name:role:sha256', got {len(parts)} part(s)")
    name, role, digest = parts
    if not _NAME.fullmatch(name):
        raise SettingsError(f"{where}: key name {name!r} must be 1-64 letters, digits or _.@- (starting alnum)")
    if role not in ROLES:
        raise SettingsError(f"{where}: role {role!r} must be one of {', '.join(ROLES)}")
    if not _DIGEST.fullmatch(digest):
        raise SettingsError(f"{where}: the third part must be the token's SHA-256 as 64 hex digits "
                            "(`fp8forge keys create` writes it), never the token itself")
    return ApiKey(name, role, digest)


def default_keys_file(settings: Settings) -> Path:
    return settings.api_keys_file or settings.data_dir / "api_keys"


class KeyRing:
    """The keys a server accepts, by digest."""

    def __init__(self, keys: list[ApiKey], *, disabled: bool) -> None:
        self.disabled = disabled
        self._by_digest = {k.digest: k for k in keys}

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """Read the key file and the ``api_keys`` setting.

        Raises:
            SettingsError: a malformed entry (naming its line), a configured key file that cannot be read, or
                no key at all while authentication is on (the message says how to create one or turn it off).
        """
        keys: list[ApiKey] = []
        path = default_keys_file(settings)
        if settings.api_keys_file is not None or path.exists():
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise SettingsError(f"FP8FORGE_API_KEYS_FILE: cannot read {path}: {exc.strerror}") from exc
            keys += [_parse_entry(line, f"{path}:{n}") for n, line in enumerate(lines, 1)
                     if line.strip() and not line.lstrip().startswith("#")]
        keys += [_parse_entry(entry, "FP8FORGE_API_KEYS") for entry in settings.api_keys]
        if not keys and not settings.auth_disabled:
            raise SettingsError(
                "authentication is on but no API key is configured: create one with `fp8forge keys create NAME` "
                f"(it is stored in {path}), or set FP8FORGE_AUTH_DISABLED=1 to serve without keys on 127.0.0.1"
            )
        return cls(keys, disabled=settings.auth_disabled)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller behind an ``Authorization: Bearer <token>`` header.

        Raises:
            Unauthorized (401): no header, not a bearer token, or a token that is not a key here.
        """
        if self.disabled:
            return LOCAL_CALLER
        if not authorization:
            raise Unauthorized("this server needs an API key: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("send the API key as 'Authorization: Bearer <token>'")
        key = self._by_digest.get(hash_token(token.strip()))
        if key is None:
            raise Unauthorized("this API key is not valid here (revoked, mistyped, or for another server)")
        return Caller(key.name, admin=key.role == "admin")


class ApiKeyBearer(HTTPBearer):
    """The ``apiKey`` bearer scheme of the OpenAPI document, resolved straight to the :class:`Caller`.

    One dependency instead of a function over ``HTTPBearer``: FastAPI solves every node of a dependency tree on
    every request, cached or not, and a status poll paid for three such pairs.
    """

    async def __call__(self, request: Request) -> Caller:  # type: ignore[override]  # no I/O: no threadpool hop
        return request.app.state.keys.authenticate(request.headers.get("authorization"))


require_caller = ApiKeyBearer(auto_error=False, scheme_name="apiKey",
                              description="An API key from `fp8forge keys create`, as 'Authorization: Bearer <token>'.")

CallerDep = Annotated[Caller, Depends(require_caller)]
