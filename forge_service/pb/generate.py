"""Regenerate the committed stubs from proto/: `python -m forge_service.pb.generate`.

protoc names imports after the proto's package path (`from forge.v1 import forge_pb2`); the
stubs live flat in forge_service/pb/, so that one import is rewritten to the package path.
The proto itself keeps its file name `forge/v1/forge.proto`, which reflection and Envoy see.
"""
from __future__ import annotations

import argparse
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
THIRD_PARTY = PROTO_ROOT / "third_party"
PROTO_FILE = "forge/v1/forge.proto"
PB_DIR = Path(__file__).resolve().parent
# The files `generate` writes; the drift test compares exactly these.
OUTPUTS = ("forge_pb2.py", "forge_pb2.pyi", "forge_pb2_grpc.py", "forge_descriptor.pb")
CHART_DESCRIPTOR = ROOT / "helm" / "forge" / "files" / "forge_descriptor.pb"
_IMPORT_FROM = "from forge.v1 import forge_pb2"
_IMPORT_TO = "from forge_service.pb import forge_pb2"


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    argv = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{THIRD_PARTY}", f"-I{well_known}", *args]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(argv)}")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs and the descriptor set for proto/forge/v1/forge.proto into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                 f"--descriptor_set_out={tmp}/forge_descriptor.pb", "--include_imports", PROTO_FILE])
        generated = Path(tmp) / "forge" / "v1"
        shutil.move(str(Path(tmp) / "forge_descriptor.pb"), generated / "forge_descriptor.pb")
        written = []
        for name in OUTPUTS:
            data = (generated / name).read_bytes()
            if name.endswith(".py"):
                data = data.replace(_IMPORT_FROM.encode(), _IMPORT_TO.encode())
            (out_dir / name).write_bytes(data)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PB_DIR, help="output directory (default: forge_service/pb)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    if args.out == PB_DIR:  # the Helm chart's Envoy ConfigMap is built from its own copy of the descriptor
        shutil.copyfile(PB_DIR / "forge_descriptor.pb", CHART_DESCRIPTOR)
        print(CHART_DESCRIPTOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
