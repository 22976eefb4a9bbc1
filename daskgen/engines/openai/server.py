"""The managed SGLang server of the ``openai`` engine (``managed=True``): one subprocess per engine.

:class:`ManagedServer` is one ``python -m sglang.launch_server`` subprocess per engine.  It picks
a free loopback port, starts the server in its own process group (so that stopping it also stops
the scheduler and detokenizer processes it spawns), waits until ``/health_generate`` answers
200, and stops the whole group on :meth:`~ManagedServer.stop` (removing the load-report files its
processes held open in ``/dev/shm``: :mod:`daskgen.engines.leftovers`).  The server's output goes to a
log file whose last lines are quoted by every error, so a failed launch says why.

Loopback is reachable by every user of a shared node, so each managed server gets a random API
key of its own (``--api-key``), which the engine's client sends.  The key travels in a private
``--config`` YAML file (mode 0600, removed once the server answers), never on the command line
(visible to all users in ``ps``), in logs, messages or store attributes.

:func:`update_server_weights` loads a policy checkpoint into a running server in place (policy refresh).

A server subprocess (unlike an in-process ``sglang.Engine``) also starts from a daemonic Dask
worker process: ``subprocess`` is allowed where ``multiprocessing`` children are not.  The HTTP
client that talks to it lives in :mod:`daskgen.engines.openai.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daskgen import tunables
from daskgen.engines.inprocess import cuda_available
from daskgen.engines.leftovers import SGLANG_LOADS, SHARED_MEMORY, held_files, remove_files
from daskgen.engines.openai.client import HTTPClient, NoAnswer, RequestFailed, httpx, require_http
from daskgen.engines.sglang.args import launch_kwargs
from daskgen.engines.sglang.weights import flush_when_idle, loaded_but_not_flushed
from daskgen.errors import ConfigError, EngineError, RefreshError
from daskgen.redaction import is_secret_key

__all__ = [
    "PORT_ATTEMPTS",
    "ManagedServer",
    "check_server_args",
    "free_port",
    "new_api_key",
    "port_taken",
    "server_env",
    "server_flags",
    "update_server_weights",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_TAIL_LINES = 30


#: Launches of a managed server whose port another process took before it bound it (see ``ManagedServer.start``).
PORT_ATTEMPTS = 3


def port_taken(message: str) -> bool:
    """Whether a server's failure ``message`` (with its log's last lines) says its port was in use."""
    return "address already in use" in message.lower()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_flags(kwargs: Mapping[str, Any]) -> list[str]:
    """``launch_server`` command-line flags for ``kwargs``: ``{"tp_size": 2}`` -> ``--tp-size 2``.

    ``True`` becomes a bare flag, ``False`` and ``None`` are left out, lists give one value
    per item and dicts are passed as JSON.
    """
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def check_server_args(server_args: Mapping[str, Any]) -> None:
    """Refuse options daskgen sets itself (model, host, port, the key's config file) and secrets."""
    own = sorted(set(server_args) & {"model_path", "host", "port", "config"})
    if own:
        raise ConfigError(
            f"openai engine: server_args must not set {own}; daskgen sets the model (its `model`), "
            f"host ({LOOPBACK}), a free port and a --config file with the server's API key itself"
        )
    secret = sorted(k for k in server_args if is_secret_key(k))  # they would show in `ps`
    if secret:
        raise ConfigError(
            f"openai engine: server_args must not contain {secret}: daskgen gives every managed "
            "server a random API key of its own (in a private file), and a command line is visible "
            "to every local user"
        )


class ManagedServer:
    """One sglang HTTP server subprocess on a free loopback port.

    Parameters
    ----------
    model:
        Model folder or name given to ``--model-path``.
    server_args:
        Further ``launch_server`` options (``ServerArgs`` field names, e.g. ``{"tp_size": 2}``).
        On a machine without CUDA the sglang engine's CPU defaults fill in what is unset.
    start_timeout_s:
        How long :meth:`start` waits for the server to answer ``/health_generate``.
    python:
        The interpreter that runs sglang (default: this one).
    api_key:
        The server's API key (default: a fresh random one, :func:`new_api_key`); requests without
        it are refused (``/health*`` stays open).  Never logged: error messages and log tails
        show ``***`` instead.
    """

    def __init__(
        self,
        model: str,
        server_args: Mapping[str, Any] | None = None,
        *,
        start_timeout_s: float = 600.0,
        python: str | None = None,
        api_key: str | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        self.adapters = dict(adapters or {})
        self.server_args = dict(server_args or {})
        check_server_args(self.server_args)
        self.start_timeout_s = start_timeout_s
        self.python = python or sys.executable
        self.api_key = api_key or new_api_key()
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.config_dir: Path | None = None
        self.healthy = False

    def __repr__(self) -> str:  # the key stays out of reprs (and so out of tracebacks and logs)
        return f"ManagedServer(model={self.model!r}, port={self.port}, api_key=***)"

    @property
    def url(self) -> str:
        """Base URL of the running server (``http://127.0.0.1:PORT``)."""
        return f"http://{LOOPBACK}:{self.port}"

    def command(self, port: int, cuda_available: bool) -> list[str]:
        """The ``launch_server`` command line for ``port``."""
        kwargs = launch_kwargs(self.model, self.server_args, cuda_available, self.adapters)
        kwargs.update(host=LOOPBACK, port=port)
        if self.config_dir is not None:  # the API key, read by sglang as if given as --api-key
            kwargs["config"] = str(self.config_dir / "server.yaml")
        return [self.python, "-m", "sglang.launch_server", *server_flags(kwargs)]

    def _write_key_file(self) -> None:
        """The ``--config`` file holding the API key: a private directory (0700) and file (0600)."""
        import yaml

        self.config_dir = Path(tempfile.mkdtemp(prefix="daskgen-sglang-key-"))
        fd = os.open(self.config_dir / "server.yaml", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as stream:
            yaml.safe_dump({"api-key": self.api_key}, stream)

    def _remove_key_file(self) -> None:
        if self.config_dir is not None:
            shutil.rmtree(self.config_dir, ignore_errors=True)
            self.config_dir = None

    @property
    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    async def start(self) -> None:
        """Launch the server and wait until it generates; raise :class:`EngineError` otherwise.

        The port is chosen free before the launch, but sglang binds it only once its model is loaded: a server that
        exits because another process took the port meanwhile is started again on another one, up to
        :data:`PORT_ATTEMPTS` launches in all."""
        require_http()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return await self._launch()
            except EngineError as exc:
                if attempt == PORT_ATTEMPTS or not port_taken(str(exc)):
                    raise
                logger.warning(
                    "the managed sglang server's port %s was taken before it bound it: starting it "
                    "again on another port (launch %d of %d)",
                    self.port,
                    attempt + 1,
                    PORT_ATTEMPTS,
                )
                if self.log_path is not None:  # the failed launch's log: its error is handled here, nothing names it
                    self.log_path.unlink(missing_ok=True)

    async def _launch(self) -> None:
        """One launch on a free port, waited for until it generates."""
        self.port, self.healthy = free_port(), False
        self._write_key_file()
        command = self.command(self.port, await asyncio.to_thread(cuda_available))
        fd, name = tempfile.mkstemp(prefix="daskgen-sglang-server-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "wb") as log:  # Popen on the calling (event loop) thread: see _die_with_parent
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=server_env(),
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        logger.info("started sglang server pid %d on %s (log %s)", self.process.pid, self.url, self.log_path)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        finally:
            self._remove_key_file()  # read at launch; a healthy server no longer needs it
        self.healthy = True

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as client:
            while True:
                if not self.alive:
                    raise EngineError(f"the managed sglang server {self.exit_description()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health_generate")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"the managed sglang server did not become healthy within "
                        f"{self.start_timeout_s:.0f} s (server_start_timeout_s); "
                        f"last lines of its log ({self.log_path}):\n{self.log_tail()}"
                    )
                await asyncio.sleep(tunables.seconds("http.server-poll-interval"))

    def exit_description(self) -> str:
        """``"(pid N) exited with code C; last lines of its log ...: ..."`` for error messages."""
        code = None if self.process is None else self.process.poll()
        pid = None if self.process is None else self.process.pid
        return f"(pid {pid}) exited with code {code}; last lines of its log ({self.log_path}):\n{self.log_tail()}"

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with self.log_path.open("rb") as stream:
            stream.seek(max(0, self.log_path.stat().st_size - 64 * 1024))
            text = stream.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:]).replace(self.api_key, "***")  # sglang logs its server_args

    async def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL); idempotent.

        The log of a server that failed (never became healthy, or exited by itself) is kept, since
        error messages point to it; otherwise it is removed first, so a worker killed while
        waiting leaves none behind.
        """
        self._remove_key_file()
        failed = self.process is not None and (not self.healthy or self.process.poll() is not None)
        if not failed and self.process is not None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        process, self.process = self.process, None
        if process is not None:
            # unlinked first (its processes keep what they hold open until they exit): a worker killed while it
            # waits for the group leaves none behind
            remove_files(await asyncio.to_thread(_loads_files, process.pid), f"the sglang server pid {process.pid}")
            await asyncio.to_thread(_stop_group, process)
            logger.info("stopped sglang server pid %d", process.pid)
            self.process = process  # keep the exit code for messages


async def update_server_weights(http: HTTPClient, path: str) -> None:
    """Load the checkpoint in the folder ``path`` into the server behind ``http`` (SGLang's
    ``POST /update_weights_from_disk``, once, with ``flush_cache``).

    SGLang holds the load until the requests it runs have finished and holds new ones until it is done, then drops
    its prefix cache (KV computed by the old weights); when requests still ran it loads but keeps the cache, and
    the cache is dropped once they have finished (:mod:`daskgen.engines.sglang.weights`).  A load that fails
    answers HTTP 400 ``{"success": false, "message": ...}`` and the server rolls back to the weights it had.

    Raises
    ------
    RefreshError
        The server refused the checkpoint (it keeps its weights).
    EngineError
        The server did not answer (down, or nothing for ``timeout_s``).
    """
    try:
        answer = await http.post_json("/update_weights_from_disk", {"model_path": path, "flush_cache": True}, False)
    except NoAnswer as exc:
        raise EngineError(f"the managed sglang server did not answer its weight update: {exc}") from None
    except RequestFailed as exc:
        if not loaded_but_not_flushed(str(exc)):
            raise RefreshError(f"the managed sglang server could not load policy checkpoint {path!r}: {exc}") from None
        await flush_when_idle(functools.partial(_flush_cache, http), path, "the managed sglang server")
        return
    if not (isinstance(answer, dict) and answer.get("success") is True):
        raise RefreshError(f"the managed sglang server did not confirm loading {path!r}: {answer!r}")


async def _flush_cache(http: HTTPClient, timeout_s: float) -> bool:
    """``GET /flush_cache?timeout=...``: SGLang waits up to ``timeout_s`` for running requests; HTTP 400 (false)
    when they still run."""
    status, _ = await http.probe_json(f"/flush_cache?timeout={timeout_s:g}", allow_status=(400,))
    return status == 200


def new_api_key() -> str:
    """A random API key for one managed server (256 bits; a letter prefix keeps YAML and argparse from
    reading it as a number or an option)."""
    return "daskgen-" + secrets.token_hex(32)


def server_env() -> dict[str, str]:
    """The server's environment: ours, plus ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` unless set.

    That makes sglang return logprobs of the untempered distribution, as daskgen's contract says.
    """
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **os.environ}


def _die_with_parent() -> None:
    """In the server (before exec): get SIGKILL when the thread that started it ends (Linux).

    So a worker that dies without shutting its engine down leaves no server behind (sglang's own
    scheduler processes follow their parent the same way).  The server is therefore started from
    the engine's event loop thread, which lives as long as the worker.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _loads_files(pid: int) -> set[Path]:
    """The load-report files in the shared-memory folder that the server ``pid`` and its descendants hold open
    (removed once they are gone: sglang does not remove them when killed)."""
    import psutil

    pids = [pid]
    with contextlib.suppress(psutil.Error):
        pids.extend(child.pid for child in psutil.Process(pid).children(recursive=True))
    return held_files(pids, SHARED_MEMORY, SGLANG_LOADS)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group of ``process``, SIGKILL what is left after a grace period, and
    wait (up to the grace period) until no process of the group remains."""
    grace = tunables.seconds("http.server-stop-grace")  # to exit on SIGTERM, then to be gone after SIGKILL
    _signal_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    _signal_group(process.pid, signal.SIGKILL)  # children may outlive the leader
    process.wait()
    deadline = time.monotonic() + 2 * grace
    while _signal_group(process.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left on some systems
        return True
    return True
