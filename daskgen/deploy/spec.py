"""The ``cluster:`` section: its keys (the deployment classes' signatures), validation and CLI overrides.

The keys of a kind are the keyword arguments of its deployment class (:data:`DEPLOYMENTS`), read by
:func:`daskgen.deploy.keys.class_keys`; :data:`CLUSTER_KEYS` merges them over all kinds.
:func:`parse_cluster_spec` turns the run config's flat mapping into a :class:`ClusterSpec` (unknown keys
and wrongly typed values raise :class:`~daskgen.errors.ConfigError` listing the valid ones), and
:func:`kind_values` hands the values of the spec's kind to that kind's class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from daskgen.deploy.deployment import Deployment
from daskgen.deploy.keys import ClusterKey, check_value, class_keys, markdown_table, same_queue
from daskgen.deploy.local import LocalDeployment
from daskgen.deploy.pbs import PBSDeployment
from daskgen.deploy.slurm import SLURMDeployment
from daskgen.errors import ConfigError

__all__ = [
    "CLUSTER_KEYS",
    "DEPLOYMENTS",
    "KINDS",
    "ClusterSpec",
    "apply_cli_overrides",
    "ignored_notes",
    "keys_table",
    "kind_values",
    "parse_cluster_spec",
]

#: The deployment class of each ``cluster.kind``.
DEPLOYMENTS: dict[str, type[Deployment]] = {cls.kind: cls for cls in (LocalDeployment, SLURMDeployment, PBSDeployment)}
KINDS = tuple(DEPLOYMENTS)


def _cluster_keys() -> dict[str, ClusterKey]:
    """Every keyword of every deployment class with the kinds taking it: ``kind`` and the keys of all kinds first."""
    keys = {
        "kind": ClusterKey("kind", str, "local", "`local`, `slurm` or `pbs`; `--cluster` overrides it.", kinds=KINDS)
    }
    for kind, cls in DEPLOYMENTS.items():
        for name, key in class_keys(cls).items():
            known = keys.setdefault(name, key)
            keys[name] = dataclasses.replace(known, kinds=(*known.kinds, kind))
    return dict(sorted(keys.items(), key=lambda item: item[0] != "kind" and item[1].kinds != KINDS))


#: Every accepted key of the ``cluster:`` section, with its type, default, help and the kinds that take it.
CLUSTER_KEYS: dict[str, ClusterKey] = _cluster_keys()


def keys_table() -> str:
    """The Markdown reference table of the ``cluster:`` keys, as ``docs/hpc.md`` shows it."""
    return markdown_table(CLUSTER_KEYS.values(), KINDS)


def valid_keys_text() -> str:
    """The valid keys, one a line with type, kinds and help, for error messages."""
    return "\n".join(f"  {k.name}: {k.help} [{k.type_name()}; {', '.join(k.kinds)}]" for k in CLUSTER_KEYS.values())


@dataclass(frozen=True)
class ClusterSpec:
    """A validated ``cluster:`` section.  ``None`` means "not given": defaults apply later."""

    kind: str = "local"
    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when the spec does not set it."""
        value = self.values.get(key)
        return default if value is None else value


def parse_cluster_spec(spec: Mapping[str, Any] | None) -> ClusterSpec:
    """Validate a ``cluster:`` section.

    Parameters
    ----------
    spec
        The mapping from the run config (``None`` or empty means a local cluster).

    Returns
    -------
    ClusterSpec
        The kind and the given values, type-checked.  Keys valid for another kind are kept (so
        ``--cluster local`` works with a SLURM config) and ignored when building.

    Raises
    ------
    ConfigError
        For an unknown key (the message lists the valid ones) or a wrongly typed value.
    """
    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(CLUSTER_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown key(s) in the cluster section: {', '.join(unknown)}; fix the spelling or remove them. "
            f"Valid keys:\n{valid_keys_text()}"
        )
    kind = str(spec.pop("kind", None) or "local").lower()
    if kind not in KINDS:
        raise ConfigError(f"cluster kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values = {key: check_value(CLUSTER_KEYS[key], value) for key, value in spec.items() if value is not None}
    same_queue(values.get("queue"), values.get("partition"))
    if "cpus_per_gpu" in values and "cores" in values:
        raise ConfigError("give either cluster.cpus_per_gpu or cluster.cores, not both")
    return ClusterSpec(kind, values)


def apply_cli_overrides(
    section: Mapping[str, Any] | None,
    *,
    kind: str | None = None,
    tls: bool | None = None,
    min_workers: int | None = None,
    max_workers: int | None = None,
    n_workers: int | None = None,
) -> dict[str, Any]:
    """Merge the run's flags (``--cluster``, ``--insecure`` as ``tls=False``, ``--min-workers``, ``--max-workers``,
    and ``--n-workers`` for a local cluster) over a config section: the one place they meet it."""
    merged = dict(section or {})
    given = {"kind": kind, "tls": tls, "min_workers": min_workers, "max_workers": max_workers}
    merged.update({key: value for key, value in given.items() if value is not None})
    if n_workers and str(merged.get("kind") or "local").lower() == "local":
        merged["n_workers"] = n_workers
    return merged


def kind_values(s: ClusterSpec) -> dict[str, Any]:
    """The spec's values for the keys of its kind: the keyword arguments of the kind's deployment class."""
    return {key: value for key, value in s.values.items() if s.kind in CLUSTER_KEYS[key].kinds}


def ignored_notes(s: ClusterSpec) -> tuple[str, ...]:
    """For the cluster line of a run's log: the given keys that do not apply to the spec's kind."""
    ignored = sorted(k for k in s.values if s.kind not in CLUSTER_KEYS[k].kinds)
    return (f"ignored for kind {s.kind}: {', '.join(ignored)}",) if ignored else ()
