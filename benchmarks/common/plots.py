"""Plots of the long-tail benchmark: response lengths and engine batch occupancy over time."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from .runs import SideResult


def utilisation_series(side: SideResult, a: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """(model seconds, running requests summed over engines / (workers × max_batch)) on a common grid."""
    if not side.samples:
        return np.array([]), np.array([])
    end = side.t0_wall + side.wall_s
    grid = np.arange(side.t0_wall, end, a.sample_period)
    total = np.zeros_like(grid)
    for samples in side.samples.values():
        if not samples:
            continue
        t = np.array([s[0] for s in samples])
        running = np.array([s[1] for s in samples], dtype=float)
        idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 1)
        total += np.where(grid >= t[0], running[idx], 0.0)
    return (grid - side.t0_wall) / a.time_scale, total / (a.workers * a.max_batch)


def plot_longtail(
    path: Path, a: argparse.Namespace, lengths: np.ndarray, sides: list[SideResult], ideal: float
) -> None:
    """Response-length histogram and engine utilisation over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8.5), gridspec_kw={"height_ratios": [1, 1.4]})
    bins = np.logspace(0, math.log10(a.max_new_tokens) + 0.02, 60)
    ax1.hist(lengths, bins=bins, color="tab:gray")
    ax1.axvline(a.max_new_tokens, color="tab:red", ls="--", label=f"cap max_new_tokens={a.max_new_tokens}")
    ax1.axvline(lengths.mean(), color="tab:blue", ls=":", label=f"mean {lengths.mean():.0f}")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("response length (tokens)")
    ax1.set_ylabel("samples")
    ax1.set_title(
        f"{len(lengths):,} simulated responses: lognormal(mean {a.length_mean:g}, sigma {a.length_sigma:g}), capped"
    )
    ax1.legend(fontsize=8)
    colors = iter(["tab:orange", "tab:green", "tab:purple", "tab:brown"])
    for side in sides:
        t, u = utilisation_series(side, a)
        if len(t):
            ax2.plot(
                t, u, lw=0.8, color=next(colors), label=f"{side.name}: makespan {side.makespan_model_s:,.0f} model-s"
            )
    ax2.axvline(ideal, color="black", ls="--", lw=1, label=f"ideal bound {ideal:,.0f} model-s")
    ax2.set_xlabel("model seconds since engines ready")
    ax2.set_ylabel("running requests / (workers × max_batch)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title(f"engine batch occupancy, {a.workers} workers × max_batch {a.max_batch}")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
