"""TLS of the clusters daskgen builds or joins (daskgen/deploy/security.py, docs/hpc.md "Security").

Real clusters: a LocalCluster with a per-run certificate refuses clients without it (Dask clients
over plain TCP or with another certificate, and a raw TLS socket that presents no certificate);
job scripts carry the certificate files; ``daskgen run --scheduler-address tls://...`` joins an
existing TLS scheduler with ``--tls-ca/--tls-cert/--tls-key``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import ssl
import stat
from pathlib import Path

import dask
import pytest
from distributed import Client
from distributed.security import Security

from daskgen import store
from daskgen.deploy import make_cluster, render_job_script
from daskgen.deploy.security import TLSFiles, client_security, cluster_tls, temporary_security, tls_directory
from daskgen.errors import ConfigError
from tests.conftest import run_cli, wait_for_jobs, write_prompts
from tests.test_run import sim_args

SLURM = {"kind": "slurm", "memory": "4GB", "cores": 2, "walltime": "00:30:00"}


@pytest.fixture(autouse=True)
def restore_dask_config_and_environ():
    """Clusters started in this process change dask config and os.environ (Dask's pre-spawn variables such
    as MALLOC_TRIM_THRESHOLD_, which later worker processes of other tests would inherit): put both back."""
    import dask_jobqueue  # noqa: F401 - its config defaults load on first import: take them into the snapshot

    saved, environ = copy.deepcopy(dask.config.config), dict(os.environ)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)
    os.environ.clear()
    os.environ.update(environ)


def worker_command(script: str) -> list[str]:
    (cmd,) = [line for line in script.splitlines() if "distributed.cli.dask_worker" in line]
    return cmd.split()


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def raw_tls_handshake(address: str, ca_file: Path, cert: tuple[Path, Path] | None) -> str:
    """Complete a TLS 1.2 handshake with the scheduler, with or without a client certificate.

    TLS 1.2 checks the client certificate inside the handshake, so the handshake itself decides:
    ``"refused"`` when the server aborts it with an alert (it demands a certificate), ``"accepted"``
    when it completes.  The socket timeout only guards against a hang; it decides nothing.
    """
    context = ssl.create_default_context(cafile=str(ca_file))
    context.check_hostname = False  # Dask's temporary certificate names "dask-internal", not the host
    context.maximum_version = ssl.TLSVersion.TLSv1_2  # Dask accepts 1.2 (distributed.comm.tls.min-version)
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    with socket.create_connection(host_port(address), timeout=60) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                assert tls.version() == "TLSv1.2"
        except ssl.SSLError as exc:
            assert "ALERT" in str(exc.reason).upper(), exc  # the server's alert, not a local setup error
            return "refused"
        except ConnectionResetError:
            return "refused"
    return "accepted"


# --------------------------------------------------------------------------- a real TLS LocalCluster


@pytest.mark.timeout(120)
def test_tls_cluster_refuses_clients_without_its_certificate(tmp_path):
    cluster, info = make_cluster(
        {"kind": "local", "n_workers": 1, "threads_per_worker": 1, "tls": True, "dashboard_address": ":0"}
    )
    try:
        address = cluster.scheduler_address
        assert address.startswith("tls://") and "TLS" in str(info)
        with Client(cluster, timeout="20s") as client:  # the cluster's own certificate: accepted
            assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3
            assert all(w.startswith("tls://") for w in client.scheduler_info()["workers"])
        with pytest.raises(OSError):  # plain TCP to the TLS port (Dask's comm errors are OSErrors)
            Client(address.replace("tls://", "tcp://"), timeout="5s", set_as_default=False)
        with pytest.raises(OSError, match="TLS certificate does not match"):  # a certificate of another run
            Client(address, security=Security.temporary(), timeout="5s", set_as_default=False)
        with pytest.raises(TypeError, match="ssl_context"):  # no certificate configured: Dask will not even try
            Client(address, timeout="5s", set_as_default=False)
        # Server side: a TLS client presenting no certificate is cut off; presenting the run's is not.
        files = TLSFiles(cluster.security, tmp_path / "tls")
        ca, key = Path(files.security.tls_ca_file), Path(files.security.tls_client_key)
        assert raw_tls_handshake(address, ca, cert=None) == "refused"
        assert raw_tls_handshake(address, ca, cert=(ca, key)) == "accepted"
    finally:
        cluster.close()


@pytest.mark.timeout(240)
def test_run_joins_an_existing_tls_scheduler_with_cert_flags(tmp_path):
    """``daskgen run --scheduler-address tls://... --tls-ca/--tls-cert/--tls-key`` on a real TLS cluster."""
    from distributed import LocalCluster

    files = TLSFiles(temporary_security(), tmp_path / "tls")
    flags = [
        "--tls-ca",
        files.security.tls_ca_file,
        "--tls-cert",
        files.security.tls_client_cert,
        "--tls-key",
        files.security.tls_client_key,
    ]
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    common = ["--prompts", prompts, "--partition-size", "4", "--no-progress"]
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0", security=files.security
        ) as lc,
    ):
        address = lc.scheduler_address
        assert address.startswith("tls://")
        refused = run_cli(
            "run", *sim_args(tmp_path, tmp_path / "refused.zarr", *common, "--scheduler-address", address), timeout=120
        )
        assert refused.returncode == 2 and "--tls-ca" in refused.stderr, refused.stderr
        res = run_cli(
            "run",
            *sim_args(tmp_path, tmp_path / "out.zarr", *common, "--scheduler-address", address, *flags),
            timeout=180,
        )
        assert res.returncode == 0, res.stdout + res.stderr
    assert (store.GenerationStore.open(tmp_path / "out.zarr").read_status() == store.DONE).all()


