"""Start ``python -m daskgen`` processes forked from one that has already imported the CLI (the tests' launcher).

About half of a short ``daskgen run`` process's CPU is importing the command line, Dask, Zarr and the tokenizer code
(for a vision-language model also the image processor's, with torch); the suite starts several hundred of them. Each
pytest process therefore starts one *zygote* on first use: a Python process that imports those modules once and then
forks a child per command. The child is a real, separate process running the real CLI (``runpy``, as ``python -m``
does) with the test's standard streams, environment, working directory and session; the test gets a
:class:`subprocess.Popen` whose ``pid`` is the child's, so signals, ``killpg``, timeouts and ``communicate`` behave
as with any subprocess. The zygote reaps the child and sends its exit status back over the connection that started
it.  The benchmark scripts' tests start them the same way (``python SCRIPT``, run with ``runpy`` as ``python`` runs a
script): each is a ``daskgen`` run's client.

The zygote starts with the session's environment (:data:`BASE_ENV`).  Only environments that differ from it in
settings read at run time go through it (:data:`RUNTIME_ENV`: ``DASK_*``, which the child reloads into Dask's config,
``AWS_*``, ``SLURM_*``, ``TMPDIR``, pytest's ``PYTEST_*``, Dask's process-title marker, the pre-spawn variables a
nanny started in the test process exports into it, which tune the command's own threads and memory trimming, not
what it computes, the folder torch's compiler caches into, which torch writes into the environment of any process
that imports its compiler, and the variables verl, ray and tensordict set when imported); any other difference
starts a plain subprocess, so nothing the interpreter or a library reads at import time can be stale.
:data:`STARTS` counts both kinds of start and why a command was not forked; the lane check fails when most were not
(tests/conftest.py).  The README's commands, the examples and the guides still start fresh interpreters
(tests/test_readme.py, tests/test_examples.py).

A command's Dask workers come from the same imports: a worker of a local cluster is otherwise a fresh interpreter
(multiprocessing's *spawn*) that imports Dask, Zarr, daskgen's worker side and, for the transformers engine, torch and
transformers again -- most of the CPU of a short run on the tiny model.  Before it runs, the child
forks itself once more, still single-threaded, into multiprocessing's fork server, and sets Dask's
``distributed.worker.multiprocessing-method`` to ``forkserver`` for itself, so each worker its nannies start is forked
from that copy (:func:`start_worker_forkserver`).  The server is the command's child, in its session and process
group; it ignores SIGTERM (a worker's status reaches the nanny through it, so it must outlive a SIGTERM to the group)
while the workers it forks get SIGTERM's default back, and it exits when the command and all its workers have.  A
worker gets the command's environment of the moment it is started, as a spawned one inherits it, and everything its
nanny passes (environment, Dask config); it differs from a spawned one only in what it inherits, the modules imported
with the zygote's environment.  Of the variables those imports read, a test may
change only the workers' OpenMP thread count (torch's runtime reads it when loaded): a command whose workers get
another than the zygote's ``OMP_NUM_THREADS`` spawns them.  ``DASKGEN_TESTS_FORK_WORKERS=0`` spawns every worker.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: Environment variables whose value the child may set differently from the zygote's: read when used, not at import.
RUNTIME_ENV = re.compile(
    r"^(DASK_|AWS_|SLURM_|PYTEST_|__DASK_)|^TMPDIR$"
    # Dask's pre-spawn variables, which a nanny exports into the process that starts it: they tune the command's own
    # threads and memory trimming, not what it computes, and the workers it starts inherit them from the environment
    r"|^(MALLOC_TRIM_THRESHOLD_|OMP_NUM_THREADS|MKL_NUM_THREADS|OPENBLAS_NUM_THREADS)$"
    # torch's compiler cache folder: torch sets its default (under TMPDIR) in os.environ when its compiler is first
    # imported; a command compiles nothing in its own process, and the workers it starts read the request's value
    r"|^TORCHINDUCTOR_CACHE_DIR$"
    # a test's own settings for the engines it starts (an API key's variable), read when used
    r"|^DASKGEN_TEST_"
    # set by verl, ray and tensordict in a process that imports them (the DataProto tests): the zygote imports none of
    # them (NOT_PRELOADED), so a forked command reads them when it imports them, as a fresh interpreter does
    r"|^(RAY_ENABLE_UV_RUN_RUNTIME_ENV|RAY_CLIENT_MODE|LAZY_LEGACY_OP)$"
)
#: Variables an engine sets in ``os.environ`` of the process it runs in: sglang and vLLM when imported (daskgen's
#: engine modules too, before importing them), daskgen's engine plugin for the worker it starts in (its resolved local
#: rank and memory limit).  A test process that ran an engine or a worker in-process has them; the commands it starts
#: get the session's values of them instead (tests/conftest.py ``cli_env``), as from the shell that started the tests:
#: a command's workers set them for themselves.
ENGINE_SET_ENV = re.compile(
    r"^(SGLANG_|VLLM_|CUTE_DSL_|DG_JIT_|FLASHINFER_|NCCL_|TILELANG_|TLLM_|TRTLLM_|TRITON_|AITER_|TORCHINDUCTOR_)"
    r"|^(CUDA_CACHE_PATH|CUDA_DEVICE_MAX_CONNECTIONS|PYTORCH_NVML_BASED_CUDA_CHECK|LOCAL_WORLD_SIZE)$"
    r"|^(NUMEXPR_MAX_THREADS|TOKENIZERS_PARALLELISM|LD_PRELOAD|LD_LIBRARY_PATH)$"
    r"|^(DASKGEN_RESOLVED_LOCAL_RANK|DASKGEN_WORKER_MEMORY_LIMIT)$"
)
#: Packages whose variables RUNTIME_ENV lets differ: the zygote refuses to serve once its imports include one.
NOT_PRELOADED = ("verl", "ray", "tensordict")
#: This process's ``daskgen`` commands (and benchmark scripts): ``"forked"``, or the variables whose difference started
#: a fresh interpreter.
STARTS: collections.Counter[str] = collections.Counter()
#: The environment the zygote starts with: the session's (tests/conftest.py sets it before any test runs), so
#: that a test's own changes (a PATH with stand-in commands, a variable it sets) never become the zygote's.
BASE_ENV: dict[str, str] = {}
#: What the zygote imports before forking: the command line and what a run's client process imports.
PRELOAD = (
    "daskgen.cli",
    "daskgen.client.runner",
    "distributed.dashboard.scheduler",
    "zarr",
    "transformers.tokenization_utils_tokenizers",
    "jinja2",
    # the tokenizer and image processor classes a vision-language model's client loads (both import torch)
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.image_processing_auto",
)


class Zygote:
    """The pytest process's zygote: started on first use with ``env``, stopped when pytest exits."""

    _instance: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.path = Path(tempfile.mkdtemp(prefix="daskgen-zygote-")) / "sock"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.path)],
            stdin=subprocess.PIPE,  # the zygote ends when this pipe closes (pytest exited)
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # a test's killpg of its own process group never reaches it
        )
        atexit.register(shutil.rmtree, self.path.parent, ignore_errors=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if line.strip() != "ready":
            raise RuntimeError(f"the CLI zygote did not start: {line!r} (exit {self.proc.poll()})")

    @classmethod
    def get(cls, env: dict[str, str]) -> Zygote:
        """The running zygote, started with :data:`BASE_ENV` (``env`` when the session set none)."""
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls(BASE_ENV or env)
            return cls._instance

    def blocking(self, env: dict[str, str]) -> list[str]:
        """The variables of ``env`` that differ from the zygote's and may be read at import time: none when a child
        with ``env`` can be forked from this zygote (it differs only in run-time settings)."""
        keys = set(env) | set(self.env)
        return sorted(k for k in keys if env.get(k) != self.env.get(k) and not RUNTIME_ENV.match(k))


class ZygotePopen(subprocess.Popen):
    """A :class:`subprocess.Popen` of ``python -m daskgen ...`` whose child the zygote forks (see the module)."""

    def __init__(self, args: list[str], *, zygote: Zygote, **kwargs: Any) -> None:
        self._zygote = zygote
        self._status: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group=-1):  # fmt: skip
        request = {
            **_program(args),
            "env": dict(env if env is not None else os.environ),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": bool(start_new_session),
        }
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self._zygote.path))
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
            self.pid = int(_read_line(conn, None))
        except BaseException:
            conn.close()
            raise
        finally:  # the child's ends of the pipes, as Popen closes them after a fork
            devnull = getattr(self, "_devnull", None)
            for child_end, parent_end in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if child_end != -1 and parent_end != -1 and child_end != devnull:
                    os.close(child_end)
            if devnull is not None:
                os.close(devnull)
            self._closed_child_pipe_fds = True
        self._status = conn

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):  # noqa: N803
        if self.returncode is None and self._status is not None:
            self._read_status(0)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            self._read_status(timeout)
        return self.returncode

    def _read_status(self, timeout: float | None) -> None:
        """Take the exit status the zygote sends when the child ends; TimeoutExpired if not within ``timeout``."""
        assert self._status is not None
        try:
            line = _read_line(self._status, timeout)
        except (TimeoutError, BlockingIOError):
            if timeout == 0:
                return
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        self._status.close()
        self._status = None
        self.returncode = int(line)


