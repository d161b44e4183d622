"""Regenerate agent/_proto from proto/*.proto (run from the repository root; CI checks the result).

Usage: python proto/generate.py [--check]
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "proto").glob("*.proto"))
TARGET = ROOT / "agent" / "_proto"


def generate(out: Path) -> None:
    include = str(Path(protoc.__file__).parent / "_proto")
    for source in SOURCES:
        rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}",
                          f"--grpc_python_out={out}", str(source)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {source}")
    # The generated stubs import their siblings as top-level modules; make them package-relative.
    for path in out.glob("*_pb2*.py"):
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", path.read_text(), flags=re.M)
        path.write_text(text)


def main() -> int:
    check = "--check" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = [p.name for p in sorted(fresh.glob("*.py"))
                 if not (TARGET / p.name).is_file() or (TARGET / p.name).read_text() != p.read_text()]
        if check:
            if stale:
                print("out of date: " + ", ".join(stale) + " (run python proto/generate.py)")
                return 1
            return 0
        for path in fresh.glob("*.py"):
            (TARGET / path.name).write_text(path.read_text())
        print("generated " + ", ".join(sorted(p.name for p in fresh.glob("*.py"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
