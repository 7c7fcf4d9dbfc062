"""Domain errors of the conversion library.

Each error carries a stable ``code`` (used by the CLI and mapped to HTTP by the service) and, where a
single input field is at fault, the ``field`` that names it. Messages say what was wrong and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "Fp8ForgeError",
    "ModelReferenceError",
    "ModelNotFoundError",
    "ModelConfigError",
    "ArtifactError",
    "RecipeError",
    "CalibrationDataError",
    "BackendUnavailableError",
    "ConversionError",
    "ConversionCancelled",
    "RequestError",
]


class Fp8ForgeError(Exception):
    """Base class: a problem the user can act on. ``code`` is stable; ``field`` names the input at fault."""

    code = "fp8forge_error"
    #: True when the input was wrong (CLI exit 2, HTTP 422); False when the run itself failed.
    is_bad_input = True

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class ModelReferenceError(Fp8ForgeError):
    """The model reference is malformed or points outside the allowed local roots."""

    code = "invalid_model_reference"


class ModelNotFoundError(Fp8ForgeError):
    """The reference is well formed but no model (or no config.json) could be found for it."""

    code = "model_not_found"


class ModelConfigError(Fp8ForgeError):
    """The model's config.json declares more than the configured bounds allow, or something transformers cannot
    build a model from (a count of the wrong type, a class that is not a model)."""

    code = "invalid_model_config"


class ArtifactError(ModelNotFoundError):
    """The directory is not a complete, unaltered fp8forge artifact of the expected backend."""

    code = "invalid_artifact"


class RecipeError(Fp8ForgeError):
    """A recipe field has an unknown name or a value outside its allowed range."""

    code = "invalid_recipe"


class CalibrationDataError(Fp8ForgeError):
    """Calibration settings or user-supplied calibration texts are unusable."""

    code = "invalid_calibration"


class BackendUnavailableError(Fp8ForgeError):
    """The requested backend needs a library or device this machine lacks."""

    code = "backend_unavailable"
    is_bad_input = False


class ConversionError(Fp8ForgeError):
    """The conversion ran but produced an inconsistent result (e.g. converted count != eligible count)."""

    code = "conversion_failed"
    is_bad_input = False


class ConversionCancelled(Fp8ForgeError):
    """The caller asked the run to stop; nothing was written."""

    code = "cancelled"
    is_bad_input = False


class RequestError(Fp8ForgeError):
    """A field of a conversion or analysis request is missing, unknown, of the wrong type or out of range."""

    code = "invalid_request"
