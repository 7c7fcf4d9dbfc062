"""Imports held out of the cyclic garbage collector's way, for the processes that import torch and transformers:
a worker's fork servers (``service.workers.task_server_preload``), the CLI's model-loading commands and a
data-parallel rank (``python -m converters.distributed``: both through :func:`import_model_stack`), and ``fp8forge
analyze`` (transformers' model code for its meta model, without torchao or the pipeline)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["import_model_stack", "imports_frozen"]


@contextlib.contextmanager
def imports_frozen() -> Iterator[None]:
    """Import inside it with the cyclic garbage collector held off; at its end, one collection (what the imports
    left unreachable), then everything alive put out of the collector's reach (``gc.freeze``), and collections on.

    A process that imports torch and transformers holds hundreds of thousands of objects that live as long as it
    does: while they import, each full collection walks all imported so far (seven of them for a fork server's
    preload), and every full collection after them walks them all again. Frozen, they are skipped, and a fork's
    collections leave the pages holding them shared with its parent (docs/service.md has what it saves). Nested uses
    act once, at the outermost's end.
    """
    if not gc.isenabled():  # inside another use (or a process that manages collections itself): leave it be
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def import_model_stack() -> None:
    """Import torch, transformers' model code and the conversion pipeline inside :func:`imports_frozen`: what a
    process that loads a model (a CLI command once its flags are checked, a data-parallel rank) imports first, so
    that its own full collections skip them instead of walking them each time."""
    with imports_frozen():
        import transformers.modeling_utils  # noqa: F401 - what every model class imports

        import converters.pipeline.driver  # noqa: F401 - torch, torchao and the pipeline
