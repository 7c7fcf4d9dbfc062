"""The TransformerEngine backend: ``backend`` (the adapter), ``runtime`` (TE import, version and GPU checks),
``swap``, ``state``, ``layout`` (the state key scheme), ``layer_check``, ``check_step``, ``grouped``, ``loader``.
See README.md beside this file."""

__all__ = ["TE"]

from converters.backends.te.backend import TE