# --------------------------------------------------------------------------- certificate files and job scripts


def test_tls_files_are_private_and_removed(tmp_path):
    files = TLSFiles(temporary_security(), tmp_path / "base")
    sec = files.security
    assert sec.tls_ca_file == sec.tls_worker_cert == sec.tls_scheduler_cert == sec.tls_client_cert
    assert sec.tls_worker_key == sec.tls_scheduler_key == sec.tls_client_key
    assert sorted(p.name for p in files.directory.iterdir()) == ["cert.pem", "key.pem"]
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    for path in files.directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Path(sec.tls_worker_key).read_text().startswith("-----BEGIN PRIVATE KEY-----")
    files.remove()
    assert not files.directory.exists()
    files.remove()  # idempotent


def test_rendered_job_script_names_the_tls_files(tmp_path):
    files = TLSFiles(temporary_security(), tmp_path / "tls")
    cmd = worker_command(render_job_script(SLURM, "tls://10.1.2.3:8786", security=files.security))
    assert arg(cmd, "--protocol") == "tls://"
    assert arg(cmd, "--tls-ca-file") == files.security.tls_ca_file
    assert arg(cmd, "--tls-cert") == files.security.tls_worker_cert
    assert arg(cmd, "--tls-key") == files.security.tls_worker_key
    # The default: Dask's distributed.comm.tls.* configuration.
    with dask.config.set(
        {
            "distributed.comm.tls.ca-file": "/etc/dask/ca.pem",
            "distributed.comm.tls.worker.cert": "/etc/dask/worker.pem",
            "distributed.comm.tls.worker.key": "/etc/dask/worker.key",
        }
    ):
        cmd = worker_command(render_job_script(SLURM, "tls://10.1.2.3:8786"))
    assert (arg(cmd, "--tls-ca-file"), arg(cmd, "--tls-cert"), arg(cmd, "--tls-key")) == (
        "/etc/dask/ca.pem",
        "/etc/dask/worker.pem",
        "/etc/dask/worker.key",
    )
    plain = worker_command(render_job_script(SLURM, "tcp://10.1.2.3:8786"))
    assert not any(flag.startswith("--tls") for flag in plain) and "--protocol" not in plain


def test_rendered_job_script_refuses_tls_without_files():
    with pytest.raises(ConfigError, match=r"distributed\.comm\.tls\.worker"):
        render_job_script(SLURM, "tls://10.1.2.3:8786")
    with pytest.raises(ConfigError, match="paths"):  # PEM text cannot go on a command line
        render_job_script(SLURM, "tls://10.1.2.3:8786", security=Security.temporary())


def test_tls_directory_default_and_overrides(tmp_path):
    assert tls_directory("slurm") == Path("~/.daskgen/tls").expanduser()
    with dask.config.set({"jobqueue.slurm.shared-temp-directory": str(tmp_path / "jq")}):
        assert tls_directory("slurm") == tmp_path / "jq"
        assert tls_directory("slurm", str(tmp_path / "mine")) == tmp_path / "mine"
    with pytest.raises(ConfigError, match="spaces"):
        tls_directory("slurm", str(tmp_path / "with space"))


