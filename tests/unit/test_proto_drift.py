"""The committed stubs under forge_service/pb/ match proto/forge/v1/forge.proto byte for byte."""
from __future__ import annotations

from pathlib import Path

from forge_service.pb import generate


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    for name in generate.OUTPUTS:
        committed = (generate.PB_DIR / name).read_bytes()
        fresh = (tmp_path / name).read_bytes()
        assert committed == fresh, f"forge_service/pb/{name} drifted from the .proto: run `make proto`"


def test_stubs_import_by_package_path() -> None:
    from forge_service.pb import forge_pb2, forge_pb2_grpc

    assert forge_pb2.DESCRIPTOR.name == "forge/v1/forge.proto"
    assert forge_pb2.DESCRIPTOR.services_by_name["Forge"].full_name == "forge.v1.Forge"
    assert "from forge_service.pb import forge_pb2" in Path(forge_pb2_grpc.__file__).read_text()


def test_every_field_and_enum_value_is_commented() -> None:
    from google.protobuf import descriptor_pb2

    source = generate.PROTO_ROOT / generate.PROTO_FILE
    text = source.read_text()
    fds = descriptor_pb2.FileDescriptorSet.FromString((generate.PB_DIR / "forge_descriptor.pb").read_bytes())
    forge = next(f for f in fds.file if f.name == generate.PROTO_FILE)
    for message in forge.message_type:
        for field in message.field:
            # The line declaring the field must follow a comment line.
            lines = text.splitlines()
            idx = next(i for i, line in enumerate(lines)
                       if f" {field.name} = {field.number};" in line and _inside(lines, i, message.name))
            assert lines[idx - 1].strip().startswith("//"), f"{message.name}.{field.name} has no comment"
    for enum in forge.enum_type:
        assert enum.value[0].name.endswith("_UNSPECIFIED") and enum.value[0].number == 0


def _inside(lines: list[str], idx: int, message: str) -> bool:
    for line in reversed(lines[:idx]):
        if line.startswith("message "):
            return line.split()[1] == message
    return False
