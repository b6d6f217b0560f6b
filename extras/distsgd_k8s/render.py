"""``distsgd k8s render``: the manifests of a distsgd run on Kubernetes, applied as they are.

What :func:`render` writes into the output folder:

* ``jobset.yaml``: a JobSet (``jobset.x-k8s.io/v1alpha2``) with the replicated jobs ``control``
  (one pod, ``distsgd server --job control``: the run control, which assembles the run folder
  from what the tasks send it over the network), ``ps`` (one Indexed Job of M pods, each
  ``distsgd server``) and ``worker`` (N pods, each ``distsgd worker ... SCRIPT``).
  ``network.enableDNSHostnames`` gives every pod a stable name through the headless Service
  JobSet creates; servers and workers reach the run control at its pod's name
  (``--control``). The ``successPolicy`` targets the ``worker`` job only, so the JobSet
  completes when the workers have (JobSet then deletes the control's and the servers' Jobs);
  each job ``dependsOn`` the one before it being Ready (a TCP readiness probe on the port):
  ``ps`` the control, ``worker`` the servers (the control when there are none). A failed
  container restarts in place (``restartPolicy: OnFailure``, ``backoffLimit``) and a failed
  Job restarts the whole JobSet (``failurePolicy.maxRestarts``).
  Storage: the run folder ``<name>-<run id>`` is on a PersistentVolumeClaim that only the
  control pod mounts; servers and workers keep their checkpoints and write-ahead logs on their
  pod's own storage (an ``emptyDir`` at the same path, which outlives a container restart in
  place), so a restarted server or worker continues from its newest state there
  (``--restore-latest``, ``--resume-latest``). With :attr:`K8sConfig.shared_volume` the claim
  is ``ReadWriteMany`` and mounted in every pod instead (checkpoints then survive a JobSet
  restart). The run secret comes from a Secret mounted read-only.
* ``secret.yaml``: that Secret, with a fresh run secret (:func:`distsgd.transport.new_secret`).
* ``pvc.yaml``: the PersistentVolumeClaim (``ReadWriteOnce``: the control pod alone writes it;
  ``ReadWriteMany`` with a shared volume).
* ``trainer.yaml``: the same JobSet template as a Kubeflow Trainer ``TrainingRuntime``
  (``trainer.kubeflow.org/v1alpha1``) and a ``TrainJob`` that references it.
* ``Dockerfile`` and ``.dockerignore``: the image (``python:3.11-slim``, torch for CPU, distsgd,
  the script in ``/app``); ``wheels/`` for a distsgd wheel when it is not on your index.
* ``train/``: the training script (the bundled demo when none is given).

Each task finds its identity in what Kubernetes gives the pod (``distsgd.cluster.kube``), so
the container command lines carry no task index and no host list. Every file is written
atomically; the secret's file is readable by its owner only (0600), every other file by every
user (0644, a script 0755 where it was executable), its folders 0755: an image that runs as
a user other than root can read its ``/app``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd import __version__
from distsgd.cluster import kube
from distsgd.launcher.lifeline import thread_env
from distsgd.transport.security import SECRET_FILE_ENV, TRUSTED_NETWORK_ENV, new_secret
from distsgd.util import write_atomic, write_bytes_atomic

if TYPE_CHECKING:
    from distsgd.launcher.config import LaunchConfig

log = logging.getLogger(__name__)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_CONTAINER = "node"
"""Kubeflow Trainer's name for the container of the job labelled as the ``trainer`` step."""

JOBSET_FILE = "jobset.yaml"
SECRET_FILE = "secret.yaml"
PVC_FILE = "pvc.yaml"
TRAINER_FILE = "trainer.yaml"
DOCKERFILE = "Dockerfile"
SCRIPT_DIR = "train"
WHEELS_DIR = "wheels"

