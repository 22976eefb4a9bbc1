"""The object-store retry paths, each forced to happen: a conditional PUT of the lock that landed but whose
answer was lost, writes whose answers come after the client's timeout, an endpoint that cannot be reached.

Real parts: moto's S3 server on loopback, the fault-injecting proxy in front of it (``tests/s3_proxy.py``,
a labelled test double that counts what it injected), real ``daskgen run`` processes.
"""

from __future__ import annotations

import json
import logging
import socket

import dask
import pytest

from daskgen.store.location import ObjectLocation
from daskgen.store.records.lock import LOCK_NAME, StoreLock
from tests.conftest import run_cli, write_prompts
from tests.s3_proxy import FaultProxy
from tests.test_object_store import _same, s3, s3_server  # noqa: F401 - the moto server and bucket fixtures
from tests.test_object_store_faults import FAST_RETRIES, _run

pytestmark = pytest.mark.timeout(300)

QUICK = {"daskgen.object-store.init-backoff": "10ms", "daskgen.object-store.max-backoff": "200ms"}


def test_a_lock_put_that_landed_but_lost_its_answer_is_recognised_as_ours(s3, s3_server, caplog):  # noqa: F811
    bucket, _ = s3
    with FaultProxy(s3_server) as proxy, dask.config.set(QUICK):
        where = ObjectLocation(f"s3://{bucket}/lost.zarr", {"endpoint": proxy.url})
        proxy.lose_answers = (LOCK_NAME, 1)  # the create-if-absent lands; its answer is lost
        with caplog.at_level(logging.WARNING):
            lock = StoreLock(where).acquire()
        assert proxy.injected["lost-answer"] == 1, proxy.injected
        assert "object-store write dropped" in caplog.text  # the retry really ran (and found its own lock)
        assert "ignores conditional writes" not in caplog.text
        held = json.loads(where.read_bytes(LOCK_NAME))
        assert (held["pid"], held["host"]) == (lock.owner["pid"], lock.owner["host"])
        proxy.lose_answers = (LOCK_NAME, 1)  # a heartbeat (replace-if-unchanged) that landed, answer lost
        lock.heartbeat(force=True)
        assert proxy.injected["lost-answer"] == 2
        lock.heartbeat(force=True)  # the version kept after the lost answer is the stored one
        assert json.loads(where.read_bytes(LOCK_NAME))["heartbeat"] > held["heartbeat"]
        lock.release()
        assert where.read_bytes(LOCK_NAME) is None


def test_writes_answered_after_the_timeout_are_retried_and_nothing_is_lost(tmp_path, s3, s3_server):  # noqa: F811
    bucket, _ = s3
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    clean = _run(prompts, f"s3://{bucket}/clean.zarr", s3_server)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    with FaultProxy(s3_server, share=0.05, seed=5, slow_s=1.5, methods=("PUT",)) as proxy:
        proxy.kinds, proxy.slow_after_forward = ("slow",), True  # stored, then answered after the timeout
        slow = _run(prompts, f"s3://{bucket}/slow.zarr", proxy.url, DASK_DASKGEN__OBJECT_STORE__TIMEOUT="1s")
    assert slow.returncode == 0, slow.stdout + slow.stderr
    assert proxy.injected["slow"] > 0, proxy.injected
    # each write answered after the timeout was sent again, the same bytes to the same path: by daskgen
    # ("object-store write dropped" in the log of the process that wrote) or by obstore itself, which retries
    # a timed-out request it counts as idempotent
    assert proxy.slowed and all(proxy.puts[key] >= 2 for key in proxy.slowed), (proxy.slowed, proxy.puts)
    _same(f"s3://{bucket}/clean.zarr", f"s3://{bucket}/slow.zarr")
    assert run_cli("verify", f"s3://{bucket}/slow.zarr", "--no-progress").returncode == 0


def test_an_unreachable_endpoint_is_a_clear_error_naming_it(tmp_path, s3):  # noqa: F811
    bucket, _ = s3
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    few = {"DASK_DASKGEN__OBJECT_STORE__MAX_RETRIES": "2", **FAST_RETRIES}
    res = _run(prompts, f"s3://{bucket}/out.zarr", endpoint, **few)
    assert res.returncode == 2, res.stdout + res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert error and f"{endpoint} could not be reached" in error[-1], res.stderr
    assert "check the endpoint" in error[-1] and "engines ready" not in res.stdout + res.stderr
