"""Remove the compiled torchao kernels that this interpreter and torch cannot load.

torchao's PyPI wheel (cp310-abi3) carries CUDA kernels: ``_C_cutlass_90a.abi3.so`` (any CPython 3.10+, CUDA
torch only) and ``_C_mxfp8.cpython-310-*.so`` (CPython 3.10 only). ``import torchao``, which transformers does
whenever torchao is installed, tries to load each one and prints a failure for every file it cannot load: on a
CPU-only torch all of them, on another Python the cp310 one. fp8forge never calls them (Float8Linear, the
training configs' emulated paths and the CPU casts are plain PyTorch), so after installing, the Makefile and
the Dockerfile remove exactly those files. Kernels that can load (a CUDA torch on CPython 3.10) stay.

Run with the interpreter of the environment to prune: ``.venv/bin/python tools/prune_torchao_kernels.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path


def unloadable_kernels(package: Path, *, cuda: bool, python: tuple[int, int]) -> list[Path]:
    """The ``_C*.so`` files of the torchao package in ``package`` that cannot load here."""
    tag = f"cpython-{python[0]}{python[1]}-"
    found = []
    for path in sorted(package.glob("_C*.so")):
        built_for = re.search(r"\.(cpython-\d+-)", path.name)
        if not cuda or (built_for is not None and built_for.group(1) != tag):
            found.append(path)
    return found


def main() -> int:
    spec = importlib.util.find_spec("torchao")  # locating it imports nothing: the import is what prints
    if spec is None or spec.origin is None:
        print("torchao is not installed here; nothing to prune")
        return 0
    import torch

    package = Path(spec.origin).parent
    for path in unloadable_kernels(package, cuda=torch.version.cuda is not None, python=sys.version_info[:2]):
        path.unlink()
        print(f"removed {path} (cannot load with torch {torch.__version__} on Python "
              f"{sys.version_info[0]}.{sys.version_info[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
