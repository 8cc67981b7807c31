"""Turn every .proto under protos/ into Python modules under the repository root.

The import path of a .proto file is its Python module path (protos/podvm_core/pb/x.proto
becomes podvm_core/pb/x_pb2.py), so no generated import is ever rewritten. Run by the
build (setup.py) and by `make gen`; the output is never edited by hand.
"""
from __future__ import annotations

import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {len(files)} files under {PROTO_ROOT}")
    # Packages for every generated directory, so plain imports work everywhere.
    for proto in proto_files():
        rel = proto.relative_to(PROTO_ROOT).parent
        for depth in range(len(rel.parts)):
            init = out_dir.joinpath(*rel.parts[: depth + 1], "__init__.py")
            if not init.exists():
                init.touch()


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    generate(target.resolve())
    print(f"generated {len(proto_files())} proto files into {target}")
