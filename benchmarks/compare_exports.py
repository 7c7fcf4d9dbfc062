"""Two serving exports tensor by tensor: which safetensors names only one holds, which tensors differ (dtype, shape
or bytes), and which fields of config.json's ``quantization_config`` differ.

Run:  .venv/bin/python benchmarks/compare_exports.py EXPORT_A EXPORT_B
(e.g. fp8forge's compressed-tensors-fp8-dynamic against llm-compressor's FP8_DYNAMIC: docs/benchmarks/
engine-2026-12-03c.md). Figures only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engines.engine import file_tensors  # noqa: E402


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (FP8 compared as its bytes: torch.equal has no FP8 kernel on the CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def main() -> None:
    first, second = (Path(arg) for arg in sys.argv[1:3])
    a, b = file_tensors(first), file_tensors(second)
    for name, only in (("only in the first", sorted(set(a) - set(b))), ("only in the second", sorted(set(b) - set(a)))):
        print(f"{name}: {len(only)} {only[:6]}")
    kinds: dict[str, list[int]] = {}
    for key in sorted(set(a) & set(b)):
        equal = same(a[key], b[key])
        kinds.setdefault(key.rsplit(".", 1)[-1], [0, 0])[0 if equal else 1] += 1
        if not equal:
            print(f"differs: {key} {a[key].dtype} {tuple(a[key].shape)} | {b[key].dtype} {tuple(b[key].shape)}")
    print("by tensor kind, [equal, differing]:", kinds)
    qa, qb = (json.loads((path / "config.json").read_text()).get("quantization_config", {}) for path in (first, second))
    for field in sorted(set(qa) | set(qb)):
        if qa.get(field) != qb.get(field):
            print(f"quantization_config.{field}: {json.dumps(qa.get(field))[:300]} | {json.dumps(qb.get(field))[:300]}")


if __name__ == "__main__":
    main()
