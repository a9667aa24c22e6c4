"""The OpenAI-compatible REST gateway: JSON and SSE in, gRPC to forge_service out. No model code."""
