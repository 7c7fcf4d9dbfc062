"""A rank of ``python -m converters.distributed`` that kills itself with SIGKILL (kill -9) right after it has
finished layer ``KILL_AFTER_LAYER`` (its outputs saved, the barrier passed, the layer recorded), as a lost host would:
nothing of the process runs after it, no handler, no clean-up. Every other rank runs unchanged."""

from __future__ import annotations

import os
import signal
import sys

from converters.distributed.__main__ import main
from converters.distributed.layer_walk import RankedLayerWalk

KILL_AFTER_LAYER = int(os.environ["KILL_AFTER_LAYER"])
_layer_finished = RankedLayerWalk.layer_finished


def _layer_finished_then_die(self, index):
    _layer_finished(self, index)
    if index == KILL_AFTER_LAYER and self.store is not None:  # a recorded layer (not a smoothing search's walk)
        os.kill(os.getpid(), signal.SIGKILL)


RankedLayerWalk.layer_finished = _layer_finished_then_die

if __name__ == "__main__":
    sys.exit(main())
