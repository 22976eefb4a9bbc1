"""The engine lanes' schedule in CI (.ci/lanes.sh, sourced by .ci/run), run with stand-in lanes: the SGLang lane and
the vLLM lane's two parts start at once, every part runs to the end, and a failed part is named."""

from __future__ import annotations

import stat
import subprocess

from tests.conftest import REPO

#: A stand-in lane: its part's "SECONDS STATUS" is in the environment variable named by the lane and part; it logs
#: when it starts and ends.
LANE = """#!/usr/bin/env bash
part=$(basename "$0")${DASKGEN_VLLM_PART:+-$DASKGEN_VLLM_PART}
var=${part//-/_}
read -r seconds status <<< "${!var}"
echo "start $part" >> "$EVENTS"; sleep "$seconds"; echo "end $part" >> "$EVENTS"
exit "$status"
"""


def run_lanes(tmp_path, **parts: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The schedule with stand-ins; ``parts``: "SECONDS STATUS" of ``sglang_lane``, ``vllm_lane_engines`` and
    ``vllm_lane_late``.  Returns the shell's output and the events in the order they happened."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "logs").mkdir()
    for name in ("sglang-lane", "vllm-lane"):
        path = tmp_path / ".ci" / name
        path.write_text(LANE)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    script = (
        f"set -euo pipefail; declare -A lane_pid=(); start=$(date +%s); . {REPO / '.ci' / 'lanes.sh'}; "
        'run_engine_lanes; echo "failed: ${lanes_failed[*]}"'
    )
    env = {"PATH": "/usr/bin:/bin", "DASKGEN_CI_CACHE": str(tmp_path), "EVENTS": str(tmp_path / "events"), **parts}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return done, (tmp_path / "events").read_text().splitlines()


def test_the_three_parts_start_at_once_and_a_failed_part_is_named(tmp_path) -> None:
    done, events = run_lanes(
        tmp_path, sglang_lane="1 0", vllm_lane_engines="2 0", vllm_lane_late="0.2 3"
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    starts = {"start sglang-lane", "start vllm-lane-engines", "start vllm-lane-late"}
    assert set(events[:3]) == starts, events  # none waits for another to end
    assert len(events) == 6 and "failed: vllm-late (exit 3)" in done.stdout, (events, done.stdout)
    assert "[vllm-late] " not in done.stdout.split("::: vllm-late ended")[0]  # its log shown at its end


def test_every_part_runs_to_the_end_when_the_vllm_engines_part_ends_first(tmp_path) -> None:
    done, events = run_lanes(
        tmp_path, sglang_lane="3 0", vllm_lane_engines="0.2 1", vllm_lane_late="0.2 0"
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert events[-1] == "end sglang-lane" and len(events) == 6, events
    assert "failed: vllm-lane (exit 1)" in done.stdout, done.stdout


def test_parts_that_end_at_once_are_still_waited_for_and_named(tmp_path) -> None:
    """A part that fails as it starts (a broken virtualenv, a wrong setting) has ended before it is waited for."""
    done, events = run_lanes(tmp_path, sglang_lane="0 2", vllm_lane_engines="0 0", vllm_lane_late="0 4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(events) == 6, events
    assert "sglang-lane (exit 2)" in done.stdout and "vllm-late (exit 4)" in done.stdout, done.stdout
