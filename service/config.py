"""Service settings: every knob comes from ``FP8FORGE_*`` environment variables, validated at start-up."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from converters.model.config_checks import ConfigLimits

__all__ = ["Settings", "SettingsError", "load_settings", "make_private_dir", "make_private_file"]

ENV_PREFIX = "FP8FORGE_"

logger = logging.getLogger(__name__)


class SettingsError(ValueError):
    """The environment holds an invalid setting; the message names the variable and what it accepts."""


class Settings(BaseSettings):
    """Configuration of the API, the job store and the workers.

    Each field is read from ``FP8FORGE_<FIELD NAME IN CAPITALS>``; ``docs/service.md`` lists them.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    data_dir: Path = Field(Path("data"), description="Root of the SQLite store, job artifacts, demo models.")
    database_url: str = Field("", description="SQLAlchemy URL; empty means SQLite under the data dir.")
    allowed_model_roots: Annotated[tuple[Path, ...], NoDecode] = Field(
        (), description="Directories local model references may point into (os.pathsep-separated)."
    )
    hf_cache: Path | None = Field(None, description="Hugging Face cache directory (default: HF's own).")
    hf_offline: bool = Field(False, description="Never contact the Hugging Face Hub.")
    trust_remote_code: bool = Field(False, description="Allow models that ship their own code.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest accepted request body.")
    workers: int | None = Field(
        None, ge=0, le=64, description="Local workers `fp8forge serve` starts; unset: one per GPU, or one."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="How often a worker heartbeats.")
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="Silence after which a job is requeued.")
    max_attempts: int = Field(3, ge=1, le=100, description="Attempts per job before it fails for good.")
    poll_interval_s: float = Field(1.0, gt=0, description="How often an idle worker looks for work.")
    cancel_grace_s: float = Field(2.0, ge=0, description="Time a cancelled run gets to stop by itself.")
    conversion_threads: int | None = Field(
        None, ge=1, le=1024,
        description="CPU threads each conversion child may use; unset: all cores but one, shared by the local workers."
    )
    auth_disabled: bool = Field(
        False, description="Serve without API keys (every caller is an admin); only on a loopback address."
    )
    api_keys_file: Path | None = Field(
        None, description="File of API keys, one 'name:role:sha256-of-token' per line (`fp8forge keys create`)."
    )
    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="More API keys in the same 'name:role:sha256' form, comma-separated."
    )
    max_queued_jobs_per_key: int = Field(
        20, ge=1, le=100_000, description="Queued jobs one key may have; more are refused with 429."
    )
    max_running_jobs_per_key: int = Field(
        2, ge=1, le=10_000, description="Jobs of one key that workers run at the same time."
    )
    ui_enabled: bool = Field(True, description="Serve the web UI under /ui (it calls the public API only).")
    artifact_store: Literal["local", "s3"] = Field(
        "local", description="Where job artifacts live: 'local' (the data dir) or 's3' (an S3-compatible bucket)."
    )
    s3_bucket: str = Field("", description="Bucket of the s3 artifact store (required with artifact_store=s3).")
    s3_prefix: str = Field("", description="Key prefix inside the bucket, e.g. 'fp8forge/'.")
    s3_endpoint_url: str = Field("", description="Endpoint of an S3-compatible store; empty means AWS S3.")
    s3_region: str = Field("", description="Region; empty means AWS_REGION / AWS_DEFAULT_REGION, else us-east-1.")
    s3_part_size_bytes: int = Field(
        16 << 20, ge=5 << 20, le=5 << 30, description="Multipart upload part size (S3: 5 MiB to 5 GiB)."
    )
    s3_upload_concurrency: int = Field(4, ge=1, le=64, description="Parts of one file uploaded at once.")
    artifact_downloads: Literal["stream", "redirect"] = Field(
        "stream", description="s3 store: the API streams downloads, or redirects to a pre-signed URL."
    )
    presigned_url_ttl_s: int = Field(900, ge=1, le=604_800, description="Lifetime of a pre-signed download URL.")
    shard_export: Literal["auto", "on", "off"] = Field(
        "auto", description="A calibrated job's serving export as shard tasks any worker writes: 'auto' (PostgreSQL, "
                            "the local artifact store, several weight files), 'on' (the data dir is shared) or 'off'."
    )
    artifact_sweep_interval_s: float = Field(
        300.0, gt=0, description="How often workers and the API remove attempt files no job points at."
    )
    # Bounds on waiting for the job store, so a process stopped inside a transaction cannot stall the others.
    store_lock_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait for a lock another transaction holds (PostgreSQL lock_timeout, "
                                "SQLite busy timeout); then the statement fails and is retried later."
    )
    store_statement_timeout_s: float = Field(60.0, gt=0, description="PostgreSQL: longest one statement may run.")
    store_idle_in_transaction_timeout_s: float = Field(
        60.0, gt=0, description="PostgreSQL: a session idle inside a transaction this long (its process stopped) is "
                                "ended by the server, releasing its locks."
    )
    ready_timeout_s: float = Field(
        2.0, gt=0, description="/readyz answers 503 when the job store does not answer within this many seconds."
    )
    # Bounds on what a model's config.json may declare, checked before anything is built from it (analysis and
    # conversion); the defaults admit Llama-3.1-405B, DeepSeek-V3, Kimi-K2, Qwen3-Next and Gemma 3 with room.
    max_model_layers: int = Field(1_000, ge=1, description="Layers one stack of a model config may declare.")
    max_model_dim: int = Field(
        262_144, ge=1, description="Largest width or head count a model config may declare (hidden, intermediate)."
    )
    max_model_experts: int = Field(2_048, ge=1, description="Experts per MoE layer a model config may declare.")
    max_model_vocab: int = Field(2_097_152, ge=1, description="Largest vocab_size a model config may declare.")
    max_model_parameters: int = Field(
        4_000_000_000_000, ge=1, description="Parameters a model config may declare (estimated from its fields)."
    )
    analyze_workers: int = Field(
        2, ge=1, le=64, description="Processes that run /v1/analyze (each builds models; the API's threads never do)."
    )
    analyze_queue_depth: int = Field(
        8, ge=0, le=10_000, description="/v1/analyze requests that may wait for a process; more get 503 + Retry-After."
    )
    analyze_timeout_s: float = Field(
        300.0, gt=0, description="Time one analysis may take; its process is then replaced and the request gets 503."
    )
    executor: Literal["local", "slurm"] = Field(
        "local", description="Who runs jobs: 'local' (the worker processes `fp8forge serve` starts) or 'slurm' (each "
                             "job a Slurm batch job, a requantize job a Slurm array; docs/deployment.md)."
    )
    slurm_partition: str = Field("", description="Slurm partition jobs go to; empty: the cluster's default.")
    slurm_account: str = Field("", description="Slurm account charged for the jobs; empty: the user's default.")
    slurm_nodes: int = Field(1, ge=1, le=4096, description="Nodes of a calibrated job's Slurm allocation.")
    slurm_gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node a Slurm job asks for (0: none).")
    slurm_ranks_per_node: int | None = Field(
        None, ge=1, le=256, description="torch.distributed ranks per node of a calibrated job; unset: one per GPU, "
                                        "or one. More needs the data-parallel calibration (docs/distributed.md)."
    )
    slurm_cpus_per_rank: int | None = Field(
        None, ge=1, le=1024, description="CPUs each rank (and each requantize array task) asks for; unset: Slurm's."
    )
    slurm_time_limit: str = Field(
        "", pattern=r"^$|^(\d+-)?\d+(:\d{1,2}){0,2}$",
        description="Wall-time limit of each Slurm job (minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]); a job still "
                    "running at the limit is requeued and runs again in a new allocation. Empty: the partition's."
    )
    slurm_array_tasks: int = Field(
        4, ge=1, le=10_000, description="Array tasks of a requantize job's Slurm array (each a worker of its shards)."
    )
    slurm_work_dir: Path | None = Field(
        None, description="Directory every Slurm node reads (settings of the ranks, Slurm's output files); "
                          "unset: <data dir>/slurm."
    )
    slurm_python: str = Field(
        "", description="Python of the fp8forge install on the Slurm nodes; empty: the one running the service."
    )
    max_event_streams_per_key: int = Field(
        16, ge=1, le=10_000, description="Open event streams (GET /v1/jobs/{id}/events) per API key; more get 429."
    )

    @field_validator("allowed_model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part for part in value.split(os.pathsep) if part.strip())
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("allowed_model_roots")
    @classmethod
    def _absolute_roots(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        return tuple(root.expanduser().resolve() for root in roots)

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, data_dir: Path) -> Path:
        return data_dir.expanduser().resolve()

    @field_validator("database_url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if url and not url.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:// or postgresql+psycopg:// SQLAlchemy URL")
        return url

    @field_validator("s3_prefix")
    @classmethod
    def _prefix_is_a_folder(cls, prefix: str) -> str:
        prefix = prefix.strip("/")
        return f"{prefix}/" if prefix else ""

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be at least twice heartbeat_interval_s")
        if self.artifact_store == "s3" and not self.s3_bucket:
            raise ValueError("artifact_store=s3 needs FP8FORGE_S3_BUCKET")
        return self

    @property
    def store_url(self) -> str:
        """The database URL actually used: the configured one or SQLite under the data dir."""
        return self.database_url or f"sqlite:///{self.data_dir / 'fp8forge.db'}"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def slurm_dir(self) -> Path:
        """Where the Slurm executor writes what its jobs read on the nodes (a directory they share)."""
        return self.slurm_work_dir or self.data_dir / "slurm"

    @property
    def demo_dir(self) -> Path:
        return self.data_dir / "demo-models"

    def model_sources(self) -> dict[str, Any]:
        """Keyword arguments for ``converters.model.sources.ModelSourceOptions`` (built where converters load)."""
        return {
            "allowed_roots": self.allowed_model_roots,
            "cache_dir": self.hf_cache,
            "offline": self.hf_offline,
            "trust_remote_code": self.trust_remote_code,
            "demo_dir": self.demo_dir,
            "reveal_roots": False,
            # A model directory's links must not reach the server's own files (database, keys, artifacts).
            "private_paths": (self.data_dir, *([self.api_keys_file] if self.api_keys_file else [])),
            "config_limits": self.config_limits(),
        }

    def config_limits(self) -> Any:
        """``converters.model.config_checks.ConfigLimits`` from the ``max_model_*`` settings."""
        return ConfigLimits(max_layers=self.max_model_layers, max_dim=self.max_model_dim,
                            max_experts=self.max_model_experts, max_vocab=self.max_model_vocab,
                            max_parameters=self.max_model_parameters)


def load_settings(**overrides: Any) -> Settings:
    """Read the settings from the environment (``overrides`` win) and validate them.

    Raises:
        SettingsError: a variable is malformed, or an ``FP8FORGE_*`` variable is not a setting (a misspelt
            name would otherwise be ignored without a word); the message names ``FP8FORGE_<NAME>``.
    """
    valid = sorted(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)
    unknown = sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in valid)
    if unknown:
        raise SettingsError(f"unknown setting {', '.join(unknown)}; valid variables are: {', '.join(valid)}")
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{ENV_PREFIX}{'_'.join(str(p) for p in err['loc']).upper() or '*'}: {err['msg']}"
            for err in exc.errors()
        )
        raise SettingsError(f"invalid settings: {problems}") from exc


def make_private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents readable by this user alone (0700, whatever the umask); returns it.

    The data dir holds every tenant's jobs (calibration texts, reports, weights) and the database: under the usual
    umask (022) a plain ``mkdir`` lets any local user read them. A directory that already exists keeps its mode
    (an operator may have chosen it, a shared mount for one); one that others can enter is logged as a warning.
    """
    missing = []
    directory = Path(path)
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another process of this service made it first, with this same mode
            continue
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask; this one is exact
    if not missing and stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        logger.warning("%s is open to other local users (mode %o): chmod 700 it to keep jobs and the database "
                       "private", path, stat.S_IMODE(os.stat(path).st_mode))
    return path


def make_private_file(path: Path) -> Path:
    """Create ``path`` empty if it is missing, readable and writable by this user alone (0600), and take group
    and other access away from it if it exists (the SQLite database: SQLite creates files 0644 less the umask, and
    gives its -wal and -shm files the database's own mode). Returns ``path``.

    Raises:
        OSError: the file cannot be created, or exists and belongs to another user (chmod refused).
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            os.chmod(path, mode & 0o700)
    return path
