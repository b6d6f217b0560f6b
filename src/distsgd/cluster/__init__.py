"""Cluster descriptions: the ``ps`` and ``worker`` tasks of a job and their addresses.

It sits just above ``distsgd.util`` and depends only on the standard library.
"""

from __future__ import annotations

from .kube import apply_host_aliases, cluster_from_jobset
from .resolve import resolve_cluster
from .spec import (
    JOBS,
    ClusterSpec,
    ClusterSpecError,
    Role,
    TaskId,
    parse_tf_config,
)

__all__ = [
    "JOBS",
    "ClusterSpec",
    "ClusterSpecError",
    "Role",
    "TaskId",
    "apply_host_aliases",
    "cluster_from_jobset",
    "parse_tf_config",
    "resolve_cluster",
]
