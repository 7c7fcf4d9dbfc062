"""Model references -> model directories, configs and models.

A reference is one of:
- ``org/name`` or ``org/name@revision``: a Hugging Face hub repository, resolved through
  ``huggingface_hub`` (its cache directory, offline mode honoured, only the files a stage needs);
- an absolute path (or ``./path``) to a local directory, allowed only below a configured root;
- ``demo/tiny-llama``: a tiny Llama built locally from a config on first use (see ``converters.model.demo``).

Analysis instantiates the model from its config alone on the ``meta`` device, so no weight is read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converters.errors import ModelNotFoundError, ModelReferenceError
from converters.model.config_checks import load_checked_config
from converters.model.demo import DEMO_MODEL_REF, ensure_demo_model
from converters.model.files import INDEX_NAME, FileConfinement, check_model_directory, staged_model_directory
from converters.model.presence import check_local_model_present
from converters.third_party_noise import transformers_progress_off

if TYPE_CHECKING:
    import torch

__all__ = [
    "ModelSourceOptions",
    "ModelReference",
    "parse_model_reference",
    "validate_model_reference",
    "resolve_model_dir",
    "confinement_for",
    "load_config",
    "build_meta_model",
    "load_model",
    "load_tokenizer",
    "model_dtype",
    "model_class",
    "CONFIG_FILES",
    "WEIGHT_FILES",
    "TOKENIZER_FILES",
]

logger = logging.getLogger(__name__)

CONFIG_FILES = ["config.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
]

_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?"
_HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

# The service (fp8forge serve, fp8forge worker) reads its settings from the environment, while fp8forge analyze
# and convert take flags: a message that tells how to change a source option names both.
_ALLOW_ROOT_HINT = (
    "allow a directory above it (the service: FP8FORGE_ALLOWED_MODEL_ROOTS; fp8forge analyze and convert: "
    "--allow-root DIR, repeatable)"
)
_TRUST_REMOTE_CODE_HINT = (
    "enable remote code (the service: FP8FORGE_TRUST_REMOTE_CODE=1; fp8forge analyze and convert: --trust-remote-code)"
)
_OFFLINE_HINT = (
    "turn offline mode off (the service: FP8FORGE_HF_OFFLINE; fp8forge analyze and convert: drop --offline and "
    "unset FP8FORGE_HF_OFFLINE and HF_HUB_OFFLINE)"
)


@dataclass(frozen=True, kw_only=True)
class ModelSourceOptions:
    """Where models may come from.

    Attributes:
        allowed_roots: local directories below which local model references are accepted.
        cache_dir: the Hugging Face hub cache (``None``: huggingface_hub's default).
        offline: never touch the network; hub references must already be in the cache.
        trust_remote_code: allow architectures whose code ships with the checkpoint (off by default).
        demo_dir: where the built-in demo model is built on first use (``None``: demo disabled).
        reveal_roots: name the allowed roots in errors (the CLI's user chose them; a service's clients must not
            learn its directory layout).
        private_paths: files and directories no model file may resolve into, even below an allowed root (the
            service's data directory and key file); the demo directory is exempt.
        config_limits: what a config.json may declare (``converters.model.config_checks.ConfigLimits``; None: defaults).
        job_directories: directories the job itself wrote a source into (the smoothed copy of ``nvfp4_smoothing``,
            in its staging directory): model files may resolve there, even inside ``private_paths``.
    """

    allowed_roots: tuple[Path, ...] = ()
    cache_dir: Path | None = None
    offline: bool = False
    trust_remote_code: bool = False
    demo_dir: Path | None = None
    reveal_roots: bool = True
    private_paths: tuple[Path, ...] = ()
    config_limits: Any = None
    job_directories: tuple[Path, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ModelReference:
    """A parsed reference. ``kind`` is ``hub``, ``local`` or ``demo``."""

    kind: str
    text: str
    repo_id: str | None = None
    revision: str | None = None
    path: Path | None = None


def parse_model_reference(ref: str, sources: ModelSourceOptions) -> ModelReference:
    """Parse and check a reference without touching the network or reading files.

    Raises:
        ModelReferenceError: URL schemes, ``..`` segments, local paths outside the allowed roots,
            and anything that is neither a hub id nor a local path.
    """
    text = ref.strip() if isinstance(ref, str) else ""
    if not text:
        raise ModelReferenceError("model reference is empty: give 'org/name[@revision]' or a local path")
    if any(ord(char) < 32 or ord(char) == 127 for char in text):
        raise ModelReferenceError("model reference contains a control character (e.g. a NUL byte); give "
                                  "'org/name[@revision]' or a local path in plain characters")
    if _URL_SCHEME.match(text) and not re.match(r"^[A-Za-z]:[\\/]", text):
        raise ModelReferenceError(
            f"model reference {text!r} is a URL; give a hub id 'org/name[@revision]' or a local directory"
        )
    if ".." in re.split(r"[\\/@]", text):
        raise ModelReferenceError(f"model reference {text!r} contains '..'; give a path without parent hops")
    if text == DEMO_MODEL_REF:
        if sources.demo_dir is None:
            raise ModelReferenceError(f"the demo model {DEMO_MODEL_REF!r} is not enabled here")
        return ModelReference(kind="demo", text=text, path=sources.demo_dir)
    if text.startswith(("/", "./", "~")):
        return ModelReference(kind="local", text=text, path=_allowed_local_path(text, sources))
    repo_id, _, revision = text.partition("@")
    if not _HUB_ID.match(repo_id):
        raise ModelReferenceError(
            f"model reference {text!r} is neither a hub id 'org/name[@revision]' nor a local path "
            "(local paths must be absolute or start with './')"
        )
    if "@" in text and not _REVISION.match(revision):
        raise ModelReferenceError(f"revision {revision!r} in {text!r} is not a branch, tag or commit hash")
    return ModelReference(kind="hub", text=text, repo_id=repo_id, revision=revision or None)


def validate_model_reference(ref: str, sources: ModelSourceOptions) -> None:
    """Cheap up-front check of a reference (see :func:`parse_model_reference`); an existing local directory is
    also checked for links out of the allowed places (see :func:`converters.model.files.check_model_directory`),
    so such a job is refused at submission rather than failed by its worker."""
    reference = parse_model_reference(ref, sources)
    if reference.kind == "local" and reference.path is not None and reference.path.is_dir():
        _check_local_directory(reference, sources)


def _allowed_local_path(text: str, sources: ModelSourceOptions) -> Path:
    path = Path(os.path.expanduser(text)).resolve()
    roots = [Path(root).resolve() for root in sources.allowed_roots]
    if not roots:
        raise ModelReferenceError(
            f"local model {text!r} refused: no local model roots are allowed; {_ALLOW_ROOT_HINT}"
        )
    if not any(path == root or root in path.parents for root in roots):
        if not sources.reveal_roots:
            raise ModelReferenceError(
                f"local model {text!r} is not below a directory this server accepts models from; use a path "
                "below one of them (its operator knows which: FP8FORGE_ALLOWED_MODEL_ROOTS), or a hub id"
            )
        allowed = ", ".join(str(root) for root in roots)
        raise ModelReferenceError(
            f"local model {text!r} is outside the allowed roots ({allowed}); move it below one of them, "
            f"or {_ALLOW_ROOT_HINT}"
        )
    return path



def _check_local_directory(reference: ModelReference, sources: ModelSourceOptions) -> None:
    if not confinement_for(sources).allows(reference.path):
        raise ModelReferenceError(f"local model {reference.text!r} is in a directory this server keeps to itself; "
                                  "put models elsewhere below an allowed root", field="model")
    check_model_directory(reference.path, confinement_for(sources), shown=reference.text)


def confinement_for(sources: ModelSourceOptions) -> FileConfinement:
    """Where the files of models from ``sources`` may resolve: the allowed roots, the hub cache and the demo
    directory, less the server's private paths (see :mod:`converters.model.files`)."""
    from huggingface_hub import constants

    roots = [*sources.allowed_roots, sources.cache_dir or Path(constants.HF_HUB_CACHE)]
    exempt = [sources.demo_dir] if sources.demo_dir is not None else []
    exempt += list(sources.job_directories)
    return FileConfinement(
        roots=tuple(_resolved(path) for path in [*roots, *exempt]),
        private=tuple(_resolved(path) for path in sources.private_paths),
        exempt=tuple(_resolved(path) for path in exempt),
    )


def _resolved(path: Path) -> Path:
    return Path(os.path.expanduser(path)).resolve()


def resolve_model_dir(ref: str, sources: ModelSourceOptions, *, with_weights: bool) -> Path:
    """Return a local directory holding the model's config (and weights/tokenizer if asked).

    Hub references download only the files needed: the config for analysis; config, safetensors,
    index and tokenizer files for conversion.

    Raises:
        ModelReferenceError: see :func:`parse_model_reference`; also a file of the directory that resolves
            outside the allowed roots, the hub cache and the demo directory, or into the server's own files.
        ModelNotFoundError: unknown repository or revision, gated repository, offline cache miss,
            missing directory or a directory without ``config.json``.
    """
    reference = parse_model_reference(ref, sources)
    if reference.kind == "demo":
        directory = ensure_demo_model(reference.path)
    elif reference.kind == "local":
        directory = reference.path
        if not directory.is_dir():  # missing or a file: say which, with the nearest model directory beside it
            check_local_model_present(directory, reference.text, confinement_for(sources))
    else:
        directory = _download_hub_model(reference, sources, with_weights=with_weights)
    if reference.kind == "local":
        _check_local_directory(reference, sources)
    else:
        check_model_directory(directory, confinement_for(sources), shown=reference.text)
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(
            f"{reference.text!r} has no config.json; point at a Hugging Face model directory "
            "(one written by save_pretrained)"
        )
    return directory


def _download_hub_model(reference: ModelReference, sources: ModelSourceOptions, *, with_weights: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = list(CONFIG_FILES)
    if with_weights:
        patterns += WEIGHT_FILES + TOKENIZER_FILES
    if sources.trust_remote_code:
        patterns.append("*.py")
    name = reference.text
    try:
        path = snapshot_download(
            reference.repo_id,
            revision=reference.revision,
            cache_dir=sources.cache_dir,
            local_files_only=sources.offline,
            allow_patterns=patterns,
        )
    except GatedRepoError as exc:
        raise ModelNotFoundError(
            f"{name!r} is gated: accept its licence on the hub and set HF_TOKEN, or pre-populate the cache"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(f"revision {reference.revision!r} of {reference.repo_id!r} not found") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"model {name!r} not found on the hub (check the id, or set HF_TOKEN)") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise ModelNotFoundError(_cache_miss_message(reference, sources, exc)) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"could not fetch {name!r} from the hub: {exc}") from exc
    return Path(path)


def _cache_miss_message(reference: ModelReference, sources: ModelSourceOptions, exc: Exception) -> str:
    """Why a hub model was not found, in the one case that happened: fp8forge's offline mode, huggingface_hub's
    own HF_HUB_OFFLINE, or a hub that did not answer."""
    from huggingface_hub import constants

    cache = sources.cache_dir or constants.HF_HUB_CACHE
    download = f"hf download {reference.repo_id}" + (f" --revision {reference.revision}" if reference.revision else "")
    miss = f"{reference.text!r} is not in the HF cache ({cache})"
    fill = f"fill the cache on a connected machine with `{download} --cache-dir {cache}`"
    if sources.offline:
        return f"{miss} and offline mode is on; {fill}, or {_OFFLINE_HINT}"
    if constants.HF_HUB_OFFLINE:
        return (f"{miss} and HF_HUB_OFFLINE is set in the environment, which keeps huggingface_hub offline; {fill}, "
                "or unset HF_HUB_OFFLINE")
    cause = exc.__cause__ or exc
    return (f"{miss} and the hub could not be reached ({type(cause).__name__}: {cause}); check the network, "
            f"proxy and HF_ENDPOINT, or {fill}")


def load_config(directory: Path, sources: ModelSourceOptions) -> Any:
    """Read ``config.json`` with transformers' ``AutoConfig``, from a private copy made without following a link
    out of the places models come from (:func:`_staged`): the bytes checked are the bytes transformers reads.

    Raises:
        ModelNotFoundError: the config names an unknown architecture, or needs remote code while
            ``trust_remote_code`` is off.
        ModelConfigError: the config is out of ``sources.config_limits`` or malformed (``converters.model.limits``).
    """
    try:
        with _staged(directory, sources, ["config.json"]) as staged:
            config = load_checked_config(staged, sources)
    except (ValueError, OSError) as exc:
        hint = "" if sources.trust_remote_code else f"; if the model ships its own code, {_TRUST_REMOTE_CODE_HINT}"
        raise ModelNotFoundError(f"cannot read config.json in {directory}: {exc}{hint}") from exc
    config._name_or_path = str(directory)  # where the model is, not the staging directory it was read from
    return config


def _staged(directory: Path, sources: ModelSourceOptions, names: list[str], links: Iterable[str] = ()
            ) -> AbstractContextManager[Path]:
    """:func:`~converters.model.files.staged_model_directory` of ``directory`` with ``names`` copied (and the
    model's own code, when remote code is allowed) and ``links`` pinned, confined to ``confinement_for(sources)``;
    a directory outside it (one a caller built, not reached through ``sources``: a test's, an artifact) is
    confined as ``converters.model.files.open_model_file`` confines a file it is given no confinement for."""
    code = sorted(path.name for path in Path(directory).glob("*.py")) if sources.trust_remote_code else []
    confinement = confinement_for(sources)
    if not confinement.allows(Path(os.path.realpath(directory))):
        confinement = None
    return staged_model_directory(directory, confinement, copies=[*names, *code], links=links)


def model_class(config: Any, sources: ModelSourceOptions) -> Any:
    """The class that loads this checkpoint: its declared architecture, else the fitting Auto class.

    Remote-code models (``auto_map`` in the config) get ``AutoModelForCausalLM`` when they map it, so
    the LM head and its key names are kept.
    """
    import transformers

    for architecture in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, architecture, None)
        if cls is not None:
            return cls
    auto_map = getattr(config, "auto_map", None) or {}
    if auto_map and not sources.trust_remote_code:
        raise ModelNotFoundError(
            f"this model's architecture ships as remote code; to load it, {_TRUST_REMOTE_CODE_HINT}"
        )
    from transformers import AutoModel, AutoModelForCausalLM

    if "AutoModelForCausalLM" in auto_map:
        return AutoModelForCausalLM
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    return AutoModel


def model_dtype(config: Any) -> torch.dtype:
    """The dtype the checkpoint declares (float32 when it declares none)."""
    import torch

    # transformers 5 reads a config.json's "torch_dtype" into ``dtype``; its ``torch_dtype`` property only
    # logs a deprecation warning.
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def build_meta_model(config: Any, sources: ModelSourceOptions) -> torch.nn.Module:
    """Instantiate the architecture from its config on the ``meta`` device: shapes only, no memory."""
    import torch

    cls = model_class(config, sources)
    kwargs = {"trust_remote_code": True} if sources.trust_remote_code and hasattr(cls, "from_config") else {}
    with torch.device("meta"):
        if hasattr(cls, "_from_config"):
            return cls._from_config(config, dtype=model_dtype(config))
        return cls.from_config(config, dtype=model_dtype(config), **kwargs)


def load_model(directory: Path, sources: ModelSourceOptions, *, dtype: torch.dtype | None = None) -> Any:
    """Load the model with its weights on the CPU, in the checkpoint's dtype unless ``dtype`` is given."""
    config = load_config(directory, sources)
    if not any(directory.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{directory} has no *.safetensors weights; fp8forge reads only safetensors checkpoints "
            "(convert .bin weights with transformers' save_pretrained first)"
        )
    cls = model_class(config, sources)
    # from_pretrained reads a private directory: small files copied, weights pinned as /proc/self/fd links
    weights = sorted(path.name for path in directory.glob("*.safetensors"))
    try:
        with transformers_progress_off(), _staged(directory, sources, ["config.json", "generation_config.json",
                                                                        INDEX_NAME], weights) as staged:
            model, info = cls.from_pretrained(
                staged,
                dtype=dtype or model_dtype(config),
                trust_remote_code=sources.trust_remote_code,
                output_loading_info=True,
            )
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load the weights in {directory}: {exc}") from exc
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ModelNotFoundError(
            f"{directory}: the checkpoint lacks {len(missing)} weight(s) the architecture needs, e.g. {missing[:3]}"
        )
    model.config._name_or_path = str(directory)  # not the staging directory it was read from
    model.eval()
    return model


def load_tokenizer(directory: Path, sources: ModelSourceOptions) -> Any | None:
    """The model's own tokenizer, or ``None`` when the directory ships none (or one transformers cannot load).

    It is read from private copies of its files made without following a link out of
    the places models come from (:func:`_staged`).

    Raises:
        ModelReferenceError: a tokenizer file links out of the confinement or changed while it was copied.
    """
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        with _staged(directory, sources, [*TOKENIZER_FILES, "config.json"]) as staged:
            return AutoTokenizer.from_pretrained(staged, trust_remote_code=sources.trust_remote_code)
    except (OSError, ValueError) as exc:
        logger.warning("tokenizer in %s could not be loaded (%s); calibration will sample token ids", directory, exc)
        return None
