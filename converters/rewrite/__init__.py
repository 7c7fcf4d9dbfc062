"""The checkpoint-rewrite engine: one shard rewritten tensor by tensor (:mod:`converters.rewrite.shard`) and one
ending for a rewritten checkpoint (:mod:`converters.rewrite.finish`)."""

from converters.rewrite.finish import REMOVE, finish_checkpoint
from converters.rewrite.shard import Compute, Copy, ShardWritten, planned_bytes, write_shard

__all__ = ["REMOVE", "Compute", "Copy", "ShardWritten", "finish_checkpoint", "planned_bytes", "write_shard"]
