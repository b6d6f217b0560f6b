"""``distsgd k8s local``: run the pods of a rendered JobSet as processes on this machine.

It reads ``jobset.yaml`` and ``secret.yaml`` as ``distsgd k8s render`` wrote them and plays
the part of Kubernetes for each pod (each replicated job, each of its Jobs, each completion
index): it runs the container's exact ``command`` and ``args`` with the environment the pod
would get, which is

* what the Job controller and JobSet set: ``HOSTNAME`` (``<jobset>-<job>-<job index>-<pod
  index>``), ``JOB_COMPLETION_INDEX``, and the pod's labels and annotations, read by the
  container's ``valueFrom.fieldRef`` entries;
* the container's ``env`` entries, with Kubernetes' ``$(VAR)`` expansion;
* mounts as local folders: a Secret volume as a private temporary folder of its keys (with the
  volume's ``defaultMode``), a PersistentVolumeClaim as one folder (``<local dir>/<claim>``)
  that every pod mounting it shares, an ``emptyDir`` (a pod's own storage) as a folder of that
  pod alone (``<local dir>/pods/<pod>/<volume>``) that outlives its container's restarts, the
  image's working folder (``/app``) as the rendered ``train/`` folder.

Two things stand in for the cluster network: every pod's host name (and its
``<host>.<subdomain>`` name) is mapped to 127.0.0.1 and a free port of its own through
``DISTSGD_HOST_ALIASES`` (``distsgd.cluster.kube``), and so is the wildcard ``0.0.0.0`` the
pod itself listens on. The program ``distsgd`` is this installation's (``python -m distsgd``),
and the processes are tied to this one (``DISTSGD_PARENT_PID``).

The order is the JobSet's: a replicated job that ``dependsOn`` another (or follows it under
``startupPolicy: InOrder``) starts when that one's pods pass their readiness probe (a TCP
connect to the pod's port). A pod that exits nonzero is restarted in place
(``restartPolicy: OnFailure``) until its Job has used its ``backoffLimit``; then the run fails
(the restart planner, :func:`distsgd.control.recovery.plan_restart`, decides, with each pod
restarted in place).
The run is complete when the ``successPolicy``'s jobs have completed; every other pod is then
stopped by its PID, as JobSet deletes the other Jobs. Ctrl-C and SIGTERM stop every pod. The
run folder, and the outcome read from it, is the control pod's (``distsgd server --job
control --run-dir``; a worker's ``--run-dir`` for manifests without a control job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from distsgd.cluster import Role, TaskId, kube
from distsgd.control.folder import METRICS_FILE, RESULT_FILE
from distsgd.control.outcome import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED
from distsgd.control.recovery import (
    NothingStored,
    RestartBudget,
    RestartPlan,
    RunTopology,
    Stop,
    TaskFailure,
    plan_restart,
)
from distsgd.launcher.errors import Interrupted, RunFailed
from distsgd.launcher.lifeline import PARENT_ENV
from distsgd.launcher.progress import Console, Progress
from distsgd.launcher.supervisor import Supervisor, TaskHandle
from distsgd.util import write_atomic
from distsgd.util.signals import setter
from distsgd_k8s.render import APP_DIR, JOBSET_FILE, SCRIPT_DIR, SECRET_FILE, _yaml

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
READY_TIMEOUT = 120.0
"""Seconds a pod may take to pass its readiness probe."""
PODS_DIR = "pods"
"""The folder (in the local folder) of each pod's own storage: ``pods/<pod>/<volume>``."""

_CLEARED_ENV = (
    "DISTSGD_TASK",
    "DISTSGD_SECRET",
    "DISTSGD_SECRET_FILE",
    "TF_CONFIG",
    kube.HOST_ALIASES_ENV,
    kube.JOBSET_NAME_ENV,
    kube.REPLICATED_JOB_ENV,
    kube.JOB_INDEX_ENV,
    kube.COMPLETION_INDEX_ENV,
    kube.PS_COUNT_ENV,
    kube.WORKER_COUNT_ENV,
    kube.PORT_ENV,
    kube.SUBDOMAIN_ENV,
)
"""Inherited variables a pod would not have (they would change who a task thinks it is)."""


