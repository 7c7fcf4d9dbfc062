"""Read the next decoder layer's tensors from disk while the current one runs its calibration forward.

One background thread and one layer ahead at most (:meth:`Checkpoint.read_ahead`): a plain source's bytes
are handed to the kernel's readahead, so that the layer's load finds them in the page cache without this thread
copying them on the cores the forward uses; a quantized source's weights are read with ``pread`` and dequantized
here (the memory held grows by one layer's weights), then placed into the model on the calling thread by
``Checkpoint.load(tensors=...)``, so the model is never touched from the background thread. An error in the
read is raised by :meth:`take`, in the calling thread, as the job's error.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from converters.model.checkpoint import Checkpoint

__all__ = ["LayerPrefetcher"]


class LayerPrefetcher:
    """``start(index, keys)`` reads a layer in the background; ``take(index)`` waits for and returns it."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8forge-prefetch")
        self._pending: dict[int, Future[dict[str, torch.Tensor] | None]] = {}

    def start(self, index: int, keys: set[str]) -> None:
        """Begin reading layer ``index``'s tensors (in-memory names ``keys``)."""
        self._pending[index] = self._pool.submit(self._checkpoint.read_ahead, keys)

    def take(self, index: int) -> dict[str, torch.Tensor] | None:
        """Layer ``index``'s tensors, waiting for the read; None when it was never started or the load reads
        them itself (a plain source, from the page cache). Re-raises its error."""
        future = self._pending.pop(index, None)
        return None if future is None else future.result()

    def close(self) -> None:
        """Drop any read not taken; waits for at most the one read in flight (one layer)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