VOLUME_MOUNT = "/distsgd"
"""Where every pod mounts its volume ``runs``: the control pod the PersistentVolumeClaim (the
run folder ``/distsgd/<name>-<run id>`` on it, :attr:`K8sConfig.run_dir`), a server or worker
its own ``emptyDir`` (its checkpoints and log under the same path)."""
VOLUME_NAME = "runs"
CONTROL = "control"
"""The replicated job of the run control (one pod)."""
CONTROL_CPU = "250m"
CONTROL_MEMORY = "256Mi"
"""The control pod's requests: it writes files (and TensorBoard events) for the tasks."""
SECRET_MOUNT = "/etc/distsgd/secret"
SECRET_KEY = "secret"
APP_DIR = "/app"
"""The image's working folder, holding the training script."""
SECRET_MODE = 0o400
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYTHON_IMAGE = "python:3.11-slim"

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|[KMGTPE]i|[kMGTPE])?$")
MAX_NAME = 40
"""Longest JobSet name: pod host names (``<name>-worker-0-<i>``) must stay within 63."""


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ValueError(
            "distsgd k8s needs PyYAML, which is not installed; pip install 'distsgd[k8s]'"
        ) from None
    return yaml


@dataclass(frozen=True, kw_only=True)
class K8sConfig:
    """What ``distsgd k8s render`` renders: the run of ``distsgd run`` (its
    :class:`~distsgd.launcher.config.LaunchConfig`, checked as that checks it; ``--max-restarts``
    is each Job's ``backoffLimit`` and the JobSet's ``maxRestarts``), plus where it runs."""

    launch: LaunchConfig = field(metadata={"help": "the run, as distsgd run checks it"})
    data_files: tuple[Path, ...] = field(
        default=(), metadata={"help": "files copied beside the script (the demo's data)"}
    )
    name: str = field(default="distsgd", metadata={"help": "the JobSet's (and TrainJob's) name"})
    namespace: str = field(default="default", metadata={"help": "namespace of every object"})
    image: str = field(default="distsgd:latest", metadata={"help": "the image every pod runs"})
    port: int = field(default=2222, metadata={"help": "the port every task listens on"})
    worker_cpu: str = field(default="1", metadata={"help": "CPU request of a worker pod"})
    worker_memory: str = field(default="1Gi", metadata={"help": "memory request of a worker"})
    ps_cpu: str = field(default="1", metadata={"help": "CPU request of a ps pod"})
    ps_memory: str = field(default="512Mi", metadata={"help": "memory request of a ps pod"})
    storage: str = field(default="1Gi", metadata={"help": "size of the run folder's volume"})
    storage_class: str | None = field(default=None, metadata={"help": "its StorageClass"})
    shared_volume: bool = field(
        default=False,
        metadata={
            "help": "one ReadWriteMany claim mounted in every pod, checkpoints on it (they then "
            "survive a JobSet restart), instead of each pod's own storage"
        },
    )
    run_id: str = field(
        default_factory=lambda: secrets.token_hex(4),
        metadata={"help": "names the run folder on the volume (new for every render)"},
    )

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name) or len(self.name) > MAX_NAME:
            raise ValueError(
                f"--name {self.name!r}: use lower-case letters, digits and '-', starting with a "
                f"letter, at most {MAX_NAME} characters (pod host names derive from it)"
            )
        if not _DNS_LABEL_RE.match(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"--namespace {self.namespace!r} is not a Kubernetes namespace name")
        if not self.image.strip() or any(ch.isspace() for ch in self.image):
            raise ValueError(f"--image {self.image!r}: give an image reference, e.g. repo/img:tag")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: use a port 1..65535")
        for flag, value in (
            ("--worker-cpu", self.worker_cpu),
            ("--worker-memory", self.worker_memory),
            ("--ps-cpu", self.ps_cpu),
            ("--ps-memory", self.ps_memory),
            ("--storage", self.storage),
        ):
            if not _QUANTITY_RE.match(value):
                raise ValueError(
                    f"{flag} {value!r} is not a Kubernetes quantity; e.g. 2, 500m, 1Gi, 512Mi"
                )
        if self.storage_class is not None and not self.storage_class.strip():
            raise ValueError("--storage-class is empty; drop it for the cluster's default")
        if not re.fullmatch(r"[a-z0-9]{1,16}", self.run_id):
            raise ValueError(f"run id {self.run_id!r}: use up to 16 lower-case letters or digits")

    # -- derived values -------------------------------------------------------------------------
    @property
    def script(self) -> Path:
        return Path(self.launch.script)

    @property
    def workers(self) -> int:
        return self.launch.size.workers

    @property
    def ps(self) -> int:
        """``--ps``, or the scheme's default (0 for a collective one)."""
        return self.launch.num_ps

    @property
    def checkpoint_every(self) -> str:
        """``distsgd worker --checkpoint-every``: N (steps) or Ns; '' when checkpoints are off."""
        every = self.launch.durability
        steps, seconds = every.checkpoint_every, every.checkpoint_seconds
        return str(steps) if steps else f"{_text(seconds)}s" if seconds else ""

    @property
    def worker_threads(self) -> int:
        threads = self.launch.hosting.threads
        if threads:
            return threads
        cpu = self.worker_cpu
        if cpu.endswith("m"):
            return max(1, int(float(cpu[:-1]) // 1000))
        return max(1, int(float(cpu)))

    @property
    def run_dir(self) -> str:
        """The run folder, one per render: on the claim in the control pod; the same path on a
        server's or worker's own volume holds its checkpoints (a new render starts a new
        folder)."""
        return f"{VOLUME_MOUNT}/{self.name}-{self.run_id}"

    @property
    def control_address(self) -> str:
        """Where the servers and workers reach the run control: its pod's stable name."""
        return f"{kube.pod_hostname(self.name, CONTROL, 0)}.{self.name}:{self.port}"

    @property
    def secret_name(self) -> str:
        return f"{self.name}-secret"

    @property
    def claim_name(self) -> str:
        return f"{self.name}-runs"

    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "distsgd", "app.kubernetes.io/instance": self.name}


# ------------------------------------------------------------------------------ command lines


def _escape(arg: str) -> str:
    """An argument as Kubernetes passes it on literally: ``$`` doubled, so ``$(X)`` stays."""
    return arg.replace("$", "$$")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _text(value: Any) -> str:
    """A flag's value as the user would type it: ``5.0`` as ``5``, ``0.1`` as ``0.1``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _value_flags(values: Mapping[str, Any]) -> list[str]:
    """``{"lr": 0.1, "overlap": True}`` -> ``["--lr", "0.1", "--overlap"]`` (CLI flag names)."""
    out: list[str] = []
    for key, value in values.items():
        if value is not False:  # a flag that is on stands alone, one that is off is left out
            out += [_flag(key)] if value is True else [_flag(key), _text(value)]
    return out


def control_args(config: K8sConfig) -> list[str]:
    """The ``distsgd`` arguments of the control pod: the run control for the run folder on
    the claim, on every interface of the pod."""
    return [
        "server",
        "--job",
        CONTROL,
        "--run-dir",
        config.run_dir,
        "--address",
        f"0.0.0.0:{config.port}",
    ]


def server_args(config: K8sConfig) -> list[str]:
    """The ``distsgd`` arguments of a ps pod: listen on every interface of the pod, report to
    the run control; a restarted server starts from its write-ahead log or newest shard file
    on its volume."""
    return [
        "server",
        "--address",
        f"0.0.0.0:{config.port}",
        "--control",
        config.control_address,
        "--checkpoint-dir",
        f"{config.run_dir}/checkpoints",
        "--restore-latest",
    ]


def worker_args(config: K8sConfig) -> list[str]:
    """The ``distsgd`` arguments of a worker pod: the user's scheme and training flags; the
    run folder's files go to the run control, checkpoints into ``--run-dir`` on its volume,
    where a restarted worker continues from its newest state."""
    args = ["worker", "--run-dir", config.run_dir, "--control", config.control_address]
    if config.checkpoint_every:
        args += ["--checkpoint-every", config.checkpoint_every]
    args.append("--resume-latest")
    args += ["--scheme", config.launch.scheme]
    args += _value_flags(config.launch.scheme_options)
    args += _value_flags(config.launch.overrides)
    args += [config.script.name, *config.launch.script_args]
    return [_escape(a) for a in args]


# ---------------------------------------------------------------------------------- manifests


def _downward(name: str, label: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _env(config: K8sConfig, *, threads: int, identity: bool = True) -> list[dict[str, Any]]:
    """A container's environment; ``JOB_COMPLETION_INDEX`` the Job controller adds. Without
    ``identity`` (the control pod, which is no task of the cluster) no counts or labels."""
    env: list[dict[str, Any]] = []
    if identity:
        env += [_downward(var, label) for var, label in kube.JOBSET_LABELS.items()]
        env += [
            {"name": kube.PS_COUNT_ENV, "value": str(config.ps)},
            {"name": kube.WORKER_COUNT_ENV, "value": str(config.workers)},
            {"name": kube.PORT_ENV, "value": str(config.port)},
        ]
    env += [
        {"name": SECRET_FILE_ENV, "value": f"{SECRET_MOUNT}/{SECRET_KEY}"},
        # The pod network is the network this run is meant for: servers listen beyond
        # loopback without TLS, authenticated by the run secret (docs/kubernetes.md).
        {"name": TRUSTED_NETWORK_ENV, "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": name, "value": value} for name, value in thread_env(threads).items()),
    ]
    return env


def _container(config: K8sConfig, role: str) -> dict[str, Any]:
    """The one container of a ``control``, ``ps`` or ``worker`` pod."""
    if role == CONTROL:
        args, env = control_args(config), _env(config, threads=1, identity=False)
        requests = {"cpu": CONTROL_CPU, "memory": CONTROL_MEMORY}
    elif role == "ps":
        args, env = server_args(config), _env(config, threads=1)
        requests = {"cpu": config.ps_cpu, "memory": config.ps_memory}
    else:
        args, env = worker_args(config), _env(config, threads=config.worker_threads)
        requests = {"cpu": config.worker_cpu, "memory": config.worker_memory}
    container: dict[str, Any] = {
        "name": role,
        "image": config.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": APP_DIR,
        "command": ["distsgd"],
        "args": args,
        "env": env,
        "ports": [{"name": "distsgd", "containerPort": config.port, "protocol": "TCP"}],
        "resources": {"requests": requests},
        "volumeMounts": [
            {"name": VOLUME_NAME, "mountPath": VOLUME_MOUNT},
            {"name": "secret", "mountPath": SECRET_MOUNT, "readOnly": True},
        ],
    }
    if role != "worker":  # what the next job dependsOn: Ready once it listens
        container["readinessProbe"] = {
            "tcpSocket": {"port": config.port},
            "periodSeconds": 2,
            "failureThreshold": 3,
        }
    return container


def _volume(config: K8sConfig, role: str) -> dict[str, Any]:
    """The volume ``runs``: the claim in the control pod (in every pod with a shared volume),
    else the pod's own storage, which outlives a restart of its container, not the pod."""
    if role == CONTROL or config.shared_volume:
        return {"name": VOLUME_NAME, "persistentVolumeClaim": {"claimName": config.claim_name}}
    return {"name": VOLUME_NAME, "emptyDir": {}}


def _job_template(config: K8sConfig, role: str) -> dict[str, Any]:
    """The ``batch/v1`` JobTemplateSpec of one replicated job (``control``, ``ps`` or
    ``worker``)."""
    count = {CONTROL: 1, "ps": config.ps}.get(role, config.workers)
    pod = {
        "metadata": {"labels": {**config.labels(), "distsgd.io/role": role}},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [_container(config, role)],
            "volumes": [
                _volume(config, role),
                {
                    "name": "secret",
                    "secret": {"secretName": config.secret_name, "defaultMode": SECRET_MODE},
                },
            ],
        },
    }
    return {
        "spec": {
            "completionMode": "Indexed",
            "completions": count,
            "parallelism": count,
            "backoffLimit": config.launch.durability.max_restarts,
            "template": pod,
        }
    }


