"""torch's intra-op threads set to one for a block of work, restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_intra_op_thread"]


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread inside the block. Used where several processes already share the cores (a requantize
    task, docs/benchmarks/requantize-2026-12-03b.md) and for loops of many small operations (GPTQ's column loop,
    docs/benchmarks/nvfp4-gptq-2026-12-04.md), where threads cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