def _read_line(conn: socket.socket, timeout: float | None) -> str:
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64, socket.MSG_PEEK)
        if not chunk:
            raise RuntimeError("the CLI zygote closed the connection without an exit status")
        take = chunk.index(b"\n") + 1 if b"\n" in chunk else len(chunk)
        data += conn.recv(take)
    return data.decode()


def _program(args: list[str]) -> dict[str, Any]:
    """What the child runs: ``{"module": "daskgen", "argv": [...]}`` for ``[python, -m, daskgen, ...]``,
    ``{"script": path, "argv": [...]}`` for ``[python, path, ...]``."""
    if args[1] == "-m":
        return {"module": args[2], "argv": list(args[3:])}
    return {"script": os.fspath(args[1]), "argv": list(args[2:])}


def popen(args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, env=env, ...)`` of ``[python, -m, daskgen, ...]`` or ``[python, script.py, ...]`` (a
    benchmark script), forked by the zygote if it can be."""
    if os.environ.get("DASKGEN_TESTS_FORK_CLI") == "0":  # every CLI in a fresh interpreter (to compare)
        return subprocess.Popen(args, env=env, **kwargs)
    zygote = Zygote.get(env)
    blocking = zygote.blocking(env)
    STARTS[", ".join(blocking) or "forked"] += 1
    if not blocking:
        return ZygotePopen(args, zygote=zygote, env=env, **kwargs)
    return subprocess.Popen(args, env=env, **kwargs)


# --- the zygote process -------------------------------------------------------------------------------------


def _child(request: dict[str, Any], fds: list[int], inherited: list[int]) -> None:
    """In the forked child: take the test's streams, environment, directory and session; run the CLI; exit.

    ``inherited``: the zygote's descriptors the child must not keep (its socket, its other children's)."""
    import runpy
    import signal

    for fd in inherited:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # TMPDIR may differ
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import dask

    dask.config.refresh()  # DASK_* settings of the request
    if worker_forkserver_fits(IMPORT_ENV):
        start_worker_forkserver()
    code: Any = 0
    try:
        if "script" in request:  # as ``python path``: the script's folder first on the path
            script = os.path.abspath(request["script"])
            sys.argv, sys.path[0] = [request["script"], *request["argv"]], os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        else:  # as ``python -m``: the working directory first
            sys.argv, sys.path[0] = [request["module"], *request["argv"]], request["cwd"]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def worker_forkserver_fits(import_env: dict[str, str]) -> bool:
    """Whether this command's workers may be forked from it: the switch is on and they would run torch's OpenMP with
    the thread count the zygote loaded it with (``daskgen.local-cpu-threads`` is their ``OMP_NUM_THREADS``)."""
    import dask

    if os.environ.get("DASKGEN_TESTS_FORK_WORKERS") == "0":
        return False
    return str(dask.config.get("daskgen.local-cpu-threads", None)) == import_env.get("OMP_NUM_THREADS")


def start_worker_forkserver() -> None:
    """Fork this single-threaded process into multiprocessing's fork server and make it the one this process's Dask
    nannies start workers from (see the module)."""
    import secrets
    import signal
    from multiprocessing import forkserver, spawn

    import dask

    assert threading.active_count() == 1, "the fork server must be forked from a single-threaded process"
    listener = socket.socket(socket.AF_UNIX)
    address = f"\0daskgen-forkserver-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file left in TMPDIR
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server exits when every holder of alive_w (this process, its workers) has
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(alive_w)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            forkserver._serve_one = functools.partial(_serve_worker, forkserver._serve_one)  # in this process only
            spawn.prepare = functools.partial(_prepare_worker, spawn.prepare)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    spawn.get_preparation_data = functools.partial(_with_environment, spawn.get_preparation_data)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})


def _serve_worker(serve_one: Any, child_r: int, fds: list[int], unused_fds: list[int], handlers: dict) -> int:
    """multiprocessing's ``forkserver._serve_one`` (``serve_one``) in a worker just forked, with SIGTERM's default
    restored (the server ignores it)."""
    import signal

    return serve_one(child_r, fds, unused_fds, {**handlers, signal.SIGTERM: signal.SIG_DFL})


def _with_environment(get_preparation_data: Any, name: str) -> dict[str, Any]:
    """multiprocessing's ``spawn.get_preparation_data`` (``get_preparation_data``) in the command, with its environment
    now: a spawned worker would inherit it, a forked one gets it from :func:`_prepare_worker`."""
    return {**get_preparation_data(name), ENVIRONMENT: dict(os.environ)}


def _prepare_worker(prepare: Any, data: dict[str, Any]) -> None:
    """multiprocessing's ``spawn.prepare`` (``prepare``) in a worker just forked: first the command's environment of
    the moment it started the worker (a run may set variables between two clusters, e.g. its object store's)."""
    environ = data.pop(ENVIRONMENT, None)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    prepare(data)


#: The key of the command's environment in the data a forked worker is prepared with.
ENVIRONMENT = "daskgen_tests_environment"
#: The zygote's environment when it imported :data:`PRELOAD` (set in the zygote process).
IMPORT_ENV: dict[str, str] = {}


def serve(path: str) -> None:
    """Import the CLI, then fork a child per connection and send back its pid, then its exit status."""
    import importlib

    sys.path[0] = os.getcwd()  # not this file's folder: the children run as ``python -m daskgen`` would
    IMPORT_ENV.update(os.environ)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    preloaded = [name for name in NOT_PRELOADED if name in sys.modules]
    if preloaded:  # their variables would be stale in a forked command
        raise SystemExit(f"the CLI zygote imported {preloaded}: take their variables out of RUNTIME_ENV")
    if threading.active_count() != 1:  # a fork would copy a process whose other threads may hold locks
        raise SystemExit(f"the CLI zygote has threads after its imports: {threading.enumerate()}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # pytest closed the pipe: it has exited
                return
            if key.data == "accept":
                _start_child(server, selector)
            else:
                pid, conn = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


def _start_child(server: socket.socket, selector: selectors.BaseSelector) -> None:
    conn, _ = server.accept()
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not msg.endswith(b"\n"):
        msg += conn.recv(1 << 16)
    request = json.loads(msg)
    children = [key for key in selector.get_map().values() if isinstance(key.data, tuple)]
    inherited = [server.fileno(), conn.fileno(), *(k.fd for k in children), *(k.data[1].fileno() for k in children)]
    sys.stdout.flush()
    sys.stderr.flush()
    started, signal_started = os.pipe()
    pid = os.fork()
    if pid == 0:
        selector.close()
        os.close(started)
        if request["new_session"]:
            os.setsid()
        os.close(signal_started)  # the session exists before the test learns the pid, as with Popen
        _child(request, fds, inherited)
    os.close(signal_started)
    os.read(started, 1)  # returns at the child's close
    os.close(started)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))


if __name__ == "__main__":
    serve(sys.argv[1])
