"""gRPC's C core writes its own lines to stderr, past Python's logging: below ERROR they would put
lines that are not JSON into a JSON log (at shutdown under load, `Got goaway`). Forge's servers set
up logging, which quiets the core unless GRPC_VERBOSITY says otherwise, before grpc is imported
(the core reads the variable then)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

# Streaming calls cut by the server's stop: the client's transport gets a GOAWAY, which the core logs
# at INFO. argv[1] "setup": Forge's log set-up (JSON) first.
GOAWAY = textwrap.dedent("""
    import asyncio, sys
    if sys.argv[1] == "setup":
        from forge_service.logs import setup_logging
        setup_logging("info", "json")
    import grpc

    async def stream(request, context):
        for _ in range(1000):
            await context.write(b"x")
            await asyncio.sleep(0.01)

    async def cut():
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.T/S")(b"")
            await call.read()
            await server.stop(None)
            try:
                while await call.read() != grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass

    async def main():
        for _ in range(12):  # whether the client's transport reads the GOAWAY before the close is a race
            await cut()

    asyncio.run(main())
""")

# Which entry point to start; serving itself is stubbed out. Prints whether grpc was loaded when
# logging was set up, and GRPC_VERBOSITY after.
ENTRY = textwrap.dedent("""
    import os, sys
    import forge_service.__main__ as service_main
    import forge_service.logs as logs

    loaded = []
    real = logs.setup_logging
    def setup(level, fmt="text"):
        loaded.append("grpc" in sys.modules)
        real(level, fmt)
    logs.setup_logging = setup
    service_main.run_or_report = lambda start: 0
    if sys.argv[1] == "forge serve":
        from forge_service import cli
        cli.main(["serve"])
    elif sys.argv[1] == "python -m forge_service":
        service_main.main([])
    else:
        import forge_gateway.__main__ as gateway_main
        gateway_main.main([])
    print(loaded, os.environ.get("GRPC_VERBOSITY"))
""")


def run(script: str, arg: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    return subprocess.run([sys.executable, "-c", script, arg], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=100)


def core_lines(stderr: str) -> list[str]:
    """The C core's own lines: `I1128 05:59:35.441977    3104 chttp2_transport.cc:1403] ...`."""
    return [line for line in stderr.splitlines() if re.match(r"[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", line)]


def test_after_forges_log_set_up_the_core_writes_no_info_lines() -> None:
    plain = run(GOAWAY, "plain")
    assert any("Got goaway" in line for line in core_lines(plain.stderr)), plain.stderr  # left alone
    quiet = run(GOAWAY, "setup")
    assert quiet.returncode == 0, quiet.stderr
    assert core_lines(quiet.stderr) == []


@pytest.mark.parametrize("entry", ["forge serve", "python -m forge_service", "python -m forge_gateway"])
def test_servers_set_up_logging_before_grpc_loads(entry: str) -> None:
    result = run(ENTRY, entry)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[False]", "ERROR"], (result.stdout, result.stderr)
