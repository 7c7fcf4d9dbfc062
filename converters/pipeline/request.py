"""A conversion request: what the CLI and the service hand to the pipeline, validated up front.

Everything that can be checked without loading the model is checked here, so a bad job is refused
before it is queued; each error names the field as a dotted path (``recipe.margin``, ``calibration.steps``,
``include[2]``). Every number has an upper bound that keeps one job within a worker's memory; the service
states the same bounds in its OpenAPI schema, read from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from converters.analysis.patterns import check_patterns
from converters.errors import CalibrationDataError, RecipeError, RequestError
from converters.plan.settings import PlanSettings
from converters.recipes import Recipe, recipe_from_dict
from converters.recipes.presets import MAX_COMPARE_RECIPES, parse_compare_recipe
from converters.serving_names import KV_CACHE_FORMAT_NAMES, SERVING_FORMAT_NAMES, UNCALIBRATED_FORMAT_NAMES, format_spec

__all__ = [
    "SYNC_LIMITS",
    "SYNC_DEFAULTS",
    "SYNC_MAX_TEXTS_CHARS",
    "SYNC_MAX_PARAMETERS",
    "check_sync_calibration",
    "CalibrationSettings",
    "ConversionRequest",
    "LIMITS",
    "MAX_TOKENS_PER_STEP",
    "MAX_CALIBRATION_TOKENS",
    "MAX_TEXT_CHARS",
    "MAX_TEXTS_CHARS",
    "SERVING_FORMAT_NAMES",
    "KV_CACHE_DTYPES",
    "KV_CACHE_FORMAT_NAMES",
    "NOT_BLANK",
    "MIN_SQNR_DB_RANGE",
    "REMOVED_FIELDS",
    "REQUANTIZE_TARGETS",
    "check_requantize",
]

#: Inclusive ranges of the calibration numbers. Layer-sequential calibration caches every step's hidden
#: states, so besides each number the tokens of one step and of the whole run are bounded (below).
LIMITS = {"steps": (1, 1024), "batch_size": (1, 256), "seq_len": (1, 8192), "texts": (1, 10_000)}
#: batch_size x seq_len. A step's logits are tokens x vocabulary x 4 bytes: 4 GiB at Llama-3's 128k vocabulary.
MAX_TOKENS_PER_STEP = 8192
#: steps x batch_size x seq_len. The cached hidden states of a run are tokens x hidden x 2 bytes: 4 GiB for an
#: 8B model (hidden 4096), twice for 70B. The default run is 4096 tokens.
MAX_CALIBRATION_TOKENS = 2**19
#: One calibration text, and all of them together (about 1M tokens: twice what the largest run reads).
MAX_TEXT_CHARS = 1_000_000
MAX_TEXTS_CHARS = 4_000_000
#: ``kv_cache`` values: the KV-cache dtype whose scales a serving export carries (converters.serving.kv_scales).
KV_CACHE_DTYPES = ("fp8",)
#: A calibration text must contain a character this regex finds: anything but what ``str.isspace`` calls
#: whitespace (so "\u00a0\u3000" is blank too). Written with escapes only, which Python, pydantic's Rust regex and
#: the OpenAPI schema's ECMAScript readers all read alike.
NOT_BLANK = r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
_NOT_BLANK = re.compile(NOT_BLANK)
#: ``min_sqnr_db`` range (dB): 300 is what an exact cast reports (converters.casts.emulation.SQNR_CAP_DB).
MIN_SQNR_DB_RANGE = (0.0, 300.0)

_REQUEST_KEYS = (
    "model", "recipe", "calibration", "include", "exclude", "skip_first_last", "convert_router_gates",
    "te_extra_state", "serving_formats", "min_sqnr_db", "compare_recipes",
    "kv_cache", "measure", "requantize", "plan", "quality_texts",
)
#: Fields a request no longer takes -> why, and what to do instead: an old client that sends one is told, never
#: silently converted differently than it asked.
REMOVED_FIELDS = {
    "max_shard_bytes": "max_shard_bytes was removed: it never had an effect (an artifact keeps the source's weight "
                       "files as they are, shards included); drop it from the request",
}
#: ``requantize.to`` values: the targets of model-free conversion (converters.modelfree.targets; tests keep the
#: two equal), the formats that need no calibration, and bf16.
REQUANTIZE_TARGETS = (*UNCALIBRATED_FORMAT_NAMES, "bf16")
#: The fields a requantize job reads besides ``requantize`` itself; every other one belongs to a calibrated job.
_REQUANTIZE_KEYS = ("model", "requantize", "include", "exclude", "skip_first_last")
_CALIBRATION_KEYS = ("steps", "batch_size", "seq_len", "texts", "backward")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # `true` is a mistake, not 1


@dataclass(frozen=True, kw_only=True)
class CalibrationSettings:
    """Calibration: ``steps`` batches of ``batch_size`` x ``seq_len`` tokens; ``texts`` replaces the corpus."""

    steps: int = 16
    batch_size: int = 2
    seq_len: int = 128
    texts: tuple[str, ...] | None = None
    backward: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, name)
            low, high = LIMITS[name]
            if not _is_int(value) or not low <= value <= high:
                raise CalibrationDataError(
                    f"calibration.{name} must be an integer from {low} to {high}, got {value!r}",
                    field=f"calibration.{name}",
                )
        self._check_tokens()
        if not isinstance(self.backward, bool):
            raise CalibrationDataError("calibration.backward must be true or false", field="calibration.backward")
        if self.texts is not None:
            object.__setattr__(self, "texts", _checked_texts(self.texts))

    def _check_tokens(self) -> None:
        per_step = self.batch_size * self.seq_len
        if per_step > MAX_TOKENS_PER_STEP:
            raise CalibrationDataError(
                f"calibration.batch_size x calibration.seq_len is {per_step} tokens per step; at most "
                f"{MAX_TOKENS_PER_STEP} fit a worker (e.g. 4 x 2048): lower one of them",
                field="calibration",
            )
        if self.steps * per_step > MAX_CALIBRATION_TOKENS:
            raise CalibrationDataError(
                f"calibration.steps x batch_size x seq_len is {self.steps * per_step} tokens; at most "
                f"{MAX_CALIBRATION_TOKENS} fit a worker: lower steps, batch_size or seq_len",
                field="calibration",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CalibrationSettings:
        data = dict(data or {})
        unknown = sorted(set(data) - set(_CALIBRATION_KEYS), key=str)
        if unknown:
            raise CalibrationDataError(
                f"unknown calibration field {unknown[0]!r}; allowed: {', '.join(_CALIBRATION_KEYS)}",
                field=f"calibration.{unknown[0]}",
            )
        if data.get("texts") is None:
            data.pop("texts", None)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "texts": None if self.texts is None else f"{len(self.texts)} user text(s)",
            "backward": self.backward,
        }


def _checked_texts(texts: Any) -> tuple[str, ...]:
    low, high = LIMITS["texts"]
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise CalibrationDataError("calibration.texts must be a list of strings", field="calibration.texts")
    if not low <= len(texts) <= high:
        raise CalibrationDataError(
            f"calibration.texts must hold {low} to {high} texts, got {len(texts)}; omit it to use the built-in corpus",
            field="calibration.texts",
        )
    for index, text in enumerate(texts):
        where = f"calibration.texts[{index}]"
        if not isinstance(text, str):
            raise CalibrationDataError(f"{where} must be a string, got {type(text).__name__}", field=where)
        if len(text) > MAX_TEXT_CHARS:
            raise CalibrationDataError(f"{where} has {len(text)} characters; at most {MAX_TEXT_CHARS}", field=where)
        if not _NOT_BLANK.search(text):
            raise CalibrationDataError(f"{where} is empty or blank; remove it", field=where)
    total = sum(len(text) for text in texts)
    if total > MAX_TEXTS_CHARS:
        raise CalibrationDataError(
            f"calibration.texts hold {total} characters together; at most {MAX_TEXTS_CHARS}",
            field="calibration.texts",
        )
    return tuple(texts)


@dataclass(frozen=True, kw_only=True)
class ConversionRequest:
    """One conversion: model reference, recipe JSON, calibration and layer selection."""

    model: str
    recipe: Mapping[str, Any] = field(default_factory=lambda: {"backend": "te"})
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    convert_router_gates: bool = False
    te_extra_state: bool = False
    serving_formats: tuple[str, ...] = ()  #: names in converters.serving.SERVING_FORMATS, each its own subdirectory
    #: keep layers whose output SQNR under the recipe is below this many dB in high precision
    #: (converters.calibration.sensitivity)
    min_sqnr_db: float | None = None
    #: more recipes to measure the SQNR of, side by side (names of sensitivity.RECIPE_NAMES or recipe objects)
    compare_recipes: tuple[Any, ...] = ()
    #: "fp8": the serving exports carry FP8 KV-cache scales from this job's calibration; None: they carry none
    kv_cache: str | None = None
    #: measure each layer's SQNR during calibration (converters.calibration.sensitivity); False: the report says
    #: it was off, and nothing that needs it (min_sqnr_db, compare_recipes) may be asked for
    measure: bool = True
    #: a per-layer precision plan to make beside the artifact (converters.plan.settings.PlanSettings as data)
    plan: Mapping[str, Any] | None = None
    #: held-out texts the end-to-end quality is measured on (converters.quality; the same limits as
    #: calibration.texts); None: the built-in corpus' held-out part. ``measure: false`` turns quality off too.
    quality_texts: tuple[str, ...] | None = None
    _recipe: Recipe = field(init=False, repr=False, compare=False)  #: ``recipe`` parsed, by __post_init__

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise RequestError("model must be a non-empty string like 'org/name[@revision]'", field="model")
        for name in ("include", "exclude"):
            object.__setattr__(self, name, check_patterns(getattr(self, name), name))
        for name in ("skip_first_last", "convert_router_gates", "te_extra_state", "measure"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false", field=name)
        self._check_serving_formats()
        self._check_sensitivity()
        self._check_kv_cache()
        if not self.measure and (self.min_sqnr_db is not None or self.compare_recipes):
            raise RequestError("measure false turns the SQNR measurement off, and min_sqnr_db and compare_recipes "
                               "need it: drop them or leave measure on", field="measure")
        if self.plan is not None:
            object.__setattr__(self, "plan", PlanSettings.from_dict(self.plan).to_dict())
            if not self.measure:
                raise RequestError("a plan reads each layer's SQNR under its candidates, which measure false turns "
                                   "off: drop plan or leave measure on", field="measure")
        if self.quality_texts is not None:
            if not self.measure:
                raise RequestError("measure false turns the quality measurement off, and quality_texts are its "
                                   "texts: drop quality_texts or leave measure on", field="quality_texts")
            try:
                object.__setattr__(self, "quality_texts", _checked_texts(self.quality_texts))
            except CalibrationDataError as exc:
                raise RequestError(exc.message.replace("calibration.texts", "quality_texts"),
                                   field=(exc.field or "").replace("calibration.texts", "quality_texts")) from exc
        # parsed once, here: every stage, the CLI and the synchronous analysis read this object
        object.__setattr__(self, "_recipe", self._parse_recipe())

    def _check_serving_formats(self) -> None:
        names = self.serving_formats
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise RequestError("serving_formats must be a list of format names", field="serving_formats")
        for index, name in enumerate(names):
            if name not in SERVING_FORMAT_NAMES:
                raise RequestError(f"unknown serving format {name!r}; known: {', '.join(SERVING_FORMAT_NAMES)}",
                                   field=f"serving_formats[{index}]")
        if len(set(names)) != len(names):
            raise RequestError("serving_formats lists a format twice", field="serving_formats")
        object.__setattr__(self, "serving_formats", tuple(names))

    def _check_kv_cache(self) -> None:
        if self.kv_cache is None:
            return
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise RequestError(f"kv_cache must be one of {', '.join(KV_CACHE_DTYPES)} or null, got {self.kv_cache!r}",
                               field="kv_cache")
        if not any(name in KV_CACHE_FORMAT_NAMES for name in self.serving_formats):
            raise RequestError(
                "kv_cache writes its scales into a serving export: add one of "
                f"{', '.join(KV_CACHE_FORMAT_NAMES)} to serving_formats, or omit kv_cache", field="kv_cache")

    def _check_sensitivity(self) -> None:
        low, high = MIN_SQNR_DB_RANGE
        value = self.min_sqnr_db
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not low <= value <= high):  # NaN fails the range too
            raise RequestError(f"min_sqnr_db must be a number of dB from {low:g} to {high:g}, or null",
                               field="min_sqnr_db")
        entries = self.compare_recipes
        if isinstance(entries, (str, Mapping)) or not isinstance(entries, (list, tuple)):
            raise RequestError("compare_recipes must be a list of recipe names or recipe objects",
                               field="compare_recipes")
        if len(entries) > MAX_COMPARE_RECIPES:
            raise RequestError(f"compare_recipes may hold at most {MAX_COMPARE_RECIPES} recipes, got {len(entries)}",
                               field="compare_recipes")
        parsed = [parse_compare_recipe(entry, f"compare_recipes[{index}]").to_dict()
                  for index, entry in enumerate(entries)]
        for index, data in enumerate(parsed):
            if data in parsed[:index]:
                raise RequestError(f"compare_recipes[{index}] repeats an earlier recipe; list each once",
                                   field=f"compare_recipes[{index}]")
        object.__setattr__(self, "compare_recipes", tuple(entries))

    def parsed_recipe(self) -> Recipe:
        """The recipe object (one of the registered recipe classes), parsed when the request was built."""
        return self._recipe

    def _parse_recipe(self) -> Recipe:
        """Raises RecipeError naming ``recipe.<field>``."""
        if not isinstance(self.recipe, Mapping):
            raise RecipeError('recipe must be a JSON object like {"backend": "te"}', field="recipe")
        try:
            return recipe_from_dict(self.recipe)
        except RecipeError as exc:
            # recipe_from_dict names fields inside the recipe; the request names them from its root
            dotted = "recipe" if exc.field in (None, "recipe") else f"recipe.{exc.field}"
            raise RecipeError(exc.message, field=dotted) from exc

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ConversionRequest:
        """Build from a JSON body; raises Fp8ForgeError subclasses with ``field`` set to a dotted path."""
        if not isinstance(body, Mapping):
            raise RequestError("the request body must be a JSON object", field="body")
        removed = sorted(set(body) & set(REMOVED_FIELDS), key=str)
        if removed:
            raise RequestError(REMOVED_FIELDS[removed[0]], field=removed[0])
        unknown = sorted(set(body) - set(_REQUEST_KEYS), key=str)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}; allowed: {', '.join(_REQUEST_KEYS)}", field=unknown[0])
        data = dict(body)
        if data.get("requantize") is not None:
            check_requantize(data)
        data.pop("requantize", None)
        if "model" not in data:
            raise RequestError("model is required, e.g. 'org/name[@revision]'", field="model")
        calibration = data.get("calibration")
        if calibration is not None and not isinstance(calibration, Mapping):
            raise CalibrationDataError("calibration must be a JSON object", field="calibration")
        data["calibration"] = CalibrationSettings.from_dict(calibration)
        for name in ("include", "exclude", "serving_formats", "compare_recipes"):
            if data.get(name) is None:
                data.pop(name, None)
        if data.get("recipe") is None:
            data.pop("recipe", None)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "recipe": dict(self.recipe),
            "calibration": self.calibration.to_dict(),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "skip_first_last": self.skip_first_last,
            "convert_router_gates": self.convert_router_gates,
            "te_extra_state": self.te_extra_state,
            "serving_formats": list(self.serving_formats),
            "min_sqnr_db": self.min_sqnr_db,
            "compare_recipes": [entry if isinstance(entry, str) else dict(entry) for entry in self.compare_recipes],
            "kv_cache": self.kv_cache,
            "measure": self.measure,
            "plan": dict(self.plan) if self.plan is not None else None,
            "quality_texts": None if self.quality_texts is None else f"{len(self.quality_texts)} user text(s)",
        }


#: Bounds of the calibration /v1/analyze runs synchronously, inside the request (inclusive ranges), and its
#: defaults: at most 4096 tokens, so that the answer comes in seconds for a small model.
SYNC_LIMITS = {"steps": (1, 8), "batch_size": (1, 4), "seq_len": (1, 128), "texts": (1, 64)}
SYNC_DEFAULTS = {"steps": 2, "batch_size": 2, "seq_len": 64}
SYNC_MAX_TEXTS_CHARS = 65_536
#: Largest model /v1/analyze calibrates synchronously; larger ones: ``fp8forge compare`` or a conversion job.
SYNC_MAX_PARAMETERS = 1_000_000_000


def check_sync_calibration(settings: Any) -> None:
    """Refuse calibration settings beyond :data:`SYNC_LIMITS` (the synchronous /v1/analyze path).

    Raises CalibrationDataError naming ``calibration.<field>``.
    """
    for name in ("steps", "batch_size", "seq_len"):
        low, high = SYNC_LIMITS[name]
        if not low <= getattr(settings, name) <= high:
            raise CalibrationDataError(
                f"calibration.{name} must be from {low} to {high} for a synchronous analysis; run `fp8forge compare` "
                "or a conversion job for more", field=f"calibration.{name}")
    if settings.backward:
        raise CalibrationDataError("a synchronous analysis runs no backward pass", field="calibration.backward")
    texts = settings.texts or ()
    if len(texts) > SYNC_LIMITS["texts"][1] or sum(len(text) for text in texts) > SYNC_MAX_TEXTS_CHARS:
        raise CalibrationDataError(f"a synchronous analysis takes at most {SYNC_LIMITS['texts'][1]} texts of "
                                   f"{SYNC_MAX_TEXTS_CHARS} characters in all", field="calibration.texts")


def check_requantize(body: Mapping[str, Any]) -> str:
    """Check a model-free job (``"requantize": {"to": FORMAT, "measure": BOOL}``) and return its target format.

    Such a job converts from the files alone, so it takes only ``model``, ``include``, ``exclude`` and
    ``skip_first_last``; a field of a calibrated job (recipe, calibration, serving_formats, ...) makes no sense
    next to it.

    Raises:
        RequestError: naming ``requantize.to`` (unknown or calibrated format) or the field that does not belong.
    """
    spec = body.get("requantize")
    if not isinstance(spec, Mapping) or "to" not in spec or not set(spec) <= {"to", "measure"}:
        raise RequestError('requantize must be an object like {"to": "fp8-block"} (and optionally "measure": false)',
                           field="requantize")
    if spec.get("measure") not in (None, True, False):
        raise RequestError(f"requantize.measure must be true or false, got {spec['measure']!r}",
                           field="requantize.measure")
    target = spec["to"]
    if target in SERVING_FORMAT_NAMES and format_spec(target).calibrated:
        raise RequestError(f"{target} needs static input scales from a calibration, which a requantize job does not "
                           f"run: submit a conversion job with serving_formats [{target!r}] instead, or pick one of "
                           f"{', '.join(REQUANTIZE_TARGETS)}", field="requantize.to")
    if target not in REQUANTIZE_TARGETS:
        raise RequestError(f"unknown requantize target {target!r}; known: {', '.join(REQUANTIZE_TARGETS)}",
                           field="requantize.to")
    for name, value in body.items():
        if name not in _REQUANTIZE_KEYS and value not in (None, {}, []):
            raise RequestError(f"{name} belongs to a calibrated conversion; a requantize job converts from the files "
                               f"alone and takes only {', '.join(_REQUANTIZE_KEYS)}: drop {name}", field=name)
    return target
