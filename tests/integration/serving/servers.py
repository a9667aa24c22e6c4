"""Real Forge servers as child processes on free loopback ports, and small clients for them.

Every process is started in its own session (process group), so that stopping it also stops
whatever it started (`make serve` runs `forge serve`); `running_forge` kills the group when
the block exits, whatever happened inside.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]
VENV = Path(sys.executable).parent.parent  # the venv running the tests
FORGE = VENV / "bin" / "forge"
SERVICE_NAME = "forge.v1.Forge"
# One torch thread per process: the servers and the test process share two cores, and torch's
# OpenMP threads slow down ten-fold when more of them than cores are busy.
SERVER_THREADS = ["--num-threads", "1"]
LOAD_TIMEOUT_S = 180.0


@dataclass
class ForgeProcess:
    """One `forge serve` (or `make serve`) child process and its ports."""

    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: Path
    metrics_port: int = 0  # the service's Prometheus port
    started_at: float = field(default_factory=time.monotonic)
    _channel: grpc.Channel | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return self._channel

    @property
    def stub(self) -> pb_grpc.ForgeStub:
        return pb_grpc.ForgeStub(self.channel)

    def health(self) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s} s\n{self.log_tail()}")
            time.sleep(0.05)

    def readiness(self, service: str = SERVICE_NAME) -> int | None:
        """grpc.health.v1 status of `service` ("": liveness), or None while the port does not answer."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None

    def wait_ready(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        self.wait_until(lambda: self.readiness() == serving, timeout_s, "grpc.health.v1 SERVING")

    def wait_idle(self, timeout_s: float = 20.0) -> pb.HealthResponse:
        """Wait until nothing runs or waits and no KV block is in use; returns that Health."""
        last: list[pb.HealthResponse] = []

        def idle() -> bool:
            last[:] = [self.health()]
            h = last[0]
            return h.kv_blocks_used == 0 and h.num_running == 0 and h.num_waiting == 0

        self.wait_until(idle, timeout_s, f"KV blocks back to 0 (last Health: {last})")
        return last[0]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within timeout_s."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        _signal_group(self.proc, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc, signal.SIGKILL)
            return self.proc.wait(10)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)


@contextlib.contextmanager
def running_forge(args: list[str], *, command: list[str] | None = None, cwd: Path = REPO,
                  env: dict[str, str] | None = None, grpc_port: int | None = None,
                  http_port: int | None = None) -> Iterator[ForgeProcess]:
    """Start `forge serve ARGS --grpc-port G --http-port H --metrics-port M` (or `command`, which
    must use the ports it is given through `{grpc_port}`/`{http_port}`/`{metrics_port}`); always
    kill it on exit."""
    grpc_port, http_port, metrics_port = grpc_port or free_port(), http_port or free_port(), free_port()
    ports = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    argv = [str(FORGE), "serve", *args, *ports] if command is None else \
        [part.format(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port) for part in command]
    log = Path(tempfile.mkstemp(prefix="forge-serve-", suffix=".log")[1])
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    child_env.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = ForgeProcess(proc, grpc_port, http_port, log, metrics_port)
    try:
        yield server
    finally:
        server.stop()
        log.unlink(missing_ok=True)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the offline reference with the servers' thread count (and leave others' as it was)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
