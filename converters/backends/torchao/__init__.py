"""The torchao backend: ``backend`` (the adapter), ``config`` (recipe -> torchao config, and JSON), ``swap``,
``experts`` (MoE grouped GEMMs)."""

__all__ = ["TORCHAO"]

from converters.backends.torchao.backend import TORCHAO
