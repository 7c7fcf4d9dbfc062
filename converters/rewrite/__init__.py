"""The checkpoint-rewrite engine: one shard rewritten tensor by tensor (:mod:`converters.rewrite.shard`) and one
ending for a rewritten checkpoint (:mod:`converters.rewrite.finish`); a weight cast in strips of rows that stay in cache
(:mod:`converters.rewrite.strips`)."""

from converters.rewrite.finish import REMOVE, finish_checkpoint
from converters.rewrite.shard import Compute, Copy, ShardWritten, planned_bytes, write_shard
from converters.rewrite.strips import cast_in_strips, strip_rows

__all__ = ["REMOVE", "Compute", "Copy", "ShardWritten", "cast_in_strips", "finish_checkpoint", "planned_bytes",
           "strip_rows", "write_shard"]
