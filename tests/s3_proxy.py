"""A fault-injecting HTTP proxy on loopback, in front of a real S3-protocol server (moto's).

Test double, labelled: it forwards every request unchanged to the server behind it and, for a seeded
share of them, answers as a struggling object store would instead: ``503 SlowDown``, ``500
InternalError``, a connection reset without an answer, or an answer delayed by ``slow_s``.  Resets hit
reads only, unless ``reset_writes`` is set: then a PUT that draws a fault is reset instead, either
before it is forwarded (``reset-put``: the write never reached the server) or after the server stored
it (``reset-after-put``: the write landed, its answer is lost).  It can also
stand in for the credential check moto skips (``403 InvalidAccessKeyId`` for one access key id), and an
outage mode fails every request until it is lifted (set ``outage``, or ``outage_after = (fragment, n)``
to begin it right after the ``n``-th forwarded PUT whose path holds ``fragment``: mid-run, whatever the
machine's speed).  ``lose_answers = (fragment, n)`` stores the next ``n`` PUTs whose path holds ``fragment``
and resets their connections (``lost-answer``); ``kinds`` narrows the faults drawn to the ones named, and
``slow_after_forward`` delays a ``slow`` answer after the server stored the write instead of before.  What it
injected is counted per kind, so a test can show that each fault really happened.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import http.server
import random
import socket
import threading
import time
import urllib.parse

FAULTS = ("slowdown", "internal", "reset", "slow")

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_INTERNAL = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code></Error>'
_BAD_KEY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
    b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>"
)


class FaultProxy:
    """Forwards to ``upstream`` (``http://host:port``); see the module docstring for the faults."""

    def __init__(
        self,
        upstream: str,
        share: float = 0.0,
        seed: int = 0,
        slow_s: float = 0.5,
        reset_writes: bool = False,
        methods: tuple[str, ...] = ("GET", "HEAD", "PUT", "POST", "DELETE"),
    ) -> None:
        self.methods = methods  # only requests of these methods get faults
        self.upstream = urllib.parse.urlsplit(upstream)
        self.reset_writes = reset_writes
        self.share, self.slow_s = share, slow_s
        self.random = random.Random(seed)
        self.outage = False
        self.outage_after: tuple[str, int] | None = None
        self.lose_answers: tuple[str, int] | None = None
        self.kinds: tuple[str, ...] | None = None
        self.slow_after_forward = False
        self.refused_key: str | None = None
        self.injected: collections.Counter[str] = collections.Counter()
        #: PUT requests per (path, digest of the body), faulted or not: a write sent again has the same key, a later
        #: write of other bytes to the same path does not
        self.puts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.slowed: list[tuple[str, str]] = []  # the keys of the PUTs answered late (``slow``)
        self.forwarded = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _count_towards_outage(self, method: str, path: str) -> None:
        if self.outage_after is None or method != "PUT" or self.outage_after[0] not in path:
            return
        fragment, left = self.outage_after
        if left <= 0:  # the n-th matching PUT went through: every request from here on fails
            self.outage, self.outage_after = True, None
        else:
            self.outage_after = (fragment, left - 1)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def pick_fault(self, method: str, authorization: str, path: str = "") -> str | None:
        """The fault to inject for one request, or ``None`` to forward it."""
        with self._lock:
            self._count_towards_outage(method, path)
            lose = self.lose_answers
            if lose and method == "PUT" and lose[0] in path and lose[1] > 0:
                self.lose_answers = (lose[0], lose[1] - 1)
                fault = "lost-answer"
            elif self.refused_key and f"Credential={self.refused_key}/" in authorization:
                fault = "bad-key"
            elif self.outage:
                fault = "outage"
            elif method in self.methods and self.random.random() < self.share:
                fault = self.random.choice(
                    self.kinds or (FAULTS if method in ("GET", "HEAD") else FAULTS[:2] + FAULTS[3:])
                )
                if self.reset_writes and method == "PUT":
                    fault = self.random.choice(("reset-put", "reset-after-put"))
            else:
                self.forwarded += 1
                return None
            self.injected[fault] += 1
            return fault

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                return

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.pick_fault(self.command, self.headers.get("Authorization", ""), self.path)
                if self.command == "PUT":
                    key = (self.path, hashlib.sha256(body).hexdigest())
                    with proxy._lock:
                        proxy.puts[key] += 1
                        if fault == "slow":
                            proxy.slowed.append(key)
                if fault in ("reset-after-put", "lost-answer"):
                    self._forward(body, answer=False)
                if fault in ("reset", "reset-put", "reset-after-put", "lost-answer"):
                    return self._reset()
                if fault in ("slowdown", "outage"):
                    return self._answer(503, _SLOWDOWN)
                if fault == "internal":
                    return self._answer(500, _INTERNAL)
                if fault == "bad-key":
                    return self._answer(403, _BAD_KEY)
                if fault == "slow" and not proxy.slow_after_forward:
                    time.sleep(proxy.slow_s)
                self._forward(body, delay=proxy.slow_s if fault == "slow" and proxy.slow_after_forward else 0.0)

            def _reset(self) -> None:
                linger = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # close with RST, not FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                self.close_connection = True
                self.connection.close()

            def _forward(self, body: bytes, answer: bool = True, delay: float = 0.0) -> None:
                up = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                up.request(self.command, self.path, body=body if body else None, headers=headers)
                reply = up.getresponse()
                data = reply.read()
                up.close()
                if not answer:
                    return
                time.sleep(delay)
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler
