"""``imports_frozen``: what is imported inside it is frozen out of the collector's reach at its end, with the
garbage of those imports collected first and collections enabled again; a use nested in another acts only at the
outermost's end. The model stack (``import_model_stack``) the CLI imports and a data-parallel rank's imports
(``python -m converters.distributed``) are imported that way, each in a process of its own, and so is what
``fp8forge analyze`` imports."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from converters.frozen_imports import imports_frozen

ROOT = Path(__file__).resolve().parents[2]


class _Node:
    next: _Node | None = None


def test_the_outermost_use_collects_the_garbage_freezes_the_rest_and_enables_collections() -> None:
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with imports_frozen():
            assert not gc.isenabled()
            kept = [[] for _ in range(1000)]  # alive at the end: frozen
            cycle = _Node()
            cycle.next = cycle
            gone = weakref.ref(cycle)
            del cycle  # unreachable at the end, but only a collection frees a cycle
            assert gone() is not None
            with imports_frozen():  # nested: nothing happens at its end
                assert not gc.isenabled()
            assert not gc.isenabled() and gc.get_freeze_count() == before
        assert gc.isenabled()
        assert gc.get_freeze_count() - before >= len(kept)
        assert gone() is None  # collected before the freeze, not kept by it
    finally:
        gc.unfreeze()  # this test process's objects back in the collector's reach


@pytest.mark.parametrize("importing", ["from converters.frozen_imports import import_model_stack; import_model_stack()",
                                       "import converters.distributed.__main__"], ids=["cli", "rank"])
def test_the_clis_and_a_ranks_model_stack_is_imported_frozen(importing: str) -> None:
    script = (f"import gc, json, sys\n{importing}\n"
              "print(json.dumps([gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()),"
              " 'transformers.modeling_utils' in sys.modules, 'converters.pipeline.driver' in sys.modules]))")
    collecting, frozen, tracked, model_code, pipeline = _last_json_line(script)
    assert collecting and model_code and pipeline
    assert frozen > 10 * tracked, (frozen, tracked)  # the command's collections walk a tenth of what it imported


def test_analyze_imports_the_model_code_frozen_and_never_torchao(tmp_path: Path) -> None:
    """``fp8forge analyze`` (no calibration) builds a meta model: transformers' model code, imported frozen once its
    flags are checked, with torchao hidden from transformers as before (analysis never needs it)."""
    script = ("import contextlib, gc, io, json, sys\n"
              "from service.cli.main import main\n"
              "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "    code = main(['analyze', 'demo/tiny-llama'])\n"
              "print(json.dumps([code, 'q_proj' in out.getvalue(), gc.isenabled(), gc.get_freeze_count(),"
              " len(gc.get_objects()), 'transformers.modeling_utils' in sys.modules,"
              " sorted(name for name, module in sys.modules.items() if name.split('.')[0] == 'torchao' and module)]))")
    code, analysed, collecting, frozen, tracked, model_code, torchao = _last_json_line(
        script, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert code == 0 and analysed and collecting and model_code
    assert torchao == []
    assert frozen > 10 * tracked, (frozen, tracked)


def _last_json_line(script: str, env: dict[str, str] | None = None) -> list:
    """What ``script``, run by a fresh interpreter of this venv at the repository root, printed last (JSON)."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
