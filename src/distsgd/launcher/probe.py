"""Measuring a model's parts for the cost model (``distsgd plan``): short real runs of the
user's script, read back from their ``metrics.jsonl``.

- :func:`probe_exchange`: Hogwild, 1 worker + 1 ps, through one data path (shared memory or the
  tensor socket). Its ``finished_steps`` line gives the loop's compute per step and the pull
  and push seconds; its float32 pushes give the model's bytes (``bytes_sent`` per step).
- :func:`probe_allreduce`: all-reduce, 2 workers: the step's time beyond the compute is the
  all-reduce of one model, from which gloo's throughput follows.

Each run is a ``distsgd run`` child of this process in a temporary folder, ended by its PID
if it overruns ``timeout`` (the launcher then ends its own tasks), and removed afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_STEPS = 120
"""Steps of a probe run: enough that start-up noise (the first pull, the first optimizer)
weighs little, short enough for a few seconds."""


class ProbeFailed(RuntimeError):
    """A probe run did not finish or left no figures; the message names the run's last words."""


@dataclass(frozen=True, kw_only=True)
class ExchangeProbe:
    """What a 1-worker Hogwild run measured, per step."""

    path: str
    """``shared memory`` or ``tensor socket``."""
    param_bytes: int
    """The bytes one float32 push carried: the model's."""
    compute_s: float
    pull_s: float
    push_s: float
    steps: int


@dataclass(frozen=True, kw_only=True)
class AllreduceProbe:
    """What a 2-worker all-reduce run measured, per step."""

    step_s: float
    """Loop seconds per step (compute and the all-reduce)."""
    steps: int


def _run(
    script: str, script_args: Sequence[str], flags: Sequence[str], timeout: float
) -> list[dict[str, Any]]:
    """``distsgd run FLAGS script`` in a temporary folder; its metrics records."""
    with tempfile.TemporaryDirectory(prefix="distsgd-plan-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "distsgd", "run", *flags, "--threads", "1",
            "--checkpoint-every", "0", "--max-restarts", "0", "--quiet",
            "--run-dir", str(run_dir), script, *script_args,
        ]  # fmt: skip
        log = Path(tmp) / "probe.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # by PID: the launcher stops its own tasks on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise ProbeFailed(f"a probe run took over {timeout:.0f} s: {_tail(log)}") from None
        if code not in (0, 3):
            raise ProbeFailed(f"a probe run ({' '.join(flags)}) exited {code}: {_tail(log)}")
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            raise ProbeFailed(f"a probe run wrote no metrics: {_tail(log)}")
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or "no output"


def _finished(records: list[dict[str, Any]], task: str) -> dict[str, Any]:
    for record in records:
        if record.get("event") == "finished_steps" and record.get("task") == task:
            return record
    raise ProbeFailed(f"the probe's {task} wrote no finished_steps line")


def probe_exchange(
    script: str,
    script_args: Sequence[str] = (),
    *,
    shared_memory: bool,
    steps: int = PROBE_STEPS,
    timeout: float = 300.0,
) -> ExchangeProbe:
    """Hogwild, 1 worker + 1 ps, ``steps`` steps, through shared memory or the tensor socket."""
    flags = [
        "--scheme", "hogwild", "--workers", "1", "--ps", "1", "--steps", str(steps),
        "--shared-memory", "auto" if shared_memory else "off",
    ]  # fmt: skip
    records = _run(script, script_args, flags, timeout)
    done = _finished(records, "worker0")
    local = int(done["local_step"])
    sent = [r for r in records if r.get("task") == "worker0" and "bytes_sent" in r]
    if local < 1 or not sent:
        raise ProbeFailed("the probe run took no step; does the script's data hold a batch?")
    last = sent[-1]
    per_step = int(last["bytes_sent"]) // max(1, int(last["local_step"]))
    # The steady state: from the first line past a third of the steps (the first steps map
    # the segments, fill the caches, write the server's first log pages) to the end.
    start = next((r for r in sent if int(r["local_step"]) >= local / 3), None)
    base = start if start is not None and int(start["local_step"]) < local else {}
    steps = local - int(base.get("local_step", 0))

    def per(phase: str) -> float:
        return (float(done[phase]) - float(base.get(phase, 0.0))) / steps

    return ExchangeProbe(
        path="shared memory" if shared_memory else "tensor socket",
        param_bytes=per_step,
        # the loop outside pull and push: its data loading too (data_s, where lines have it)
        compute_s=per("compute_s") + (per("data_s") if "data_s" in done else 0.0),
        pull_s=per("pull_s"),
        push_s=per("push_s"),
        steps=steps,
    )


def probe_allreduce(
    script: str,
    script_args: Sequence[str],
    *,
    steps: int = PROBE_STEPS,
    timeout: float = 300.0,
) -> AllreduceProbe:
    """All-reduce, 2 workers, ``steps`` steps: the loop's seconds per step."""
    flags = ["--scheme", "allreduce", "--workers", "2", "--steps", str(steps)]
    records = _run(script, script_args, flags, timeout)
    done = _finished(records, "worker0")
    local = int(done["local_step"])
    if local < 1:
        raise ProbeFailed("the all-reduce probe took no step")
    return AllreduceProbe(step_s=float(done["seconds"]) / local, steps=local)
