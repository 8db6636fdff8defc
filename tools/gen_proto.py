"""Generate Python code and .pyi stubs from proto/ into a package folder.

Usage: python tools/gen_proto.py [OUT_DIR]   (default services/switchyard/api)

grpc_tools writes ``import agent_pb2``; the generated modules live in a
package, so that import is rewritten to a relative one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(fixed)
        written.append(path)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated from proto/ by `make proto`; do not edit."""\n')
    return [init, *written]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "services" / "switchyard" / "api"
    for p in generate(target):
        print(p.relative_to(target.parent) if target.parent in p.parents else p)