def jobset_spec(config: K8sConfig) -> dict[str, Any]:
    """The JobSet's ``spec`` (also the Trainer runtime's template): ``control``, then ``ps``
    once the control is Ready, then ``worker`` once the servers are (the control, without
    servers). One dependency each, as JobSet's ``dependsOn`` allows; the chain orders all."""
    replicated: list[dict[str, Any]] = [
        {"name": CONTROL, "replicas": 1, "template": _job_template(config, CONTROL)}
    ]
    roles = ["ps", "worker"] if config.ps else ["worker"]
    for role in roles:
        previous = replicated[-1]["name"]
        replicated.append(
            {
                "name": role,
                "replicas": 1,
                "dependsOn": [{"name": previous, "status": "Ready"}],
                "template": _job_template(config, role),
            }
        )
    return {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": ["worker"]},
        "failurePolicy": {"maxRestarts": config.launch.durability.max_restarts},
        "replicatedJobs": replicated,
    }


def _metadata(config: K8sConfig, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": config.namespace, "labels": config.labels()}


def jobset(config: K8sConfig) -> dict[str, Any]:
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(config, config.name),
        "spec": jobset_spec(config),
    }


def secret(config: K8sConfig, value: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(config, config.secret_name),
        "type": "Opaque",
        "stringData": {SECRET_KEY: value},
    }