# ------------------------------------------------------------------------------- the manifest


def _load_yaml(path: Path) -> list[Any]:
    yaml = _yaml()
    if not path.is_file():
        raise ValueError(f"{path} not found; give a folder written by distsgd k8s render")
    try:
        return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None


def _get(obj: Any, *keys: str | int, where: str, default: Any = ...) -> Any:
    """``obj[k1][k2]...``; a missing key is a one-line error naming its path (or ``default``)."""
    for key in keys:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            if default is not ...:
                return default
            path = ".".join(str(k) for k in keys)
            raise ValueError(f"{where}: no {path}; render the folder again") from None
    return obj


@dataclass
class Pod:
    """One pod of the JobSet, played by a local process."""

    name: str
    """Its host name, ``<jobset>-<job>-<job index>-<index>``."""
    job: str
    job_index: int
    index: int
    container: dict[str, Any]
    volumes: dict[str, dict[str, Any]]
    labels: dict[str, str]
    port: int = 0
    """The local port its container port maps to."""
    task: TaskHandle | None = None
    exit_code: int | None = None
    starts: int = 0

    @property
    def job_name(self) -> str:
        return f"{self.job}-{self.job_index}"


@dataclass
class ReplicatedJob:
    name: str
    pods: list[Pod]
    backoff_limit: int
    depends_on: list[tuple[str, str]] = field(default_factory=list)
    failures: dict[int, int] = field(default_factory=dict)
    """Failed pods per Job index (what ``backoffLimit`` counts)."""


def plan(jobset: Mapping[str, Any]) -> tuple[str, str, list[ReplicatedJob]]:
    """(JobSet name, subdomain, its replicated jobs with their pods) from the JobSet object."""
    where = JOBSET_FILE
    if jobset.get("kind") != "JobSet":
        raise ValueError(f"{where}: expected a JobSet, got kind {jobset.get('kind')!r}")
    name = str(_get(jobset, "metadata", "name", where=where))
    spec = _get(jobset, "spec", where=where)
    subdomain = str(_get(spec, "network", "subdomain", where=where, default="") or name)
    in_order = _get(spec, "startupPolicy", "startupPolicyOrder", where=where, default="")
    jobs: list[ReplicatedJob] = []
    for r, rjob in enumerate(_get(spec, "replicatedJobs", where=where)):
        rname = str(_get(rjob, "name", where=where))
        job_spec = _get(rjob, "template", "spec", where=where)
        pod_template = _get(job_spec, "template", where=where)
        containers = _get(pod_template, "spec", "containers", where=where)
        if len(containers) != 1:
            raise ValueError(f"{where}: {rname} has {len(containers)} containers; expected 1")
        volumes = {
            str(v["name"]): v
            for v in _get(pod_template, "spec", "volumes", where=where, default=[])
        }
        labels = dict(_get(pod_template, "metadata", "labels", where=where, default={}) or {})
        count = int(_get(job_spec, "completions", where=where))
        replicas = int(rjob.get("replicas", 1))
        pods = [
            Pod(
                name=kube.pod_hostname(name, rname, i, job_index=j),
                job=rname,
                job_index=j,
                index=i,
                container=containers[0],
                volumes=volumes,
                labels=labels,
            )
            for j in range(replicas)
            for i in range(count)
        ]
        depends = [(str(d["name"]), str(d["status"])) for d in rjob.get("dependsOn", []) or []]
        if in_order == "InOrder" and r > 0:
            depends.append((jobs[-1].name, "Ready"))
        jobs.append(
            ReplicatedJob(
                name=rname,
                pods=pods,
                backoff_limit=int(job_spec.get("backoffLimit", 6)),
                depends_on=depends,
            )
        )
    return name, subdomain, jobs


# ------------------------------------------------------------------------ environment, paths

_VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``command``, ``args`` and ``env`` values: ``$(VAR)`` becomes
    VAR's value when VAR is defined (else stays as it is), ``$$`` becomes ``$``."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_RE.sub(sub, text)


def _map_path(text: str, mounts: list[tuple[str, Path]]) -> str:
    """``text`` with a leading mount path replaced by its local folder."""
    for container_path, local in mounts:
        if text == container_path:
            return str(local)
        if text.startswith(container_path.rstrip("/") + "/"):
            return str(local / text[len(container_path.rstrip("/")) + 1 :])
    return text


def _field_ref(pod: Pod, path: str, namespace: str, annotations: Mapping[str, str]) -> str:
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        source = pod.labels if match.group(1) == "labels" else annotations
        return source.get(match.group(2), "")
    if path == "metadata.name":
        return f"{pod.job_name}-{pod.index}"
    if path == "metadata.namespace":
        return namespace
    raise ValueError(f"pod {pod.name}: k8s local cannot provide fieldRef {path!r}")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together while they are picked)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ----------------------------------------------------------------------------------- the run


class LocalCluster:
    """The pods of one JobSet on this machine."""

    def __init__(self, out_dir: Path, local_dir: Path, console: Console) -> None:
        self.out_dir = out_dir
        self.local_dir = local_dir
        self.console = console
        docs = _load_yaml(out_dir / JOBSET_FILE)
        jobsets = [d for d in docs if isinstance(d, dict) and d.get("kind") == "JobSet"]
        if len(jobsets) != 1:
            raise ValueError(f"{out_dir / JOBSET_FILE}: expected one JobSet, found {len(jobsets)}")
        self.jobset = jobsets[0]
        self.namespace = str(self.jobset.get("metadata", {}).get("namespace", "default"))
        self.name, self.subdomain, self.jobs = plan(self.jobset)
        self.secrets: dict[str, dict[str, str]] = {}
        for doc in _load_yaml(out_dir / SECRET_FILE):
            if isinstance(doc, dict) and doc.get("kind") == "Secret":
                name = str(_get(doc, "metadata", "name", where=SECRET_FILE))
                self.secrets[name] = {str(k): str(v) for k, v in doc.get("stringData", {}).items()}
        self.pods = [pod for job in self.jobs for pod in job.pods]
        for pod, port in zip(self.pods, _free_ports(len(self.pods)), strict=True):
            pod.port = port
        self.aliases: dict[str, str] = {}
        for pod in self.pods:
            self.aliases[pod.name] = f"127.0.0.1:{pod.port}"
            self.aliases[f"{pod.name}.{self.subdomain}"] = f"127.0.0.1:{pod.port}"
        self.private = Path(tempfile.mkdtemp(prefix="distsgd-k8s-local-"))
        """Secret volumes live here (0700), removed when the run ends."""
        self.supervisor = Supervisor(log_dir=local_dir / "logs", echo=console.line)
        self.stop = threading.Event()
        self.run_dir: Path | None = None

    # -- one pod --------------------------------------------------------------------------------
    def _mounts(self, pod: Pod) -> list[tuple[str, Path]]:
        mounts: list[tuple[str, Path]] = []
        for mount in pod.container.get("volumeMounts", []) or []:
            volume = pod.volumes.get(str(mount["name"]))
            if volume is None:
                raise ValueError(f"pod {pod.name}: volumeMount {mount['name']!r} has no volume")
            if "persistentVolumeClaim" in volume:
                local = self.local_dir / str(volume["persistentVolumeClaim"]["claimName"])
                local.mkdir(parents=True, exist_ok=True)
            elif "secret" in volume:
                local = self._secret_volume(pod, volume["secret"])
            elif "emptyDir" in volume:  # the pod's own: kept across its container's restarts
                local = self.pod_dir(pod) / str(mount["name"])
                local.mkdir(parents=True, exist_ok=True)
            else:
                raise ValueError(f"pod {pod.name}: k8s local cannot mount volume {mount['name']!r}")
            mounts.append((str(mount["mountPath"]), local))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def pod_dir(self, pod: Pod) -> Path:
        """The folder of ``pod``'s own storage (its ``emptyDir`` volumes)."""
        return self.local_dir / PODS_DIR / pod.name

    def _secret_volume(self, pod: Pod, source: Mapping[str, Any]) -> Path:
        name = str(source["secretName"])
        if name not in self.secrets:
            raise ValueError(f"pod {pod.name}: Secret {name!r} is not in {SECRET_FILE}")
        folder = self.private / f"secret-{name}"
        if not folder.is_dir():
            folder.mkdir(mode=0o700)
            mode = int(source.get("defaultMode", 0o644))
            for key, value in self.secrets[name].items():
                path = folder / key
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(value)
                os.chmod(path, mode)
        return folder

    def _environment(
        self, pod: Pod, mounts: list[tuple[str, Path]]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(the process environment, the container's own variables) of ``pod``."""
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
        annotations = {COMPLETION_INDEX_ANNOTATION: str(pod.index)}
        labels = {
            **pod.labels,
            kube.JOBSET_LABELS[kube.JOBSET_NAME_ENV]: self.name,
            kube.JOBSET_LABELS[kube.REPLICATED_JOB_ENV]: pod.job,
            kube.JOBSET_LABELS[kube.JOB_INDEX_ENV]: str(pod.job_index),
        }
        pod.labels = labels
        env["HOSTNAME"] = pod.name
        env[kube.COMPLETION_INDEX_ENV] = str(pod.index)  # the Job controller's own variable
        defined: dict[str, str] = {kube.COMPLETION_INDEX_ENV: str(pod.index)}
        for entry in pod.container.get("env", []) or []:
            name = str(entry["name"])
            if "value" in entry:
                value = expand(str(entry["value"]), defined)
            elif "valueFrom" in entry and "fieldRef" in entry["valueFrom"]:
                path = str(entry["valueFrom"]["fieldRef"]["fieldPath"])
                value = _field_ref(pod, path, self.namespace, annotations)
            elif "valueFrom" in entry and "secretKeyRef" in entry["valueFrom"]:
                ref = entry["valueFrom"]["secretKeyRef"]
                value = self.secrets.get(str(ref["name"]), {}).get(str(ref["key"]), "")
            else:
                raise ValueError(f"pod {pod.name}: k8s local cannot provide env {name}")
            defined[name] = value
        env.update({k: _map_path(v, mounts) for k, v in defined.items()})
        own = f"127.0.0.1:{pod.port}"
        env[kube.HOST_ALIASES_ENV] = json.dumps({**self.aliases, "0.0.0.0": own})
        env[PARENT_ENV] = str(os.getpid())
        return env, defined

    def _argv(
        self, pod: Pod, defined: Mapping[str, str], mounts: list[tuple[str, Path]]
    ) -> tuple[list[str], Path]:
        container = pod.container
        command = [str(c) for c in container.get("command", []) or []]
        args = [str(a) for a in container.get("args", []) or []]
        if not command or command[0] != "distsgd":
            raise ValueError(
                f"pod {pod.name}: k8s local runs distsgd containers only, got command {command}"
            )
        line = [_map_path(expand(a, defined), mounts) for a in command[1:] + args]
        working = str(container.get("workingDir", APP_DIR))
        cwd = self.out_dir / SCRIPT_DIR if working == APP_DIR else Path(_map_path(working, mounts))
        if "--run-dir" in line and line[:1] == ["server"]:  # the run control's: the run's
            self.run_dir = Path(line[line.index("--run-dir") + 1])
        elif "--run-dir" in line and pod.job == Role.WORKER and self.run_dir is None:
            self.run_dir = Path(line[line.index("--run-dir") + 1])  # no control job
        return [sys.executable, "-m", "distsgd", *line], cwd

    def start(self, pod: Pod) -> None:
        mounts = self._mounts(pod)
        env, defined = self._environment(pod, mounts)
        argv, cwd = self._argv(pod, defined, mounts)
        pod.exit_code = None
        pod.starts += 1
        pod.task = self.supervisor.start(pod.name, argv, env, cwd=cwd)
        self._write_tasks()

    def _write_tasks(self) -> None:
        pids = {p.name: p.task.pid for p in self.pods if p.task is not None}
        write_atomic(self.local_dir / "tasks.json", json.dumps(pids) + "\n")

    # -- the JobSet -----------------------------------------------------------------------------
    def _probe_port(self, pod: Pod) -> int | None:
        probe = pod.container.get("readinessProbe") or {}
        if "tcpSocket" not in probe:
            return None
        port = probe["tcpSocket"]["port"]
        ports = {p.get("containerPort") for p in pod.container.get("ports", []) or []}
        ports |= {p.get("name") for p in pod.container.get("ports", []) or []}
        if port not in ports:
            raise ValueError(f"pod {pod.name}: readiness probe port {port} is not a port of it")
        return pod.port

    def _ready(self, pod: Pod) -> bool:
        if pod.task is None or pod.task.poll() is not None:
            return False
        port = self._probe_port(pod)
        return port is None or _listening(port)

    def _job(self, name: str) -> ReplicatedJob:
        for job in self.jobs:
            if job.name == name:
                return job
        raise ValueError(f"{JOBSET_FILE}: dependsOn names no replicated job {name!r}")

    def _wait_for(self, job: ReplicatedJob, status: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            self._check()
            if status == "Ready" and all(self._ready(p) for p in job.pods):
                return
            if status == "Complete" and all(p.exit_code == 0 for p in job.pods):
                return
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"the pods of {job.name} were not {status} within {READY_TIMEOUT:.0f}s; "
                    f"see {self.local_dir / 'logs'}"
                )
            if self.stop.wait(0.1):
                raise Interrupted

    def _check(self) -> None:
        """Note exits; restart a failed pod in place while its Job has backoff left."""
        for job in self.jobs:
            for pod in job.pods:
                if pod.task is None or pod.exit_code is not None:
                    continue
                code = pod.task.poll()
                if code is None:
                    continue
                pod.exit_code = code
                if code == 0:
                    self.console.note(f"[k8s local] pod {pod.name} completed")
                    continue
                used = job.failures.get(pod.job_index, 0)
                if isinstance(_plan(pod, code, used, job.backoff_limit), Stop):
                    tail = "\n".join(f"    {line}" for line in list(pod.task.tail)[-8:])
                    raise RunFailed(
                        f"pod {pod.name} failed (exit code {code}) and Job {pod.job_name} has "
                        f"used its backoffLimit of {job.backoff_limit}; on a cluster JobSet's "
                        f"failurePolicy would now restart the JobSet; its last log lines:\n"
                        f"{tail}\nfull logs: {self.local_dir / 'logs'}"
                    )
                job.failures[pod.job_index] = used + 1
                self.console.note(
                    f"[k8s local] pod {pod.name} failed (exit code {code}); restarting its "
                    f"container ({used + 1} of backoffLimit {job.backoff_limit})"
                )
                self.start(pod)

    def _succeeded(self) -> bool:
        policy = self.jobset["spec"].get("successPolicy") or {}
        targets = policy.get("targetReplicatedJobs") or [job.name for job in self.jobs]
        done = [all(p.exit_code == 0 for p in job.pods) for job in self.jobs if job.name in targets]
        return any(done) if policy.get("operator") == "Any" else all(done)

    def run(self, progress_every: float = 10.0) -> int:
        for job in self.jobs:
            for dependency, status in job.depends_on:
                self._wait_for(self._job(dependency), status)
                self.console.note(f"[k8s local] {dependency} is {status}; starting {job.name}")
            for pod in job.pods:
                self.start(pod)
            self.console.note(
                f"[k8s local] started {job.name}: "
                + ", ".join(
                    f"{p.name} -> 127.0.0.1:{p.port} (pid {p.task.pid})" for p in job.pods if p.task
                )
            )
        progress = Progress(self.run_dir / METRICS_FILE) if self.run_dir else None
        last = time.monotonic()
        while not self._succeeded():
            if self.stop.wait(0.25):
                raise Interrupted
            self._check()
            if progress is not None:
                progress.poll()
                if time.monotonic() - last >= progress_every and progress.samples:
                    self.console.status(progress.render())
                    last = time.monotonic()
        self.console.clear_status()
        self.supervisor.stop()  # what is left: JobSet deletes the Jobs once it has succeeded
        return self._report(progress)

    def _report(self, progress: Progress | None) -> int:
        self.console.final(f"[k8s local] JobSet {self.name} completed; run folder {self.run_dir}")
        if self.run_dir is None or not (self.run_dir / RESULT_FILE).is_file():
            self.console.error(
                f"distsgd: error: the workers completed but wrote no {RESULT_FILE} "
                f"in {self.run_dir}"
            )
            return EXIT_FAILED
        result = json.loads((self.run_dir / RESULT_FILE).read_text())
        elapsed = progress.elapsed if progress is not None else 0.0
        self.console.final(
            f"[k8s local] done in {elapsed:.0f}s: {result.get('global_step')} updates, "
            f"{result.get('local_steps')} steps on worker0"
        )
        if result.get("test_accuracy") is not None:
            self.console.final(f"test accuracy: {result['test_accuracy']:.4f}")
        elif result.get("test_loss") is not None:
            self.console.final(f"test loss: {result['test_loss']:.4f}")
        return EXIT_OK

    def close(self) -> None:
        self.supervisor.stop()
        self._write_tasks()
        shutil.rmtree(self.private, ignore_errors=True)


def _plan(pod: Pod, code: int, used: int, backoff_limit: int) -> RestartPlan:
    """The restart planner's answer for a pod that exited with ``code`` (a restart in place
    while its Job has backoff left; the pod finds its own newest state when it starts).
    Replicated jobs other than ``ps`` restart as workers do."""
    task = TaskId(job=Role.PS if pod.job == Role.PS else Role.WORKER, index=pod.index)
    return plan_restart(
        TaskFailure(task=task, exit_code=code),
        RunTopology(collective=False, workers=1, min_workers=1, in_place=True),
        NothingStored(),
        RestartBudget(used=used, max_restarts=backoff_limit),
    )


def _local_dir(out_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = out_dir / f"local-{stamp}", 1
    while path.exists():
        n += 1
        path = out_dir / f"local-{stamp}-{n}"
    return path


def run_local(
    out_dir: Path, *, local_dir: Path | None = None, console: Console | None = None
) -> int:
    """Run the rendered JobSet in ``out_dir`` to its end; returns the exit code (0 complete,
    1 a pod failed, 130 interrupted by Ctrl-C, 143 by SIGTERM). The volumes and logs go to
    ``local_dir`` (default a new ``OUT_DIR/local-<time>``)."""
    console = console or Console()
    # absolute: each pod runs in its image's working folder, where a relative claim path
    # would point somewhere else (and the launcher would not find the chief's result)
    out_dir = Path(out_dir).resolve()
    folder = (local_dir or _local_dir(out_dir)).resolve()
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty; give a new folder for the local run")
    folder.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(out_dir, folder, console)
    previous: dict[signal.Signals, Any] = {}
    caught: list[int] = []  # the signals that stopped it, first first

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(
                sig, setter(cluster.stop, before=partial(caught.append, sig))
            )
    try:
        console.note(
            f"[k8s local] JobSet {cluster.name}: "
            + ", ".join(f"{job.name} x{len(job.pods)}" for job in cluster.jobs)
            + f"; volumes and logs in {folder}"
        )
        return cluster.run()
    except Interrupted:
        console.final(f"distsgd: interrupted; stopping {len(cluster.supervisor.tasks)} pods")
        return EXIT_TERMINATED if caught[:1] == [signal.SIGTERM] else EXIT_INTERRUPTED
    except (RunFailed, ValueError) as exc:  # a pod failed, or the rendered files cannot run
        console.error(f"distsgd: error: {exc}")
        return EXIT_FAILED
    finally:
        cluster.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
