"""A task's identity inside a Kubernetes JobSet, and a hosts override for any cluster.

``distsgd k8s render`` writes a JobSet (``jobset.x-k8s.io/v1alpha2``) with two replicated jobs,
``ps`` and ``worker``, each one Indexed Job (``replicas: 1``) of M or N pods, and
``network.enableDNSHostnames: true``. JobSet then gives every pod the stable name
``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>`` (the subdomain is the JobSet's
name unless ``network.subdomain`` says otherwise; JobSet creates that headless Service).

What a pod knows about itself, as environment variables:

* ``JOB_COMPLETION_INDEX``: its index in its Indexed Job; the Job controller sets it.
* ``JOBSET_NAME``, ``REPLICATED_JOB_NAME``, ``JOB_INDEX``: JobSet puts these values on every pod
  as the labels ``jobset.sigs.k8s.io/jobset-name``, ``jobset.sigs.k8s.io/replicatedjob-name`` and
  ``jobset.sigs.k8s.io/job-index``; the rendered manifests turn them into variables with the
  downward API (``valueFrom.fieldRef``).
* ``DISTSGD_K8S_PS``, ``DISTSGD_K8S_WORKERS``, ``DISTSGD_K8S_PORT`` (and optionally
  ``DISTSGD_K8S_SUBDOMAIN``): set by the manifests, the counts of the two jobs and the port
  every task listens on.

:func:`cluster_from_jobset` turns these into the cluster and this task, or None when the
process is not in a JobSet (``JOBSET_NAME`` unset), as :func:`~distsgd.cluster.parse_tf_config`
does for ``TF_CONFIG``. Every bad or missing value is a :class:`ClusterSpecError` of one line
naming the variable and the fix.

:data:`HOST_ALIASES_ENV` (``DISTSGD_HOST_ALIASES``) is a generic hosts override, for any
cluster source: a JSON object mapping a host name to the ``"host:port"`` to use instead, e.g.
``{"node1": "127.0.0.1:7000"}``. Every address of the cluster whose host is a key (and the
address a parameter server is told to listen on) is replaced. ``distsgd k8s local`` uses it to
run a JobSet's pods on this machine, each pod name mapped to a loopback port.

Standard library only (the cluster layer).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

from .spec import ClusterSpec, ClusterSpecError, Role, TaskId

__all__ = [
    "COMPLETION_INDEX_ENV",
    "HOST_ALIASES_ENV",
    "JOBSET_LABELS",
    "JOBSET_NAME_ENV",
    "JOB_INDEX_ENV",
    "PORT_ENV",
    "PS_COUNT_ENV",
    "REPLICATED_JOB_ENV",
    "SUBDOMAIN_ENV",
    "WORKER_COUNT_ENV",
    "alias_address",
    "apply_host_aliases",
    "cluster_from_jobset",
    "host_aliases",
    "pod_hostname",
]

JOBSET_NAME_ENV = "JOBSET_NAME"
REPLICATED_JOB_ENV = "REPLICATED_JOB_NAME"
JOB_INDEX_ENV = "JOB_INDEX"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
"""Set in every pod of an Indexed Job by the Job controller."""
PS_COUNT_ENV = "DISTSGD_K8S_PS"
WORKER_COUNT_ENV = "DISTSGD_K8S_WORKERS"
PORT_ENV = "DISTSGD_K8S_PORT"
SUBDOMAIN_ENV = "DISTSGD_K8S_SUBDOMAIN"
"""Optional: the JobSet's ``network.subdomain``; default the JobSet's name."""
HOST_ALIASES_ENV = "DISTSGD_HOST_ALIASES"

JOBSET_LABELS: dict[str, str] = {
    JOBSET_NAME_ENV: "jobset.sigs.k8s.io/jobset-name",
    REPLICATED_JOB_ENV: "jobset.sigs.k8s.io/replicatedjob-name",
    JOB_INDEX_ENV: "jobset.sigs.k8s.io/job-index",
}
"""The pod label JobSet sets for each identity variable (read through the downward API)."""

_FIX = "as distsgd k8s render writes it"
_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pod_hostname(jobset: str, replicated_job: str, pod_index: int, *, job_index: int = 0) -> str:
    """The pod's host name as JobSet names it: ``<jobset>-<replicated job>-<job>-<pod>``."""
    return f"{jobset}-{replicated_job}-{job_index}-{pod_index}"


def _count(env: Mapping[str, str], name: str, *, minimum: int, what: str) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        raise ClusterSpecError(f"{name} is not set; set it to the number of {what} ({_FIX})")
    try:
        value = int(text.strip())
    except ValueError:
        raise ClusterSpecError(f"{name}={text!r} is not an integer; set it to a count") from None
    if value < minimum:
        raise ClusterSpecError(f"{name}={value}: use {minimum} or more")
    return value