def pvc(config: K8sConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany" if config.shared_volume else "ReadWriteOnce"],
        "resources": {"requests": {"storage": config.storage}},
    }
    if config.storage_class:
        spec["storageClassName"] = config.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(config, config.claim_name),
        "spec": spec,
    }


def trainer_runtime(config: K8sConfig) -> dict[str, Any]:
    """A Kubeflow Trainer ``TrainingRuntime`` wrapping the same JobSet spec. The worker job is
    the Trainer's ``trainer`` step (the label, and its container named ``node`` as the Trainer
    requires), so a TrainJob's ``trainer`` settings reach it; ``mlPolicy.numNodes`` is N."""
    spec = jobset_spec(config)
    worker = spec["replicatedJobs"][-1]
    worker["template"]["metadata"] = {"labels": {TRAINER_ANCESTOR_LABEL: "trainer"}}
    worker["template"]["spec"]["template"]["spec"]["containers"][0]["name"] = TRAINER_CONTAINER
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainingRuntime",
        "metadata": _metadata(config, config.name),
        "spec": {"mlPolicy": {"numNodes": config.workers}, "template": {"spec": spec}},
    }


def train_job(config: K8sConfig) -> dict[str, Any]:
    """The TrainJob that runs the runtime (its JobSet gets the TrainJob's name)."""
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": _metadata(config, config.name),
        "spec": {
            "runtimeRef": {
                "name": config.name,
                "apiGroup": "trainer.kubeflow.org",
                "kind": "TrainingRuntime",
            },
            "trainer": {"numNodes": config.workers},
        },
    }


