"""``distsgd k8s render`` from its parsed command line (``distsgd.cli.k8s``): the flags of
``distsgd run`` checked as that checks them, then :func:`~distsgd_k8s.render.render`."""

from __future__ import annotations

import argparse
from pathlib import Path

from distsgd.cli.flags import checkpoint_every, collect, scheme_options
from distsgd.launcher.config import DEMO_SCRIPT, ClusterSize, Durability, Hosting, LaunchConfig
from distsgd_k8s.render import K8sConfig, render

WHERE = (
    *("name", "namespace", "image", "port", "worker_cpu", "worker_memory", "ps_cpu"),
    *("ps_memory", "storage", "storage_class", "shared_volume"),
)
"""The ``kubernetes`` flags of ``render``: the :class:`K8sConfig` fields of the same names."""


def main(args: argparse.Namespace) -> int:
    """Render the manifests ``args`` asks for into its OUT_DIR; 0, or ValueError (one line)."""
    unsupported = [
        flag
        for flag, given in (
            ("--run-dir (the run folder is on the claim)", args.run_dir is not None),
            ("--quiet", args.quiet),
            ("--inject-fault", bool(args.inject_fault)),
            ("--tls-cert/--tls-key/--tls-ca", args.tls_cert or args.tls_key or args.tls_ca),
            (
                "--min-workers/--max-workers (a JobSet has a fixed number of worker pods)",
                bool(args.min_workers or args.max_workers),
            ),
        )
        if given
    ]
    if unsupported:
        raise ValueError(f"distsgd k8s render does not take {', '.join(unsupported)}; drop it")
    script = Path(args.script) if args.script else DEMO_SCRIPT
    data = () if args.script else (DEMO_SCRIPT.with_name("digits.npz"),)
    steps, seconds = checkpoint_every(args.checkpoint_every)
    # The same checks as distsgd run: the scheme, its options, --ps, training flags, the script.
    launch = LaunchConfig(
        script=str(script),
        script_args=tuple(args.script_args),
        scheme=args.scheme,
        scheme_options=scheme_options(args),
        overrides=collect(args, "train."),
        size=ClusterSize(workers=args.workers, ps=args.ps),
        durability=Durability(
            checkpoint_every=steps, checkpoint_seconds=seconds, max_restarts=args.max_restarts
        ),
        hosting=Hosting(threads=args.threads),
    )
    where = {name: getattr(args, name) for name in WHERE}
    config = K8sConfig(launch=launch, data_files=data, **where)
    written = render(config, args.out_dir, force=args.force)
    print(f"distsgd: wrote {len(written)} files into {args.out_dir}:")
    for path in written:
        print(f"  {path}")
    print(
        f"next: docker build -t {config.image} {args.out_dir}; "
        f"kubectl apply -f {args.out_dir}/secret.yaml -f {args.out_dir}/pvc.yaml "
        f"-f {args.out_dir}/jobset.yaml   (rehearse here: distsgd-emulate k8s {args.out_dir})"
    )
    return 0
