"""TLS for the Dask clusters daskgen starts or joins (``docs/hpc.md``, "Security").

A Dask scheduler runs whatever code a connected client sends, with the rights of the user who
started the workers.  On a shared HPC cluster anyone who can reach an unauthenticated scheduler
can therefore run code as you.  This module builds the :class:`distributed.security.Security`
objects that close that door:

* **Clusters daskgen builds on SLURM/PBS** use TLS by default with a per-run temporary
  certificate (:meth:`Security.temporary`: a fresh 2048-bit RSA key and self-signed certificate,
  in memory).  Scheduler, workers and client share it and every connection must present it
  (mutual TLS), so nobody without the key can connect.  Job scripts can only name files, so
  :class:`TLSFiles` writes it into a private per-run directory on a filesystem the compute nodes
  see (``cluster.tls_directory``); the directory is removed when the cluster closes.
* ``cluster.tls: false`` (``daskgen run --insecure``) turns that off, with a warning.
* A **local cluster** stays plain TCP on loopback unless ``cluster.tls: true``.
* An **existing scheduler** at ``tls://...`` is joined with the files given by ``--tls-ca``,
  ``--tls-cert``, ``--tls-key``, or those of Dask's ``distributed.comm.tls.*`` configuration.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask

from daskgen.errors import ConfigError

__all__ = [
    "DEFAULT_TLS_DIRECTORY",
    "RemoveTLSFilesOnClose",
    "TLSFiles",
    "client_security",
    "cluster_tls",
    "job_script_security",
    "temporary_security",
    "tls_directory",
    "warn_insecure",
]

logger = logging.getLogger(__name__)

#: Where per-run certificate directories go unless ``cluster.tls_directory`` or
#: ``jobqueue.<kind>.shared-temp-directory`` say otherwise (home is shared with compute nodes on
#: nearly every HPC site).
DEFAULT_TLS_DIRECTORY = "~/.daskgen/tls"
_TLS_DEFAULT = {"local": False, "slurm": True, "pbs": True}
_SAFE_PATH = re.compile(r"^[\w./@%+=:,-]+$")  # job scripts join worker arguments unquoted


def cluster_tls(kind: str, value: Any = None) -> bool:
    """Whether a cluster of ``kind`` uses TLS: ``value`` (``cluster.tls``) or the kind's default.

    SLURM and PBS clusters span nodes and default to TLS; a local cluster listens on loopback
    and defaults to plain TCP.

    Raises
    ------
    ConfigError
        When ``value`` is given and not a boolean.
    """
    if value is None:
        return _TLS_DEFAULT[kind]
    if not isinstance(value, bool):
        raise ConfigError(f"cluster.tls must be true or false, got {value!r}")
    return value


def warn_insecure(kind: str) -> None:
    """Log that a multi-node cluster runs without TLS and what that exposes."""
    logger.warning(
        "TLS is off for this %s cluster (cluster.tls: false / --insecure): anyone who can reach its scheduler "
        "port can connect and run code as you on every node, and data between the nodes is unencrypted. "
        "Drop --insecure to use a per-run certificate.",
        kind,
    )


def temporary_security() -> Any:
    """A fresh :class:`distributed.security.Security` with a self-signed key and certificate in memory.

    Raises
    ------
    ConfigError
        When the ``cryptography`` package (part of ``daskgen[hpc]``) is missing.
    """
    from distributed.security import Security

    try:
        return Security.temporary()
    except ImportError:
        raise ConfigError(
            "TLS with a per-run certificate needs the 'cryptography' package: "
            "pip install 'daskgen[hpc]' (or set cluster.tls: false / --insecure)"
        ) from None


def tls_directory(kind: str, given: str | None = None) -> Path:
    """The directory under which per-run certificate folders are created (it must be shared with the nodes).

    ``given`` (``cluster.tls_directory``) wins, then dask-jobqueue's
    ``jobqueue.<kind>.shared-temp-directory``, then :data:`DEFAULT_TLS_DIRECTORY`.
    """
    raw = given or dask.config.get(f"jobqueue.{kind}.shared-temp-directory", None) or DEFAULT_TLS_DIRECTORY
    path = Path(os.path.expandvars(os.path.expanduser(str(raw)))).absolute()
    if not _SAFE_PATH.match(str(path)):
        raise ConfigError(
            f"cluster.tls_directory {str(path)!r} contains spaces or shell characters, which the "
            "worker command line cannot carry; choose a plain path such as ~/.daskgen/tls"
        )
    return path


class TLSFiles:
    """A temporary certificate written to a private per-run directory, for clusters of batch jobs.

    Job scripts can only name files (``--tls-ca-file``, ``--tls-cert``, ``--tls-key``), so the
    in-memory PEM texts of :meth:`Security.temporary` are written to ``<base>/run-XXXXXXXX/``
    (directory mode 0700, ``cert.pem`` and ``key.pem`` mode 0600).  :attr:`security` is a copy
    of the security object naming those files, used by the scheduler, the workers and the
    client alike.  :meth:`remove` deletes the directory; it also runs when this object is
    garbage collected or the interpreter exits.

    Parameters
    ----------
    security:
        A :class:`distributed.security.Security` holding PEM texts (from :func:`temporary_security`).
    base:
        Parent directory, created (0700) if missing; must be visible from the compute nodes.

    Raises
    ------
    ConfigError
        When the directory cannot be created.
    """

    def __init__(self, security: Any, base: Path) -> None:
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="run-", dir=base))
        except OSError as exc:
            raise ConfigError(
                f"cannot create a certificate directory in {str(base)!r} ({exc}); set "
                "cluster.tls_directory to a writable directory the compute nodes can read"
            ) from None
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), ignore_errors=True)
        self.security = _copy_with_files(security, self.directory)

    def remove(self) -> None:
        """Delete the directory and its files (idempotent)."""
        self._finalizer()


_PEM_ATTRS = (
    "tls_ca_file",
    "tls_client_cert",
    "tls_client_key",
    "tls_scheduler_cert",
    "tls_scheduler_key",
    "tls_worker_cert",
    "tls_worker_key",
)


def _copy_with_files(security: Any, directory: Path) -> Any:
    """A copy of ``security`` whose PEM texts are files in ``directory`` (one file per distinct text)."""
    import copy

    copied = copy.copy(security)
    written: dict[str, str] = {}
    for attr in _PEM_ATTRS:
        text = getattr(security, attr, None)
        if not text or "\n" not in text:
            continue
        if text not in written:
            stem = "key" if "PRIVATE KEY" in text else "cert"
            count = sum(1 for path in written.values() if Path(path).name.startswith(stem))
            path = directory / (f"{stem}.pem" if count == 0 else f"{stem}-{count}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as stream:
                stream.write(text)
            written[text] = str(path)
        setattr(copied, attr, written[text])
    return copied


# --------------------------------------------------------------------------------------------
# clients of existing schedulers and job scripts for them


@dataclass(frozen=True)
class _TLSPaths:
    ca: str | None
    cert: str | None
    key: str | None

    def given(self) -> bool:
        return any((self.ca, self.cert, self.key))


def _scheme(address: str) -> str:
    return address.split("://", 1)[0].lower() if "://" in address else "tcp"


def _check_files(paths: Mapping[str, str | None]) -> None:
    for flag, path in paths.items():
        if path is not None and not Path(path).expanduser().is_file():
            raise ConfigError(f"{flag} {path!r} is not a file; give the path of a PEM file")


def client_security(address: str, ca: str | None = None, cert: str | None = None, key: str | None = None) -> Any:
    """The :class:`Security` for connecting to an existing scheduler at ``address``.

    Parameters
    ----------
    address:
        The scheduler address (``tls://host:port`` for TLS).
    ca, cert, key:
        ``--tls-ca``, ``--tls-cert``, ``--tls-key``: the CA that signed the scheduler's
        certificate, and this client's certificate and key (the key may be inside the
        certificate file).  Without them, Dask's ``distributed.comm.tls.ca-file`` /
        ``distributed.comm.tls.client.cert`` / ``.key`` configuration is used.

    Returns
    -------
    Security or None
        ``None`` for a plain ``tcp://`` address (Dask's configured defaults apply).

    Raises
    ------
    ConfigError
        TLS files with a non-TLS address, a TLS address without a CA and client certificate,
        or files that do not exist.
    """
    from distributed.security import Security

    paths = _TLSPaths(ca, cert, key)
    if _scheme(address) != "tls":
        if paths.given():
            raise ConfigError(
                f"--tls-ca/--tls-cert/--tls-key were given but the scheduler address {address!r} is "
                "not TLS; write it as tls://HOST:PORT"
            )
        _warn_plain(address)
        return None
    _check_files({"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key})
    if paths.given():
        security = Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key, require_encryption=True)
    else:
        security = Security(require_encryption=True)  # reads distributed.comm.tls.*
    # distributed's Security fills its __slots__ with setattr, so they are invisible to mypy.
    if not security.tls_ca_file or not security.tls_client_cert:  # type: ignore[attr-defined]
        raise ConfigError(
            f"the scheduler at {address} uses TLS: give --tls-ca (the CA that signed its certificate) "
            "and --tls-cert/--tls-key (this client's certificate and key), or set "
            "distributed.comm.tls.ca-file and distributed.comm.tls.client.cert/key in your dask config"
        )
    return security


def _warn_plain(address: str) -> None:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1") and not address.startswith("inproc://"):
        logger.warning(
            "connecting to the scheduler at %s without TLS: anyone who can reach it can run code on its "
            "workers; see docs/hpc.md (Security) for a tls:// scheduler",
            address,
        )


def job_script_security(address: str, security: Any = None) -> Any:
    """The security of worker jobs for a scheduler you started at ``address`` (for job scripts).

    ``security`` (with file paths) wins; for a ``tls://`` address the default is Dask's
    ``distributed.comm.tls.ca-file`` and ``distributed.comm.tls.worker.cert``/``.key``.

    Raises
    ------
    ConfigError
        A ``tls://`` address without worker certificate files, or in-memory certificates
        (a job script can only name files).
    """
    from distributed.security import Security

    if security is None:
        if _scheme(address) != "tls":
            return None
        security = Security(require_encryption=True)
    config = tls_files_for(security, "worker", "job scripts") or {}
    if not config.get("ca_file") or not config.get("cert"):
        raise ConfigError(
            f"the scheduler at {address} uses TLS: the worker jobs need the CA and a worker certificate "
            "and key; set distributed.comm.tls.ca-file and distributed.comm.tls.worker.cert/key in your "
            "dask config, or pass security=Security(tls_ca_file=..., tls_worker_cert=..., "
            "tls_worker_key=...)"
        )
    return security


def tls_files_for(security: Any, role: str, who: str) -> dict[str, str] | None:
    """The CA, certificate and key files of ``role`` (``ca_file``, ``cert``, ``key``) for another process.

    ``None`` when ``security`` holds none of them.  ``who`` names what needs files, for the error.

    Raises
    ------
    ConfigError
        When any of them is PEM text in memory: another process can only be given paths.
    """
    config = security.get_tls_config_for_role(role)
    files = {key: config.get(key) for key in ("ca_file", "cert", "key")}
    if not any(files.values()):
        return None
    if any(value and "\n" in value for value in files.values()):
        raise ConfigError(
            f"{who} name certificate files: give a Security whose tls_ca_file, tls_{role}_cert and "
            f"tls_{role}_key are paths (not PEM text), e.g. written by daskgen.deploy.security.TLSFiles"
        )
    return files


class RemoveTLSFilesOnClose:
    """Cluster mixin: delete the run's certificate directory (:class:`TLSFiles`) once the cluster has closed."""

    tls_files: TLSFiles | None = None

    async def _close(self) -> None:
        try:
            await super()._close()  # type: ignore[misc]
        finally:
            if self.tls_files is not None:
                self.tls_files.remove()