def dockerfile(config: K8sConfig) -> str:
    return f"""\
# The image of every pod in {JOBSET_FILE} and {TRAINER_FILE} (rendered by distsgd k8s render).
#   docker build -t {config.image} .     (then push it where the cluster pulls from)
FROM {PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install torch=={TORCH_VERSION} --index-url {TORCH_CPU_INDEX}
# distsgd from {WHEELS_DIR}/ (pip wheel --no-deps -w {WHEELS_DIR} /path/to/distsgd) or your index
COPY {WHEELS_DIR}/ /tmp/wheels/
RUN pip install --find-links /tmp/wheels "distsgd=={__version__}" && rm -rf /tmp/wheels
WORKDIR {APP_DIR}
COPY {SCRIPT_DIR}/ {APP_DIR}/
"""


_HEADER = (
    "# Rendered by distsgd k8s render (distsgd {version}); docs/kubernetes.md explains it.\n"
    "# {what}\n"
)


def _dump(docs: Sequence[Mapping[str, Any]], what: str) -> str:
    yaml = _yaml()
    body = yaml.safe_dump_all(list(docs), sort_keys=False, default_flow_style=False, width=100)
    return _HEADER.format(version=__version__, what=what) + body


def manifests(config: K8sConfig, secret_value: str) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds."""
    return {
        JOBSET_FILE: [jobset(config)],
        SECRET_FILE: [secret(config, secret_value)],
        PVC_FILE: [pvc(config)],
        TRAINER_FILE: [trainer_runtime(config), train_job(config)],
    }


_WHAT = {
    JOBSET_FILE: "kubectl apply -f secret.yaml -f pvc.yaml -f jobset.yaml (needs JobSet)",
    SECRET_FILE: "The run secret: keep this file private (it is mode 0600), never commit it.",
    PVC_FILE: "The run folder (metrics, results, the final model), the control pod's volume.",
    TRAINER_FILE: "kubectl apply -f secret.yaml -f pvc.yaml -f trainer.yaml (instead of "
    "jobset.yaml; needs Kubeflow Trainer)",
}
_SHARED_PVC = "The run folder (metrics, results, checkpoints), shared by every pod."


def render(config: K8sConfig, out_dir: Path, *, force: bool = False) -> list[Path]:
    """Write every file into ``out_dir``; returns their paths. A non-empty ``out_dir`` is refused
    unless ``force`` (then the files named here are replaced, others left alone)."""
    _yaml()  # fail before writing anything
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file; give a folder for the manifests")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"{out_dir} is not empty; give a new folder, or --force to overwrite")
    for path in (config.script, *config.data_files):
        if not path.is_file():
            raise ValueError(f"{path} not found; give the path of a file")
    made = not out_dir.exists()
    written: list[Path] = []
    for name, docs in manifests(config, new_secret()).items():
        path = out_dir / name
        what = _SHARED_PVC if name == PVC_FILE and config.shared_volume else _WHAT[name]
        write_atomic(path, _dump(docs, what))
        written.append(path)
    write_atomic(out_dir / DOCKERFILE, dockerfile(config))
    write_atomic(out_dir / ".dockerignore", "# never send the secret to a build\n*.yaml\nlocal-*\n")
    write_atomic(
        out_dir / WHEELS_DIR / "README.txt",
        "Put a distsgd wheel here when distsgd is not on your package index:\n"
        f"  pip wheel --no-deps -w {WHEELS_DIR} /path/to/distsgd\n",
    )
    written += [out_dir / DOCKERFILE, out_dir / ".dockerignore"]
    scripts = out_dir / SCRIPT_DIR
    if force and scripts.is_dir():
        shutil.rmtree(scripts)
    for path in (config.script, *config.data_files):
        target = scripts / path.name
        write_bytes_atomic(target, path.read_bytes())
        os.chmod(target, 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644)
        written.append(target)
    _share(out_dir, written, made=made)
    log.info("rendered %d files into %s", len(written), out_dir)
    return written


def _share(out_dir: Path, written: Sequence[Path], *, made: bool) -> None:
    """Make what holds no secret readable by every user (files 0644, folders 0755): an image
    that runs as another user than root reads ``/app`` as it was copied; ``secret.yaml`` stays
    0600. ``out_dir`` itself only where this render made it."""
    for path in (*written, out_dir / WHEELS_DIR / "README.txt"):
        if path.name != SECRET_FILE and path.parent.name != SCRIPT_DIR:
            os.chmod(path, 0o644)
    for folder in (out_dir / WHEELS_DIR, out_dir / SCRIPT_DIR, *([out_dir] if made else [])):
        os.chmod(folder, 0o755)
