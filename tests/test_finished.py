"""``FinishedPartitions``: finished partitions with their results, housekeeping while waiting."""

from __future__ import annotations

import time

import dask
import pytest

from daskgen.client.finished import FinishedPartitions


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as lc,
        Client(lc) as c,
    ):
        yield c


def _boom() -> None:
    raise ValueError("poison")


@pytest.mark.timeout(60)
def test_results_and_failures_come_back_with_their_futures(client):
    ticks = []
    done = FinishedPartitions(client, on_wait=lambda: ticks.append(1))
    futures = [
        client.submit(time.sleep, 0.3, pure=False),
        client.submit(_boom, pure=False),
        client.submit(sum, [1, 2], pure=False),
    ]
    for f in futures:
        done.add(f)
    got: dict = {}
    while len(got) < 3:
        got.update(done.wait(futures, 10))
    assert got[futures[2]] == 3 and got[futures[0]] is None
    typ, exc, _ = got[futures[1]]
    assert typ is ValueError and "poison" in str(exc) and futures[1].status == "error"
    assert ticks  # housekeeping ran while the slow task was running


@pytest.mark.timeout(60)
def test_nothing_ready_returns_empty_after_the_wait_and_checks_engines(client, monkeypatch):
    monkeypatch.setitem(dask.config.config["daskgen"], "engine-check-interval", 0.0)
    checks = []
    done = FinishedPartitions(client, check_engines=lambda: checks.append(1))
    slow = client.submit(time.sleep, 5, pure=False)
    done.add(slow)
    assert done.wait([slow], 0.3) == []
    assert not slow.done(), "wait() must have returned on its timeout, with the task still running"
    assert checks


@pytest.mark.timeout(60)
def test_a_finished_future_never_delivered_is_fetched_directly(client, monkeypatch):
    """As when as_completed's background fetch failed: the future is done but never queued."""
    monkeypatch.setitem(dask.config.config["daskgen"], "undelivered-after", 0.0)
    done = FinishedPartitions(client)
    lost = client.submit(sum, [2, 3], pure=False)  # not added: as_completed will never deliver it
    lost.result()
    assert done.wait([lost], 0.05) == []  # first seen finished now
    assert done.wait([lost], 0.05) == [(lost, 5)]


@pytest.mark.timeout(60)
def test_a_result_ends_the_wait_at_once_without_polling(client, monkeypatch):
    """The wait sleeps on as_completed's condition: a housekeeping period far longer than the task does
    not delay the result, and a wait with nothing finishing runs housekeeping once per period, not in a loop."""
    import daskgen.client.finished as completions

    monkeypatch.setattr(completions, "WAIT_S", 30.0)
    ticks = []
    done = FinishedPartitions(client, on_wait=lambda: ticks.append(1))
    fut = client.submit(time.sleep, 0.2, pure=False)
    done.add(fut)
    t0 = time.monotonic()
    assert done.wait([fut], 25) == [(fut, None)]
    assert time.monotonic() - t0 < 20, "the result must end the sleep, not the 30 s housekeeping period"
    monkeypatch.setattr(completions, "WAIT_S", 0.2)
    slow = client.submit(time.sleep, 5, pure=False)
    done.add(slow)
    ticks.clear()
    assert done.wait([slow], 1.0) == []
    assert 1 <= len(ticks) <= 10, f"housekeeping ran {len(ticks)} times in a 1 s wait (every 0.2 s expected)"


@pytest.mark.timeout(60)
def test_wake_and_a_window_announcement_end_the_wait(client, monkeypatch):
    """A worker announcing a larger window must not wait for the next housekeeping round: the board calls
    ``on_change`` (the runner's ``FinishedPartitions.wake``) from the client's event loop.  A wake while nobody
    waits ends the next wait at once."""
    import threading

    import daskgen.client.finished as completions
    from daskgen.client.windows import WindowBoard
    from daskgen.worker.admission import WINDOW_TOPIC

    monkeypatch.setattr(completions, "WAIT_S", 30.0)
    done = FinishedPartitions(client)
    board = WindowBoard(client, "daskgen-engine", on_change=done.wake)
    slow = client.submit(time.sleep, 20, pure=False)
    done.add(slow)
    timer = threading.Timer(0.3, client.log_event, (WINDOW_TOPIC, {"worker": "tcp://elsewhere:1", "window": 3}))
    timer.start()
    try:
        t0 = time.monotonic()
        assert done.wait([slow], 25) == []
        assert time.monotonic() - t0 < 15, "the announcement must end the wait, not the 30 s period"
        assert board.windows["tcp://elsewhere:1"] == 3
        done.wake()
        t0 = time.monotonic()
        assert done.wait([slow], 25) == [] and time.monotonic() - t0 < 15
    finally:
        timer.cancel()
        board.close()
        slow.cancel()


@pytest.mark.timeout(60)
def test_results_arrive_on_the_runs_client_whatever_client_is_the_processs_current_one(client):
    """``as_completed`` tracks futures on the loop of the process's current client unless told which: a closed
    client made current (as a failed or finished client can be left) would never deliver the run's results."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as lc:
        other = Client(lc, set_as_default=False)
        other.close()
    with other.as_current():
        done = FinishedPartitions(client)
        fut = client.submit(sum, [1, 2], pure=False)
        done.add(fut)
        got: list = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = done.wait([fut], 1.0)
    assert got == [(fut, 3)]
