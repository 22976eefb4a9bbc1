"""Batch-job walltimes and the worker lifetimes that end a job's workers before its walltime.

A worker that reaches its job's walltime is killed with its in-flight work; a worker that retires
(``dask worker --lifetime``) first hands its work back, and adaptive scaling submits a replacement
job in time.  :func:`worker_lifetime` picks that lifetime and a random spread so that the jobs of
one cluster do not all retire at once.
"""

from __future__ import annotations

import re
from typing import Any

from dask.utils import parse_timedelta

from daskgen.errors import ConfigError

__all__ = ["describe_lifetime", "lifetime_plan", "parse_walltime", "worker_lifetime"]

_WALLTIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")
#: Spellings of ``cluster.lifetime`` that turn worker lifetimes off.
LIFETIME_OFF = ("off", "none", "false")


def parse_walltime(value: str, kind: str = "slurm") -> float:
    """Seconds in a batch-system walltime.

    SLURM accepts ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M`` and ``D-H:M:S``; PBS accepts
    ``[[H:]M:]S``.  A bare number is minutes for SLURM and seconds for PBS.

    Raises
    ------
    ConfigError
        When the text is not a walltime.
    """
    match = _WALLTIME.match(str(value).strip())
    if match is None or (match["d"] and kind != "slurm"):
        raise ConfigError(f"cannot read walltime {value!r} for {kind} (expected e.g. '04:00:00')")
    parts = [int(p) for p in match["rest"].split(":")]
    if match["d"] is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = parts + [0] * (3 - len(parts))
        return float(int(match["d"]) * 86400 + hours * 3600 + minutes * 60 + seconds)
    if len(parts) == 3:
        return float(parts[0] * 3600 + parts[1] * 60 + parts[2])
    if len(parts) == 2:
        return float(parts[0] * 60 + parts[1])
    return float(parts[0] * 60 if kind == "slurm" else parts[0])


def worker_lifetime(
    walltime_s: float, margin_s: float | None = None, stagger_s: float | None = None
) -> tuple[int, int]:
    """Longest worker lifetime and its random spread, so workers retire before the walltime.

    Each job retires after ``lifetime - U(0, stagger)``; with the defaults (margin 10% of the
    walltime clamped to 2-10 min, stagger 5% clamped to 1-10 min) a 1-hour job retires between
    51 and 54 minutes.

    Returns
    -------
    (lifetime_s, stagger_s)

    Raises
    ------
    ConfigError
        When the walltime leaves less than a minute of work after margin and stagger.
    """
    margin = _clamp(0.10 * walltime_s, 120, 600) if margin_s is None else margin_s
    stagger = _clamp(0.05 * walltime_s, 60, 600) if stagger_s is None else stagger_s
    lifetime = walltime_s - margin
    if lifetime - stagger < 60:
        raise ConfigError(
            f"walltime of {walltime_s:.0f}s is too short for a worker lifetime with a {margin:.0f}s "
            f"margin and {stagger:.0f}s stagger; raise the walltime, lower cluster.lifetime_margin/"
            "lifetime_stagger, or set cluster.lifetime: false"
        )
    return int(lifetime), int(stagger)


def lifetime_plan(
    lifetime: Any, walltime: str | None, kind: str, margin: Any = None, stagger: Any = None
) -> tuple[int, int] | None:
    """(lifetime_s, stagger_s) for a ``cluster.lifetime`` setting, or ``None`` when lifetimes are off.

    ``lifetime`` is ``"auto"`` (derived from ``walltime``; off without a walltime), a duration, or
    false; ``margin`` and ``stagger`` are durations or ``None`` for the defaults of :func:`worker_lifetime`.
    """
    if lifetime is False or str(lifetime).lower() in LIFETIME_OFF:
        return None
    margin_s, stagger_s = _seconds(margin), _seconds(stagger)
    if str(lifetime).lower() != "auto":
        return int(parse_timedelta(lifetime, default="s")), int(stagger_s or 0)
    if not walltime:
        return None
    return worker_lifetime(parse_walltime(str(walltime), kind), margin_s, stagger_s)


def describe_lifetime(plan: tuple[int, int] | None) -> str | None:
    """The cluster line's words for a lifetime plan."""
    if plan is None:
        return None
    return f"workers retire {plan[0] - plan[1]}-{plan[0]}s after start (before walltime)"


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def _seconds(value: Any) -> float | None:
    return None if value is None else float(parse_timedelta(value, default="s"))
