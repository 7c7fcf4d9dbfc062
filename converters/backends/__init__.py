"""Backends: the library a recipe runs on (TransformerEngine in ``te/``, torchao in ``torchao/``), each behind the
:class:`~converters.backends.base.Backend` protocol, chosen by the recipe once per job (:func:`backend_for`).

Public surface: ``Backend``, ``BACKENDS``, ``backend_for``, ``backend_named``, ``load_te``, ``load_torchao``.
A new backend is one folder implementing ``base.Backend`` plus one line in ``BACKENDS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters.backends.base import Backend
from converters.backends.te.backend import TE
from converters.backends.torchao.backend import TORCHAO

if TYPE_CHECKING:
    from converters.recipes import Recipe

__all__ = ["BACKENDS", "Backend", "backend_for", "backend_named"]

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (TE, TORCHAO)}


def backend_named(name: str) -> Backend:
    """The backend of recipe backend ``name`` (``te`` or ``ao``; recipes are validated, so it exists)."""
    return BACKENDS[name]


def backend_for(recipe: Recipe) -> Backend:
    """The backend that runs ``recipe``, chosen by the recipe's type."""
    for backend in BACKENDS.values():
        if isinstance(recipe, backend.recipe_types):
            return backend
    raise TypeError(f"no backend takes {type(recipe).__name__}")
