"""Where a process finds its cluster: a file, the host flags, ``TF_CONFIG``, or the
environment of a Kubernetes JobSet pod, in that order; then the hosts override.

It reads the cluster description (:mod:`.spec`) and a pod's identity (:mod:`.kube`); neither of
those imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .kube import apply_host_aliases, cluster_from_jobset
from .spec import ClusterSpec, ClusterSpecError, TaskId, parse_tf_config


def resolve_cluster(
    *,
    cluster_file: str | None = None,
    ps_hosts: str | None = None,
    worker_hosts: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec, TaskId | None]:
    """Cluster from (first match): ``cluster_file``, then the flags, then ``TF_CONFIG``, then
    a Kubernetes JobSet pod's environment (:func:`distsgd.cluster.kube.cluster_from_jobset`).

    ``environ`` defaults to ``os.environ``; flags count as given when not None/blank. Returns
    the task named by TF_CONFIG's ``"task"`` (or the JobSet pod's) when that was the source,
    else None. ``DISTSGD_HOST_ALIASES`` (a hosts override) then maps any source's addresses.
    """
    env = os.environ if environ is None else environ
    spec, task = _resolve_source(cluster_file, ps_hosts, worker_hosts, env)
    return apply_host_aliases(spec, env), task


def _resolve_source(
    cluster_file: str | None,
    ps_hosts: str | None,
    worker_hosts: str | None,
    env: Mapping[str, str],
) -> tuple[ClusterSpec, TaskId | None]:
    if cluster_file:
        return ClusterSpec.from_file(cluster_file), None
    if (ps_hosts and ps_hosts.strip()) or (worker_hosts and worker_hosts.strip()):
        return ClusterSpec.from_flags(ps_hosts=ps_hosts, worker_hosts=worker_hosts), None
    tf_config = env.get("TF_CONFIG", "")
    if tf_config.strip():
        return parse_tf_config(tf_config)
    pod = cluster_from_jobset(env)
    if pod is not None:
        return pod
    raise ClusterSpecError(
        "cluster: no cluster given; pass --cluster FILE, --ps-hosts/--worker-hosts, "
        "set TF_CONFIG, or run in a JobSet pod (JOBSET_NAME)"
    )
