"""Generated protobuf and gRPC stubs for proto/forge/v1/forge.proto. Never edit by hand:
run `make proto` (python -m forge_service.pb.generate); tests/unit/test_proto_drift.py checks them."""
