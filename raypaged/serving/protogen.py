"""Regenerates the checked-in gRPC stubs from ``protos/``: ``make protos`` or
``python -m raypaged.serving.protogen``.

grpcio-tools writes ``from raypaged.v1 import generate_pb2``; the stubs live in
``raypaged/serving/proto/``, so that import is rewritten to the package path.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PROTO_FILES = ("raypaged/v1/generate.proto",)
STUB_DIR = Path(__file__).resolve().parent / "proto"
_GENERATED_IMPORT = "from raypaged.v1 import"
_PACKAGE_IMPORT = "from raypaged.serving.proto import"


def generate_stubs() -> dict[str, str]:
    """File name → text of every stub generated from the protos."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
        if protoc.main([*args, *(str(PROTO_ROOT / p) for p in PROTO_FILES)]) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILES}")
        generated = Path(out) / "raypaged" / "v1"
        return {
            p.name: p.read_text().replace(_GENERATED_IMPORT, _PACKAGE_IMPORT) for p in sorted(generated.glob("*.py*"))
        }


def main() -> int:
    for name, text in generate_stubs().items():
        (STUB_DIR / name).write_text(text)
        print(f"wrote {STUB_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
