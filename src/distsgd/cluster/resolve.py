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
    task = None
    if cluster_file:
        spec = ClusterSpec.from_file(cluster_file)
    elif (ps_hosts and ps_hosts.strip()) or (worker_hosts and worker_hosts.strip()):
        spec = ClusterSpec.from_flags(ps_hosts=ps_hosts, worker_hosts=worker_hosts)
    elif env.get("TF_CONFIG", "").strip():
        spec, task = parse_tf_config(env["TF_CONFIG"])
    elif (pod := cluster_from_jobset(env)) is not None:
        spec, task = pod
    else:
        raise ClusterSpecError(
            "cluster: no cluster given; pass --cluster FILE, --ps-hosts/--worker-hosts, "
            "set TF_CONFIG, or run in a JobSet pod (JOBSET_NAME)"
        )
    return apply_host_aliases(spec, env), task
