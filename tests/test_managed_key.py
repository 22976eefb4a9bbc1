"""The random API key of managed sglang servers (daskgen/engines/openai/server.py), without sglang.

:class:`ManagedServer` is pointed (``python=``) at a **test double**: a small stdlib HTTP server
script that reads ``--port`` and ``--config`` the way ``sglang.launch_server`` does, requires the
config's ``api-key`` as a bearer token on everything but ``/health*`` (as sglang 0.5.23's
``decide_request_auth`` does) and logs its arguments like sglang.  It checks daskgen's side: the key
is random per server, travels in a private file (not the command line), is removed once the server
answers, is sent by the engine's client, and is masked in log tails.  The real sglang server refusing
a request without the key is ``tests/test_engine_http_sglang.py::test_managed_server_requires_its_key``
(the sglang lane).
"""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path

import httpx
import pytest

from daskgen.engines.openai.client import HTTPClient
from daskgen.engines.openai.server import ManagedServer, new_api_key
from daskgen.errors import ConfigError

DOUBLE = """#!{python}
import http.server, json, sys
import yaml
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
key = yaml.safe_load(open(args[args.index("--config") + 1]))["api-key"]
print("server_args=", {{"api_key": key, "port": port}}, flush=True)  # sglang logs its resolved arguments

class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        ok = self.path.startswith("/health") or self.headers.get("Authorization") == "Bearer " + key
        body = json.dumps({{"ok": True}} if ok else {{"error": "Unauthorized"}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def double(tmp_path: Path) -> str:
    """A python stand-in that ignores ``-m sglang.launch_server`` and runs the double (labelled above)."""
    script = tmp_path / "fake-sglang-python"
    script.write_text(
        DOUBLE.format(python=sys.executable).replace(
            "args = sys.argv[1:]", "args = sys.argv[3:]  # after '-m sglang.launch_server'"
        )
    )
    script.chmod(0o700)
    return str(script)


def test_each_server_gets_its_own_random_key() -> None:
    keys = {ManagedServer("/m").api_key for _ in range(3)} | {new_api_key()}
    assert len(keys) == 4 and all(k.startswith("daskgen-") and len(k) == 8 + 64 for k in keys)
    server = ManagedServer("/m")
    assert server.api_key not in repr(server)


def test_key_and_config_are_not_accepted_as_server_args() -> None:
    for args in ({"api_key": "x"}, {"admin_api_key": "x"}, {"config": "/tmp/x.yaml"}):
        with pytest.raises(ConfigError):
            ManagedServer("/m", args)


@pytest.mark.timeout(60)
def test_key_travels_in_a_private_file_and_the_client_sends_it(double: str) -> None:
    server = ManagedServer("/m", python=double, start_timeout_s=30)

    async def scenario() -> None:
        started = asyncio.ensure_future(server.start())
        while server.process is None:  # the launch: command line and key file as the server sees them
            await asyncio.sleep(0.01)
        key_file = server.config_dir / "server.yaml"
        assert stat.S_IMODE(server.config_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and server.api_key in key_file.read_text()
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        assert "--config" in cmdline and server.api_key not in cmdline  # `ps` shows no key
        await started
        assert not key_file.exists()  # read at launch, removed once the server answers
        async with httpx.AsyncClient() as anonymous:
            assert (await anonymous.post(server.url + "/generate", json={})).status_code == 401
        client = HTTPClient(server.url, api_key=server.api_key, trust_env=False)
        try:
            assert await client.post_json("/generate", {}) == {"ok": True}
        finally:
            await client.close()
        assert server.api_key in server.log_path.read_text()  # sglang logs it (file mode 0600) ...
        assert server.api_key not in server.log_tail() and "***" in server.log_tail()  # ... messages do not

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(server.stop())
    assert server.config_dir is None
