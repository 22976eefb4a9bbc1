"""Helpers for tests that watch a run from outside: the probe engine's events, a process's output lines.

The probe engine (:mod:`daskgen.testing.probes`, a labelled test double) records every request that
reaches the engine and can hold chosen ones at a gate; these helpers start ``daskgen run`` with it
and wait for events instead of guessing how long something takes.
"""

from __future__ import annotations

import http.client
import http.server
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from daskgen.testing.probes import read_events, row_of

PROBE = [
    "--engine",
    "daskgen.testing.probes:ProbeEngine",
    "--engine-arg",
    "inner=simulated",
    "--model",
    "sim",
    "--max-new-tokens",
    "16",
    "--max-prompt-tokens",
    "128",
]


def probe_args(tmp_path: Path, store_path, *extra, events: str = "events.log", step: float = 0.0) -> list:
    """``daskgen run`` arguments for the simulated engine behind the probe (events in ``tmp_path/events``)."""
    return [
        *PROBE,
        "--engine-arg",
        f"events_path={tmp_path / events}",
        "--engine-arg",
        f"time_scale={step}",
        "--store",
        store_path,
        *extra,
    ]


def gate_args(gate: Path, rows: list[int]) -> list[str]:
    """Arguments that hold every request of ``rows`` at the engine until the file ``gate`` exists."""
    return ["--engine-arg", f"gate_path={gate}", "--engine-arg", f"gate_rows={rows}"]


def wait_for_arrival(events: Path, proc: subprocess.Popen, row: int, timeout: float = 120.0) -> None:
    """Wait until a request of prompt ``row`` reached the engine (the run must still be going)."""
    deadline = time.monotonic() + timeout
    while not any(e.kind == "arrive" and row_of(e.request_id) == row for e in read_events(events)):
        assert proc.poll() is None, f"the run ended first: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"no request of row {row} reached the engine in {timeout} s"
        time.sleep(0.05)


class OutputLines:
    """Collects a process's output lines in a thread, so a test can wait for one without blocking."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.arrived: list[float] = []  # time.monotonic() when each line was read
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.arrived.append(time.monotonic())
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120.0) -> float:
        """Wait until a line containing ``text`` was printed; when it was read (``time.monotonic()``)."""
        deadline = time.monotonic() + timeout
        while (found := self.first(text)) is None:
            assert time.monotonic() < deadline, f"{text!r} not printed in {timeout} s:\n{self.text()}"
            assert self._thread.is_alive() or self.first(text) is not None, self.text()
            time.sleep(0.05)
        return found

    def first(self, text: str) -> float | None:
        """When the first line containing ``text`` was read, or ``None``."""
        return next((t for t, line in zip(self.arrived, list(self.lines), strict=False) if text in line), None)

    def text(self) -> str:
        """Everything read so far (all of it once the process ended and :meth:`join` returned)."""
        return "".join(self.lines)

    def join(self, timeout: float = 60.0) -> str:
        """Wait for the end of the output; returns all of it."""
        self._thread.join(timeout)
        return self.text()


class InFlightProxy:
    """TEST DOUBLE: a stdlib reverse proxy in front of a real server that counts what is in flight.

    Everything is forwarded to ``upstream`` unchanged (bodies buffered, streams included).
    ``in_flight`` counts requests forwarded and not answered yet; ``broken`` those whose upstream
    connection broke after they were sent (the server died under them), ``refused`` those the
    upstream refused (no server).  In both cases the proxy closes the client's connection without
    an answer, as a dead server would.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.in_flight = self.broken = self.refused = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, counter: str, timeout: float = 120.0) -> int:
        """Wait until ``counter`` (``in_flight``, ``broken``, ``refused``) is above zero; returns it."""
        deadline = time.monotonic() + timeout
        while not getattr(self, counter):
            assert time.monotonic() < deadline, f"proxy: {counter} still 0 after {timeout} s"
            time.sleep(0.01)
        return getattr(self, counter)

    def _count(self, name: str, step: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + step)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                forward = urllib.request.Request(proxy.upstream + self.path, data=body, method=method, headers=headers)
                proxy._count("in_flight", 1)
                try:
                    with urllib.request.urlopen(forward, timeout=120) as response:
                        status, kind, payload = (
                            response.status,
                            response.headers.get("content-type", ""),
                            response.read(),
                        )
                except urllib.error.HTTPError as exc:
                    status, kind, payload = exc.code, exc.headers.get("content-type", ""), exc.read()
                except (OSError, http.client.HTTPException) as exc:
                    refused = isinstance(getattr(exc, "reason", None), ConnectionRefusedError)
                    proxy._count("refused" if refused else "broken", 1)
                    self.close_connection = True  # no answer: the client sees a dead server
                    return
                finally:
                    proxy._count("in_flight", -1)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> Any:
    """Poll ``predicate`` until it is truthy and return what it gave; the run ``proc`` must still be going."""
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-6000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)
    return found
