"""A real OpenAI-compatible server for tests: ``transformers serve`` with the tiny model, on loopback.

``transformers serve`` (transformers 5.23, FastAPI + uvicorn) runs the project's tiny Llama on the
CPU, offline, from a local folder.  :class:`ServeProcess` starts it in its own process group, so a
test can stop it (SIGTERM), kill it (SIGKILL) or freeze it (SIGSTOP, then SIGCONT) as a whole.
Used by ``tests/test_engine_openai.py`` and ``tests/test_engine_hang.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from daskgen.engines.openai.server import free_port


@functools.lru_cache(maxsize=1)
def tiny_model() -> str:
    """The project's tiny Llama with the real SmolLM2 tokenizer, in a temporary folder."""
    from daskgen.models import build_tiny_model

    folder = tempfile.mkdtemp(prefix="daskgen-openai-tiny-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(build_tiny_model(Path(folder) / "tiny", seed=0))


class ServeProcess:
    """``transformers serve MODEL`` on a loopback port, in its own process group."""

    def __init__(self, model: str, port: int | None = None) -> None:
        self.model = model
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.log = Path(tiny_model()).parent / f"transformers-serve-{self.port}.log"  # removed with the model

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> ServeProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        cmd = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--log-level",
            "warning",
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise AssertionError(f"transformers serve did not start within {timeout} s:\n{self.log.read_text()[-3000:]}")

    def send(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group (SIGSTOP freezes it with its connections open)."""
        assert self.process is not None, "the server is not running"
        os.killpg(self.process.pid, sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop (or with SIGKILL: kill) the server's process group and reap it (a frozen one is woken first)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
            os.killpg(self.process.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
