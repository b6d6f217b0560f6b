"""``distsgd k8s render``: a run on Kubernetes.

``render`` takes the options of ``distsgd run`` (the same flag builders), plus where the run
goes (image, namespace, name, resources), and writes the manifests (``distsgd_k8s``, outside
the core). ``distsgd-emulate k8s`` runs the rendered pods on this machine
(``distsgd_emulate.k8s_local``). See docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from distsgd.cli.one_line import OneLineParser
from distsgd.util.optional import installed

AddFlags = Callable[[argparse.ArgumentParser], None]


class _OutDirFirst(OneLineParser):
    """A parser whose first argument is OUT_DIR, taken before the flags are parsed.

    ``distsgd k8s render OUT_DIR [flags] [SCRIPT [ARGS]]``: with OUT_DIR an ordinary positional,
    argparse would hand every flag after it to the script's arguments (they are a remainder).
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        items = list(args or ())
        out_dir = items.pop(0) if items and not items[0].startswith("-") else None
        parsed, extra = super().parse_known_args(items, namespace)
        if out_dir is None:
            self.error("OUT_DIR is required and comes first: " + (self.usage or ""))
        parsed.out_dir = Path(out_dir)
        return parsed, extra


def add_command(sub: Any, add_launch_flags: AddFlags) -> None:
    """The ``k8s`` command and its subcommands; ``add_launch_flags`` adds run's flags."""
    k8s = sub.add_parser(
        "k8s",
        help="render Kubernetes manifests (JobSet, Kubeflow Trainer) for a run",
        description="Render the manifests of a distsgd run on Kubernetes (a JobSet with a "
        "control, a ps and a worker job, a Secret, a PersistentVolumeClaim for the run folder, "
        "a Kubeflow Trainer runtime and TrainJob, a Dockerfile); distsgd-emulate k8s OUT_DIR "
        "runs their pods on this machine.",
    )
    actions = k8s.add_subparsers(
        dest="k8s_command", required=True, metavar="ACTION", parser_class=_OutDirFirst
    )
    render = actions.add_parser(
        "render",
        usage="distsgd k8s render OUT_DIR [options] [SCRIPT [ARGS ...]]",
        help="write the manifests into OUT_DIR (no SCRIPT: the demo)",
        description="Write jobset.yaml, secret.yaml, pvc.yaml, trainer.yaml, a Dockerfile and "
        "the script into OUT_DIR (new or empty, or --force). Takes the options of distsgd "
        "run; the workers run 'distsgd worker' with exactly the scheme and training flags "
        "given here.",
    )
    where = render.add_argument_group("kubernetes")
    where.add_argument("--image", default="distsgd:latest", help="image of every pod")
    where.add_argument("--namespace", default="default", help="namespace of every object")
    where.add_argument(
        "--name", default="distsgd", help="name of the JobSet and TrainJob (default distsgd)"
    )
    where.add_argument("--port", type=int, default=2222, help="port of every task (default 2222)")
    where.add_argument("--worker-cpu", default="1", help="CPU request per worker (default 1)")
    where.add_argument("--worker-memory", default="1Gi", help="memory per worker (default 1Gi)")
    where.add_argument("--ps-cpu", default="1", help="CPU request per ps (default 1)")
    where.add_argument("--ps-memory", default="512Mi", help="memory per ps (default 512Mi)")
    where.add_argument("--storage", default="1Gi", help="size of the run folder's volume")
    where.add_argument("--storage-class", help="its StorageClass")
    where.add_argument(
        "--shared-volume",
        action="store_true",
        help="mount the run folder's claim (ReadWriteMany) in every pod and keep the "
        "checkpoints on it, so that they survive a restart of the whole JobSet (default: the "
        "control pod alone mounts it, ReadWriteOnce; servers and workers checkpoint on their "
        "pod's own storage)",
    )
    where.add_argument("--force", action="store_true", help="overwrite a non-empty OUT_DIR")
    add_launch_flags(render)
    render.add_argument("script", nargs="?", help="training script (default: the bundled demo)")
    render.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed to the script"
    )


def main(args: argparse.Namespace) -> int:
    """``distsgd k8s render``: the manifests written (:mod:`distsgd_k8s`, outside the core)."""
    with installed("distsgd_k8s", "distsgd k8s render"):
        from distsgd_k8s.command import main as render_main
    return render_main(args)
