"""A real RL loop: a trainer process (tests/rl_trainer.py: a torch optimizer step per batch, a new policy version
published every two batches) follows a ``daskgen run`` of the tiny model, which loads every version in place,
with either ``refresh`` policy.  The trainer is SIGKILLed and restarted; the run is stopped with SIGTERM while a
refresh waits for a held request, and rerun.  Afterwards: every prompt was delivered and acknowledged exactly
once (``daskgen verify`` passes), every delivered sample was at most ``MAX_STALENESS`` versions behind the newest
at its delivery, and every sample (greedy) equals, token for token, the greedy answers of the checkpoints of its
recorded versions, loaded in this process.  With ``continue`` the requests the trainer holds stop part-way
(``PAUSE_AFTER`` tokens) and the trainer publishes its first version while one waits so: the refresh aborts
it, and it goes on from its tokens on the new weights (its ``version_changed_at`` is where). With ``drain`` only
a request the stop cut part-way goes on from its tokens, on the weights the rerun loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from daskgen import store
from daskgen.client.interrupt import EXIT_INTERRUPTED
from daskgen.engines.base import SamplingParams
from daskgen.store.policy import read_versions, read_worker_policies
from daskgen.testing.probes import in_flight_after, read_events, row_of
from tests.conftest import REPO, cli_env, popen_cli, run_cli, write_prompts
from tests.probing import wait_for_arrival
from tests.test_follow_processes import events, wait_until
from tests.test_policy_refresh import GreedyReference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N_PROMPTS = 16
NEW_TOKENS = 6
#: The row whose request the trainer never releases: a refresh waits for it (drain), the run is stopped then.
HELD = 13
#: The bound the trainer's pacing gives (tests/rl_trainer.py: at most 4 rows released past the highest delivered,
#: a version every 2 batches of 2 prompts, the run one version behind while it refreshes).
MAX_STALENESS = 2
#: The run's grace after SIGTERM: the held request never ends, so the stop always lasts this long; what the run
#: could not commit within it stays pending for the rerun.
GRACE_S = 6
#: With ``continue``: the tokens a request held by the trainer gets before it waits (an abort ends it there).
PAUSE_AFTER = 2


def start_trainer(out: Path, base: Path, tmp_path: Path, refresh: str) -> subprocess.Popen:
    args = [str(out), str(base), str(tmp_path / "ckpts"), str(tmp_path / "gates"), str(tmp_path / "trainer.log")]
    paused = {"TRAINER_PAUSED": str(tmp_path / "events.log")} if refresh == "continue" else {}
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "rl_trainer.py"), *args],
        env={**cli_env(), "TRAINER_CLOSED": str(HELD), **paused},
        start_new_session=True,
    )


def run_args(prompts: Path, out: Path, base: Path, tmp_path: Path, refresh: str) -> list:
    return [
        *("run", "--prompts", prompts, "--store", out, "--model", base, "--refresh", refresh),
        *("--engine", "daskgen.testing.probes:ProbeEngine", "--engine-arg", "inner=transformers"),
        *("--engine-arg", f"events_path={tmp_path / 'events.log'}"),
        *("--engine-arg", f"gate_path={tmp_path / 'gates' / '{row}'}"),
        *("--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--max-prompt-tokens", "128"),
        *("--partition-size", "1", "--window", "2", "--n-workers", "1", "--no-progress"),
        *("--grace", f"{GRACE_S}s"),
        *(pause_args() if refresh == "continue" else ()),
    ]


def pause_args() -> list[str]:
    """Requests held by the trainer stop part-way (every row's but the held one, which keeps a refresh waiting)."""
    rows = [r for r in range(N_PROMPTS) if r != HELD]
    return ["--engine-arg", f"pause_after={PAUSE_AFTER}", "--engine-arg", f"pause_rows={rows}"]


POLL = {"DASK_DASKGEN__POLICY__POLL_INTERVAL": "0.1s"}


def refresh_waiting(out: Path) -> bool:
    """A worker that already refreshed in place is loading a newer version (waiting for the held row)."""
    return any(w.state == "loading" and w.version >= 1 for w in read_worker_policies(store.locate(out)))


def kill_left(*procs: subprocess.Popen | None) -> None:
    """SIGKILL the process group of every process still running (a failed test leaves none behind)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def loop_with_kills(tmp_path: Path, base: Path, refresh: str) -> tuple[Path, int, set[int]]:
    """The loop, with the trainer SIGKILLed once and the run SIGTERMed during a refresh; the store, the batches
    its cursor had acknowledged when the trainer was killed, and the rows in flight at the SIGTERM."""
    out, log = tmp_path / "out.zarr", tmp_path / "trainer.log"
    prompts = write_prompts(tmp_path / "p.jsonl", N_PROMPTS)
    command = run_args(prompts, out, base, tmp_path, refresh)
    run = popen_cli(*command, env=POLL)
    trainer = None
    try:
        wait_for_arrival(tmp_path / "events.log", run, 0, timeout=300)  # the store exists
        trainer = start_trainer(out, base, tmp_path, refresh)
        wait_until(lambda: any(e["event"] == "published" for e in events(log)), "a first version", timeout=300)
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        acked_at_kill = dict(store.GenerationStore.open(out).cursors())["trainer"].batches
        trainer = start_trainer(out, base, tmp_path, refresh)
        wait_until(lambda: refresh_waiting(out), "a refresh waiting for the held row", timeout=300)
        # the rows whose requests the stop may cut part-way (a superset: none can arrive while the refresh loads)
        flying = in_flight_after(read_events(tmp_path / "events.log")).values()
        stopped_rows = {row_of(request_id) for ids in flying for request_id in ids}
        os.kill(run.pid, signal.SIGTERM)
        output, _ = run.communicate(timeout=300)
        assert run.returncode == EXIT_INTERRUPTED, output
        assert trainer.wait(timeout=300) == 0
        assert events(log)[-1]["pending"] > 0
        (tmp_path / "gates" / str(HELD)).touch()
        before = len(read_events(tmp_path / "events.log"))
        run = popen_cli(*command, env=POLL)
        wait_until(
            lambda: len(read_events(tmp_path / "events.log")) > before, "the rerun writing the store", timeout=300
        )
        trainer = start_trainer(out, base, tmp_path, refresh)
        assert trainer.wait(timeout=600) == 0
        output, _ = run.communicate(timeout=300)
        assert run.returncode == 0, output
    finally:
        kill_left(run, trainer)
    assert events(log)[-1] == {**events(log)[-1], "event": "end", "pending": 0}
    return out, acked_at_kill, stopped_rows


def check_exactly_once(out: Path, log: Path, acked_at_kill: int) -> None:
    """Every prompt's sample was acknowledged exactly once and nothing acknowledged came again.

    A batch is acknowledged when the trainer logged it so, or (killed between acknowledging and logging) when
    the cursor counted it at the kill: batches are numbered in order, the cursor counts those acknowledged."""
    acked: Counter = Counter()
    delivered: dict[int, list] = {}
    for e in events(log):
        if e["event"] == "delivered":
            again = {tuple(s[:2]) for s in e["samples"]} & set(acked)
            assert not again, f"acknowledged samples delivered again in batch {e['number']}: {again}"
            delivered[e["number"]] = e["samples"]
        elif e["event"] == "acked":
            acked.update(tuple(s[:2]) for s in delivered.pop(e["number"]))
        elif e["event"] == "start":  # a restarted trainer: what its predecessor acknowledged unlogged
            for number in [n for n in delivered if n < acked_at_kill]:
                acked.update(tuple(s[:2]) for s in delivered.pop(number))
    assert sorted(acked) == sorted((f"q{i}", 0) for i in range(N_PROMPTS)) and max(acked.values()) == 1
    check = run_cli("verify", out, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def check_staleness(log: Path) -> list[int]:
    """Every delivered sample's first-token version is within ``MAX_STALENESS`` of the newest at delivery."""
    stale = [e["newest"] - s[2] for e in events(log) if e["event"] == "delivered" for s in e["samples"]]
    assert stale and min(stale) >= 0 and max(stale) <= MAX_STALENESS, stale
    return stale


def check_versions_exact(out: Path, base: Path, refresh: str, stopped_rows: set[int]) -> set[int]:
    """Each sample equals the greedy answer of its recorded version's checkpoint, a continued one the old
    version's up to ``version_changed_at`` and the new one's from there on; the versions generated on.

    With ``drain`` a refresh never cuts a request: only a request the stop cut part-way (its row in
    ``stopped_rows``) may go on from its tokens on newer weights after the rerun."""
    made = store.GenerationStore.open(out)
    got = made.read_region(0, N_PROMPTS, made.layout.data_arrays())
    paths = {0: str(base)} | {v.version: v.path for v in read_versions(store.locate(out))}
    first, last, changed = (got[k][:, 0] for k in ("policy_version", "policy_version_end", "version_changed_at"))
    length = got["response_length"][:, 0]
    used = sorted(set(first.tolist()))
    assert len(used) >= 3, f"the run generated on versions {used} only"
    continued = np.flatnonzero(changed >= 0)
    np.testing.assert_array_equal(last[changed < 0], first[changed < 0])
    assert (changed[continued] > 0).all() and (changed[continued] < length[continued]).all(), changed
    assert (first[continued] < last[continued]).all(), (first, last)
    if refresh == "drain":
        assert set(continued.tolist()) <= stopped_rows, (continued, stopped_rows)
    else:
        assert continued.size, "no request was carried across a refresh"
    prompts = [got["prompt_ids"][r, : got["prompt_length"][r]].tolist() for r in range(N_PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    with GreedyReference() as reference:
        answers = {v: reference.answers(paths[v], prompts, params) for v in used}
        for r in range(N_PROMPTS):
            response, k = got["response_ids"][r, 0, : length[r]].tolist(), int(changed[r])
            expected = answers[first[r]][r]
            if k > 0:
                rest = SamplingParams(max_new_tokens=NEW_TOKENS - k, temperature=0.0)
                expected = expected[:k] + reference.answers(paths[last[r]], [prompts[r] + expected[:k]], rest)[0]
            assert response == expected, (r, first[r], last[r], k)
    assert len({json.dumps(a) for a in answers.values()}) == len(used), "the probe tells every version apart"
    return set(used)


@pytest.mark.parametrize("refresh", ["drain", "continue"])
def test_a_trainer_and_a_refreshing_run_form_a_loop_that_survives_kills(tiny_model, tmp_path, refresh):
    out, acked_at_kill, stopped_rows = loop_with_kills(tmp_path, tiny_model, refresh)
    log = tmp_path / "trainer.log"
    check_exactly_once(out, log, acked_at_kill)
    stale = check_staleness(log)
    used = check_versions_exact(out, tiny_model, refresh, stopped_rows)
    print(f"{refresh}: staleness at delivery: {Counter(stale)}; versions generated on: {sorted(used)}")
    assert sum(e["event"] == "start" for e in events(log)) == 3
