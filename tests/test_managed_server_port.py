"""A managed server whose port another process takes before it binds it is started again on another port.

sglang's server binds its HTTP port only after loading its model, so the port daskgen chose free can be taken in
between (CI saw it: ``[Errno 98] ... address already in use``, and the run's engine restart failed).  Here the
server process is a stand-in (a labelled test double: a small HTTP server that binds the port it is given, or exits
with uvicorn's message when it cannot), the port conflict is real: the first port handed out is held by this test.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from daskgen.engines.openai import server as managed
from daskgen.errors import EngineError

pytestmark = pytest.mark.timeout(120)

STAND_IN = """
import http.server, sys
port = int(sys.argv[1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          f"{exc.strerror.lower()}", flush=True)
    sys.exit(1)
server.serve_forever()
"""


class StandIn(managed.ManagedServer):  # TEST DOUBLE: an HTTP server that only answers health checks
    def command(self, port: int, cuda_available: bool) -> list[str]:
        self.ports = [*getattr(self, "ports", []), port]
        self.logs = [*getattr(self, "logs", []), *([self.log_path] if self.log_path else [])]  # earlier launches'
        return [sys.executable, "-c", STAND_IN, str(port)]


def held_ports(n: int) -> list[socket.socket]:
    """``n`` loopback ports bound by this process, as an outgoing connection holds its port (not listening: a
    health check there is refused at once)."""
    taken = []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((managed.LOOPBACK, 0))
        taken.append(sock)
    return taken


def test_a_taken_port_is_retried_on_another_and_the_last_failure_names_it(monkeypatch):
    taken = held_ports(managed.PORT_ATTEMPTS)
    ports = iter([*(s.getsockname()[1] for s in taken[:1])])
    real = managed.free_port
    monkeypatch.setattr(managed, "free_port", lambda host=managed.LOOPBACK: next(ports, None) or real(host))
    server = StandIn("model", start_timeout_s=60)

    async def started() -> int:
        await server.start()
        try:
            return server.port
        finally:
            await server.stop()

    port = asyncio.run(started())
    assert server.ports == [taken[0].getsockname()[1], port] and port != taken[0].getsockname()[1]
    assert not [log for log in [*server.logs, server.log_path] if log.exists()], "a launch's log was left behind"

    every = iter([s.getsockname()[1] for s in taken])  # every launch finds its port taken: the error names it
    monkeypatch.setattr(managed, "free_port", lambda host=managed.LOOPBACK: next(every))
    again = StandIn("model", start_timeout_s=60)
    with pytest.raises(EngineError, match="address already in use") as failed:
        asyncio.run(again.start())
    assert len(again.ports) == managed.PORT_ATTEMPTS == 3 and not again.alive  # docs/engines.md: three launches
    assert not [log for log in again.logs if log.exists()], "an earlier launch's log was left behind"
    assert str(again.log_path) in str(failed.value) and again.log_path.exists()  # the error names the last one's log
    again.log_path.unlink()
    for sock in taken:
        sock.close()


def test_another_start_failure_is_not_retried(monkeypatch):
    class Failing(StandIn):  # TEST DOUBLE: a server that exits at once for another reason
        def command(self, port: int, cuda_available: bool) -> list[str]:
            super().command(port, cuda_available)
            return [sys.executable, "-c", "import sys; print('model not found'); sys.exit(2)"]

    server = Failing("model", start_timeout_s=60)
    with pytest.raises(EngineError, match="model not found") as failed:
        asyncio.run(server.start())
    assert len(server.ports) == 1
    assert str(server.log_path) in str(failed.value)  # kept for the user to read; this test removes it
    server.log_path.unlink()
    assert managed.port_taken("[Errno 98] error while attempting to bind: Address already in use")