def cluster_from_jobset(
    environ: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec, TaskId] | None:
    """The cluster and this task from a JobSet pod's environment; None outside a JobSet.

    A pod of replicated job ``ps`` or ``worker`` with completion index ``i`` is task ``ps:i``
    or ``worker:i``; task ``job:i`` listens on ``<jobset>-<job>-0-<i>.<subdomain>:<port>``.
    """
    env = os.environ if environ is None else environ
    name = env.get(JOBSET_NAME_ENV, "").strip()
    if not name:
        given = [v for v in (PS_COUNT_ENV, WORKER_COUNT_ENV, PORT_ENV) if env.get(v)]
        if given:
            raise ClusterSpecError(
                f"{given[0]} is set but {JOBSET_NAME_ENV} is not; set {JOBSET_NAME_ENV} from the "
                f"pod label {JOBSET_LABELS[JOBSET_NAME_ENV]} ({_FIX})"
            )
        return None
    if not _LABEL_RE.match(name):
        raise ClusterSpecError(
            f"{JOBSET_NAME_ENV}={name!r} is not a JobSet name (lower-case letters, digits, '-')"
        )
    job = env.get(REPLICATED_JOB_ENV, "").strip()
    if job not in ("ps", "worker"):
        shown = f"={job!r}" if job else " is not set"
        raise ClusterSpecError(
            f"{REPLICATED_JOB_ENV}{shown}: distsgd's replicated jobs are ps and worker; set it "
            f"from the pod label {JOBSET_LABELS[REPLICATED_JOB_ENV]} ({_FIX})"
        )
    job_index = env.get(JOB_INDEX_ENV, "").strip()
    if job_index != "0":
        shown = f"={job_index!r}" if job_index else " is not set"
        raise ClusterSpecError(
            f"{JOB_INDEX_ENV}{shown}: distsgd runs each replicated job as one Indexed Job "
            f"(replicas: 1), so it must be 0; set it from the pod label "
            f"{JOBSET_LABELS[JOB_INDEX_ENV]} ({_FIX})"
        )
    num_ps = _count(env, PS_COUNT_ENV, minimum=0, what="parameter servers")
    num_workers = _count(env, WORKER_COUNT_ENV, minimum=1, what="workers")
    port_text = env.get(PORT_ENV, "").strip()
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        shown = f"={port_text!r}" if port_text else " is not set"
        raise ClusterSpecError(
            f"{PORT_ENV}{shown}: set it to the port every task listens on (1..65535)"
        )
    subdomain = env.get(SUBDOMAIN_ENV, "").strip() or name
    if not _LABEL_RE.match(subdomain):
        raise ClusterSpecError(
            f"{SUBDOMAIN_ENV}={subdomain!r} is not a DNS label; use the JobSet's "
            "network.subdomain, or unset it"
        )
    role = Role(job)
    count = num_ps if role == Role.PS else num_workers
    index_text = env.get(COMPLETION_INDEX_ENV, "").strip()
    try:
        index = int(index_text)
    except ValueError:
        shown = f"={index_text!r} is not an integer" if index_text else " is not set"
        raise ClusterSpecError(
            f"{COMPLETION_INDEX_ENV}{shown}; the {job} job must be an Indexed Job "
            "(completionMode: Indexed), whose controller sets it"
        ) from None
    if not 0 <= index < count:
        raise ClusterSpecError(
            f"{COMPLETION_INDEX_ENV}={index} out of range for job {job!r} ({count} tasks); "
            f"make {PS_COUNT_ENV if job == 'ps' else WORKER_COUNT_ENV} equal the job's completions"
        )

    def addresses(job_name: str, n: int) -> tuple[str, ...]:
        return tuple(f"{pod_hostname(name, job_name, i)}.{subdomain}:{port}" for i in range(n))

    spec = ClusterSpec(ps=addresses("ps", num_ps), worker=addresses("worker", num_workers))
    return spec, TaskId(job=role, index=index)


# --------------------------------------------------------------------------- hosts override


def host_aliases(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``DISTSGD_HOST_ALIASES`` map (host -> ``"host:port"``); empty when unset."""
    env = os.environ if environ is None else environ
    text = env.get(HOST_ALIASES_ENV, "")
    if not text.strip():
        return {}
    example = '{"node1": "127.0.0.1:7000"}'
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterSpecError(
            f"{HOST_ALIASES_ENV}: invalid JSON ({exc}); set it to an object like {example}"
        ) from None
    if not isinstance(data, dict):
        raise ClusterSpecError(
            f"{HOST_ALIASES_ENV}: expected a JSON object of host to address, got "
            f"{type(data).__name__}; e.g. {example}"
        )
    out: dict[str, str] = {}
    for host, target in data.items():
        if not isinstance(target, str) or not target.strip():
            raise ClusterSpecError(
                f'{HOST_ALIASES_ENV}[{host!r}]: expected a "host:port" string, got {target!r}'
            )
        try:  # validated as a cluster address would be
            ClusterSpec(worker=(target.strip(),))
        except ClusterSpecError as exc:
            raise ClusterSpecError(f"{HOST_ALIASES_ENV}[{host!r}]: {exc}") from None
        out[host.strip().strip("[]").lower()] = target.strip()
    return out


def alias_address(address: str, aliases: Mapping[str, str]) -> str:
    """``address`` ("host:port"), or its alias when its host is a key of ``aliases``."""
    host = address.rpartition(":")[0].strip("[]").lower()
    return aliases.get(host, address)


def apply_host_aliases(spec: ClusterSpec, environ: Mapping[str, str] | None = None) -> ClusterSpec:
    """``spec`` with every address whose host has an alias in ``DISTSGD_HOST_ALIASES`` replaced."""
    aliases = host_aliases(environ)
    if not aliases:
        return spec
    return ClusterSpec(
        ps=tuple(alias_address(a, aliases) for a in spec.ps),
        worker=tuple(alias_address(a, aliases) for a in spec.worker),
    )