def test_tls_defaults_per_kind():
    assert cluster_tls("slurm") and cluster_tls("pbs") and not cluster_tls("local")
    assert not cluster_tls("slurm", False) and cluster_tls("local", True)
    with pytest.raises(ConfigError, match="true or false"):
        make_cluster({"kind": "local", "tls": "yes"})


# --------------------------------------------------------------------------- clients of existing schedulers


def test_client_security_from_flags_and_config(tmp_path):
    files = TLSFiles(temporary_security(), tmp_path / "tls")
    ca, cert, key = files.security.tls_ca_file, files.security.tls_client_cert, files.security.tls_client_key
    sec = client_security("tls://h:8786", ca, cert, key)
    assert (sec.tls_ca_file, sec.tls_client_cert, sec.tls_client_key, sec.require_encryption) == (ca, cert, key, True)
    with dask.config.set(
        {
            "distributed.comm.tls.ca-file": ca,
            "distributed.comm.tls.client.cert": cert,
            "distributed.comm.tls.client.key": key,
        }
    ):
        assert client_security("tls://h:8786").tls_client_cert == cert
    assert client_security("tcp://127.0.0.1:8786") is None


@pytest.mark.parametrize(
    ("address", "files", "match"),
    [
        ("tls://h:8786", {}, "--tls-ca"),
        ("tcp://h:8786", {"ca": "CA"}, "tls://HOST:PORT"),
        ("h:8786", {"cert": "CERT"}, "tls://HOST:PORT"),
        ("tls://h:8786", {"ca": "/nonexistent/ca.pem", "cert": "CERT"}, "is not a file"),
    ],
)
def test_client_security_errors(tmp_path, address, files, match):
    real = TLSFiles(temporary_security(), tmp_path / "tls").security.tls_client_cert
    paths = {k: (real if v in ("CA", "CERT") else v) for k, v in files.items()}
    with pytest.raises(ConfigError, match=match):
        client_security(address, **paths)


def test_plain_tcp_to_a_remote_scheduler_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="daskgen.deploy.security"):
        client_security("tcp://127.0.0.1:8786")
        assert "without TLS" not in caplog.text
        client_security("tcp://login01:8786")
    assert "without TLS" in caplog.text


# --------------------------------------------------------------------------- the command line


@pytest.mark.timeout(180)
@pytest.mark.parametrize("insecure", [False, True])
def test_cli_cluster_tls_and_insecure(tmp_path, fake_batch, insecure):
    """``daskgen run --cluster slurm [--insecure]`` against a fake sbatch: the submitted job script has the
    TLS files (or none, with the warning).  No worker ever joins, so the run stops at the engine timeout."""
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    config = tmp_path / "run.yaml"
    config.write_text(f"cluster: {{memory: 4GB, cores: 1, tls_directory: {tmp_path / 'tls'}}}\n")
    res = run_cli(
        "run",
        *sim_args(
            tmp_path,
            tmp_path / "out.zarr",
            "--prompts",
            prompts,
            "--config",
            config,
            "--cluster",
            "slurm",
            "--no-progress",
            *(["--insecure"] if insecure else []),
        ),
        env={"DASK_DASKGEN__ENGINE_START_TIMEOUT": "3s"},
        timeout=150,
    )
    assert res.returncode == 2 and "no engine became ready" in res.stderr, res.stderr
    (script,) = wait_for_jobs(fake_batch, 1)
    cmd = worker_command(script)
    if insecure:
        assert "anyone who can reach its scheduler port" in res.stderr
        assert cmd[4].startswith("tcp://") and not any(f.startswith("--tls") for f in cmd)
    else:
        assert cmd[4].startswith("tls://") and arg(cmd, "--tls-key").startswith(str(tmp_path / "tls"))
        assert list((tmp_path / "tls").iterdir()) == []  # removed when the run ended


def test_cli_tls_flags_need_a_scheduler_address(tmp_path):
    res = run_cli("run", "--prompts", tmp_path / "p.jsonl", "--tls-ca", tmp_path / "ca.pem", timeout=60)
    assert res.returncode == 2 and "give scheduler_address tls://HOST:PORT" in res.stderr, res.stderr
