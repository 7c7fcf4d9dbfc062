"""Write (or check) ``openapi/openapi.json`` from the app: ``python openapi/generate.py [--check]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "openapi" / "openapi.json"


def render() -> str:
    """The app's OpenAPI document as stable, sorted JSON text."""
    sys.path.insert(0, str(ROOT))
    from service.config import Settings
    from service.main import create_app

    # the schema is the same with API keys configured; auth_disabled only spares the generator a key file
    spec = create_app(Settings(data_dir=ROOT / "data", auth_disabled=True)).openapi()
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the file differs from the app")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not SPEC.exists() or SPEC.read_text() != text:
            print(f"{SPEC} is out of date; run: python openapi/generate.py", file=sys.stderr)
            return 1
        return 0
    tmp = SPEC.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(SPEC)
    print(f"wrote {SPEC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
