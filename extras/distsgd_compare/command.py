"""``distsgd compare`` from its parsed command line: the flags (``distsgd.cli.parser``) made
into a :class:`~distsgd_compare.config.CompareConfig`, then the comparison run."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from distsgd.cli.flags import checkpoint_every, collect
from distsgd.launcher.config import DEMO_SCRIPT
from distsgd.schemes.entries import split_schemes
from distsgd.transport.security import TlsConfig
from distsgd_compare import run
from distsgd_compare.config import CompareConfig


def main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the comparison ``args`` asks for; its exit code (130 on Ctrl-C between two runs)."""
    steps, seconds = checkpoint_every(args.checkpoint_every)
    script = args.script or str(DEMO_SCRIPT)
    overrides = collect(args, "train.")
    config = CompareConfig(
        schemes=split_schemes(args.schemes),
        script=script,
        script_args=tuple(args.script_args),
        label="digits CNN (bundled demo)" if args.script is None else Path(script).name,
        workers=args.workers,
        ps=args.ps,
        scheme_options=collect(args, "scheme."),
        overrides={k: v for k, v in overrides.items() if k != "validation"},
        validation=float(overrides.get("validation", 0.0)),
        tune=tuple(args.tune),
        repeats=args.repeats,
        baseline=args.baseline,
        out=args.out,
        target=args.target,
        threads=args.threads,
        checkpoint_every=steps,
        checkpoint_seconds=seconds,
        max_restarts=args.max_restarts,
        faults=tuple(args.inject_fault),
        tls=TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca),
        command=shlex.join(["distsgd", *argv]),
    )
    try:
        return run.compare(config)
    except KeyboardInterrupt:  # between two runs (a run itself stops on Ctrl-C by itself)
        print("distsgd: interrupted", file=sys.stderr)
        return 130
