"""The Dask scheduler in a process of its own, started and stopped with the cluster.

``LocalCluster`` and dask-jobqueue run the scheduler inside the client process, so one core carries
both daskgen's client loop and every scheduler transition and message.  Measured with partitions
flowing at full speed (benchmarks/results/2026-11-23T1543-scaleout.md): 2.04-3.13 ms of
the client process's CPU per 64-prompt partition with scheduler and nannies inside it (LocalCluster),
1.02-1.85 ms on daskgen's SLURM cluster with the scheduler in a process of its own.

:class:`SchedulerProcess` is a :class:`distributed.deploy.spec.ProcessInterface`: a ``SpecCluster``
(dask-jobqueue's ``scheduler_cls``, or :class:`LocalClusterOwnScheduler`) starts it, connects to its
address and terminates it when the cluster closes.  The process (:func:`main`, from the same Python)
runs a :class:`distributed.Scheduler` with

* the client's Dask configuration (daskgen's tunables, task durations for adaptive scaling, TLS
  settings) passed through ``DASK_INTERNAL_INHERIT_CONFIG``, as Dask's nannies pass it to workers;
* SIGINT and SIGTERM ignored, and a session of its own: a Ctrl-C, ``scancel`` or walltime signal is
  meant for the client, which then drains the workers and commits their partial responses *through*
  the scheduler before it exits; the client ends the scheduler (Dask's ``terminate`` call, SIGKILL if
  that fails), and the scheduler closes itself once the client process is gone;
* its log in a private temporary directory, quoted when it fails to start or exits unexpectedly;
* daskgen's page on its dashboard (:mod:`daskgen.dashboard`) from the start.

Used with ``cluster.scheduler_process`` (default ``true`` for SLURM/PBS, ``false`` for local).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import dask
from distributed import LocalCluster
from distributed.deploy.spec import ProcessInterface

from daskgen.deploy.security import RemoveTLSFilesOnClose, tls_files_for

logger = logging.getLogger(__name__)

#: Scheduler options that must be left at their defaults (they do not cross a process boundary).
_DEFAULT_ONLY = ("services", "service_kwargs", "blocked_handlers")
#: How long a closing scheduler gets to exit before it is killed.
STOP_GRACE_S = 10.0
#: How often the scheduler process checks that the client process is still there.
PARENT_CHECK_S = 1.0


class SchedulerProcess(ProcessInterface):
    """A ``distributed.Scheduler`` in a child process, with the options a ``SpecCluster`` gives its scheduler.

    Parameters
    ----------
    host, port, interface, protocol, dashboard_address:
        As for :class:`distributed.Scheduler`.
    dashboard:
        ``False`` starts no dashboard.
    security:
        A :class:`distributed.security.Security` naming **files** for the scheduler role, or ``None``.
        In-memory certificates cannot be handed to another process: use :class:`daskgen.deploy.security.TLSFiles`.
    **options:
        Other ``Scheduler`` options clusters pass; ``services``, ``service_kwargs`` and
        ``blocked_handlers`` must be empty, anything else is refused.

    Raises
    ------
    ValueError
        For options the scheduler process cannot take (objects that do not cross a process boundary).
    ConfigError
        For certificates held in memory.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | str | None = 0,
        interface: str | None = None,
        protocol: str | None = None,
        dashboard_address: str | None = ":0",
        dashboard: bool = True,
        security: Any = None,
        **options: Any,
    ) -> None:
        unsupported = sorted(k for k, v in options.items() if not (k in _DEFAULT_ONLY and not v))
        if unsupported:
            raise ValueError(
                f"the scheduler process cannot take the option(s) {', '.join(unsupported)}; "
                "set cluster.scheduler_process: false to run the scheduler inside the client"
            )
        self.spec: dict[str, Any] = {
            "host": host,
            "port": int(port or 0),
            "interface": interface,
            "protocol": protocol,
            "dashboard": bool(dashboard and dashboard_address is not None),
            "dashboard_address": dashboard_address,
            "security": None if security is None else tls_files_for(security, "scheduler", "scheduler processes"),
            "parent": os.getpid(),
        }
        self.process: asyncio.subprocess.Process | None = None
        self.directory: Path | None = None
        super().__init__()

    @property
    def log_path(self) -> Path | None:
        """The scheduler's log file (while the process runs)."""
        return None if self.directory is None else self.directory / "scheduler.log"

    async def start(self) -> None:
        """Start the process and wait until it has written its address."""
        self.directory = Path(tempfile.mkdtemp(prefix="daskgen-scheduler-"))
        address_file = self.directory / "scheduler.json"
        env = {**os.environ, "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(dask.config.global_config)}
        with open(self.log_path, "wb") as log:  # type: ignore[arg-type]
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                __name__,
                json.dumps({**self.spec, "scheduler_file": str(address_file)}),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        self.address = await self._wait_for_address(address_file)
        logger.info("scheduler process %d at %s (log %s)", self.process.pid, self.address, self.log_path)
        await super().start()

    async def _wait_for_address(self, address_file: Path) -> str:
        from daskgen import tunables

        timeout = tunables.seconds("scheduler-start-timeout")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.returncode is not None:  # type: ignore[union-attr]
                break
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                return str(json.loads(address_file.read_text())["address"])
            await asyncio.sleep(0.05)
        returncode = self.process.returncode  # type: ignore[union-attr]
        tail = self.log_tail()
        if returncode is None:
            self.process.kill()  # type: ignore[union-attr]
        await self.close()
        why = (
            f"exited with code {returncode}"
            if returncode is not None
            else f"did not listen within {timeout:g} s (daskgen.scheduler-start-timeout)"
        )
        raise RuntimeError(
            f"the scheduler process {why}; its log ends with:\n{tail}\n"
            "Set cluster.scheduler_process: false to run the scheduler inside the client."
        )

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the scheduler's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return "(no log)"

    async def close(self) -> None:
        """End the process and remove its directory.

        A closing ``SpecCluster`` has asked the scheduler to terminate already; it gets
        :data:`STOP_GRACE_S` to exit, then it is killed (it ignores SIGTERM).
        """
        process, self.process = self.process, None
        if process is not None:
            try:
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            if process.returncode not in (0, -signal.SIGKILL) and self.address is not None:
                logger.warning(
                    "the scheduler process exited with code %s; its log ends with:\n%s",
                    process.returncode,
                    self.log_tail(),
                )
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        await super().close()


class LocalClusterOwnScheduler(RemoveTLSFilesOnClose, LocalCluster):
    """A ``LocalCluster`` whose scheduler is a :class:`SchedulerProcess` (workers unchanged); it deletes the
    run's certificate files (``tls_files``) when it closes."""

    async def _start(self) -> None:
        if self.scheduler is None:
            self.scheduler_spec = {"cls": SchedulerProcess, "options": dict(self.scheduler_spec["options"])}
        await super()._start()


def notes(cluster: Any) -> tuple[str, ...]:
    """For the cluster line of a run's log: where the scheduler runs, when not inside the client."""
    scheduler = getattr(cluster, "scheduler", None)
    if not isinstance(scheduler, SchedulerProcess) or scheduler.process is None:
        return ()
    return (f"scheduler in process {scheduler.process.pid} (log {scheduler.log_path})",)


# --------------------------------------------------------------------------- the scheduler process itself


def main(argv: list[str] | None = None) -> None:
    """Entry point of the scheduler process: ``python -m daskgen.deploy.scheduler_process SPEC``.

    ``SPEC`` is the JSON of :attr:`SchedulerProcess.spec` plus ``scheduler_file``.
    """
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    for sig in (signal.SIGINT, signal.SIGTERM):  # signals are for the client: it ends this process
        signal.signal(sig, signal.SIG_IGN)
    try:
        asyncio.run(_serve(spec))
    except Exception as exc:  # the traceback, then one line with the whole chain of causes
        traceback.print_exc()
        chain: list[BaseException] = []
        cause: BaseException | None = exc
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        where = ", ".join(f"{k}={spec.get(k)}" for k in ("host", "port", "interface", "protocol") if spec.get(k))
        causes = " <- ".join(f"{type(e).__name__}: {e}" for e in chain)
        sys.stderr.write(f"daskgen scheduler process ({where or 'defaults'}) failed: {causes}\n")
        raise SystemExit(1) from None


async def _serve(spec: dict[str, Any]) -> None:
    """Run the scheduler until it is terminated or the client process is gone."""
    from distributed import Scheduler
    from distributed.security import Security

    spec = dict(spec)
    parent, files = spec.pop("parent"), spec.pop("security")
    security = (
        None
        if files is None
        else Security(
            require_encryption=True,
            tls_ca_file=files["ca_file"],
            tls_scheduler_cert=files["cert"],
            tls_scheduler_key=files["key"],
        )
    )
    async with Scheduler(security=security, **spec) as scheduler:
        await _add_dashboard_page(scheduler)
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(scheduler.finished()), PARENT_CHECK_S)
                return
            except asyncio.TimeoutError:
                if os.getppid() != parent:
                    logger.warning("the client process %d is gone; closing the scheduler", parent)
                    await scheduler.close(reason="client process gone")
                    shutil.rmtree(Path(spec["scheduler_file"]).parent, ignore_errors=True)  # nobody else will
                    return


async def _add_dashboard_page(scheduler: Any) -> None:
    """Serve daskgen's dashboard page from the start (:mod:`daskgen.dashboard`); a run reuses the plugin."""
    from daskgen.dashboard import dask_setup

    try:
        await dask_setup(scheduler)
    except Exception:  # the page is a view: the scheduler serves the run without it
        logger.warning("daskgen's dashboard page could not be added", exc_info=True)


if __name__ == "__main__":
    main()
