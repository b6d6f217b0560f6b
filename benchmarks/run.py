"""distsgd's benchmark suite: each distsgd figure beside its reference, measured in the same run.

    python benchmarks/run.py [--quick] [--out DIR] [--tf-python PATH] [--repeats N]

The workload is one MLP 784-512-512-10 (669,706 float32 parameters, 2.7 MB), batch 64, SGD at
lr 0.01, random inputs made in-process with a fixed seed, one thread per process
(``workload.py``). Each figure's measurements run in turn, A B A B (``--repeats`` rounds; the
machine's speed drifts, neighbours stay fair), and the report gives medians and the ratio of
the medians:

1. Hogwild, 2 workers + 1 ps, against TensorFlow 2 ParameterServerStrategy, 2 workers + 1 ps
   (``tf_pss.py``, run by ``--tf-python``; without it the row says it was not measured).
2. Hogwild, 1 worker + 1 ps, against TF PSS with 1 worker, and against plain PyTorch in one
   process (no communication); and the pull + push milliseconds of its step (time split).
3. all-reduce, 2 workers, against PyTorch DDP (gloo, 2 processes on 127.0.0.1).
4. DOWNPOUR with window 10, 2 workers + 1 ps, against 2 independent PyTorch processes with no
   communication (the bound); and plain PyTorch in one process.
5. Pull and push throughput (GB/s) against model size through one ``distsgd server``, over gRPC,
   the tensor socket and shared memory (``transport.py``).
6. Hogwild's step time (1 worker + 1 ps) against model size, beside plain PyTorch's.

distsgd figures come from ``distsgd run ... benchmarks/mlp_script.py`` (checkpoints off, one
thread per task): each worker's ``finished_steps`` line in ``metrics.jsonl`` gives its loop time
(start-up excluded) and steps; rates are summed over workers. The references time their loop
the same way. Writes ``results.md``, ``results.json``, ``throughput.png`` and ``transport.png``
into ``--out`` (default ``benchmarks/results/<time>/``) and prints the markdown. Every process
it starts is stopped by its PID (its process group) when it is done, fails or times out.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

MLP_SCRIPT = HERE / "mlp_script.py"
REFERENCE = HERE / "reference.py"
TF_SCRIPT = HERE / "tf_pss.py"
TRANSPORT = HERE / "transport.py"
HIDDEN = 512
BATCH_SIZE = 64
LR = 0.01
MB = 1_000_000
TF_MISSING = "not measured: pass --tf-python (see docs/performance.md for install)"
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SPLIT_ORDER = ("compute", "pull", "push", "wait", "allreduce", "checkpoint", "eval")


class NotMeasured(Exception):
    """A measurement that cannot be made in this run (its reason is shown in the table)."""


class Failed(Exception):
    """A measurement whose process failed (the message says which and how)."""


# --------------------------------------------------------------------------- processes


class Processes:
    """Every process the suite starts, each in its own session (process group = its PID)."""

    def __init__(self) -> None:
        self.running: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Any:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, **THREAD_ENV, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.running[proc.pid] = proc
        return proc

    def wait(self, procs: list[Any], timeout: float) -> list[int]:
        """Exit codes of ``procs``; those still running after ``timeout`` s are stopped."""
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise Failed(f"timed out after {timeout:.0f} s: {shlex.join(exc.cmd)}") from None
        finally:
            for proc in procs:
                self.stop(proc)
        return [proc.returncode for proc in procs]

    def stop(self, proc: Any) -> None:
        """SIGTERM to the process group we created for ``proc``, SIGKILL after 5 s."""
        self.running.pop(proc.pid, None)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of its group
        proc.wait()

    def stop_all(self) -> None:
        for proc in list(self.running.values()):
            self.stop(proc)


def _stop_run_tasks(run_dir: Path, launcher_pid: int) -> None:
    """Tasks of one ``distsgd run`` still alive after its launcher ended (they run in their own
    sessions): killed by the PIDs the launcher recorded, if they are that launcher's tasks."""
    tasks = run_dir / "tasks.json"
    if not tasks.exists():
        return
    with contextlib.suppress(ValueError, OSError):
        for pid in json.loads(tasks.read_text()).values():
            try:
                environ = Path(f"/proc/{int(pid)}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # gone
            if f"DISTSGD_PARENT_PID={launcher_pid}".encode() in environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _tail(path: Path, lines: int = 8) -> str:
    if not path.exists():
        return ""
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


# --------------------------------------------------------------------------- measurements


@dataclass
class Sample:
    """One measurement: worker-steps per second (all workers) and the mean step time."""

    rate: float
    ms_per_step: float
    workers: list[dict[str, Any]] = field(default_factory=list)
    split_ms: dict[str, float] = field(default_factory=dict)
    """Milliseconds per step in each phase (mean over workers), from distsgd's time split."""
    span_rate: float | None = None
    """All steps over the time from the first loop's start to the last one's end (a
    conservative rate: it counts a worker's lone seconds against the cluster)."""
    note: str = ""


def _sample(workers: list[dict[str, Any]], note: str = "") -> Sample:
    """From per-worker ``steps``, ``seconds`` and wall ``start``/``end``."""
    rate = sum(w["steps"] / w["seconds"] for w in workers)
    steps = sum(w["steps"] for w in workers)
    ms = 1000 * sum(w["seconds"] for w in workers) / steps
    span = max(w["end"] for w in workers) - min(w["start"] for w in workers)
    split: dict[str, float] = {}
    phases = [
        k for k in workers[0].get("split", {}) if all(k in w.get("split", {}) for w in workers)
    ]
    for phase in sorted(phases, key=lambda p: (*SPLIT_ORDER, p).index(p)):
        split[phase] = 1000 * sum(w["split"][phase] for w in workers) / steps
    return Sample(rate, ms, workers, split, steps / span if span > 0 else None, note)


@dataclass
class Suite:
    quick: bool
    steps: int
    repeats: int
    tf_python: str | None
    tmp: Path
    procs: Processes
    timeout: float
    counter: int = 0

    def folder(self, name: str) -> Path:
        self.counter += 1
        path = self.tmp / f"{self.counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    # -- distsgd ------------------------------------------------------------------------------
    def distsgd(
        self,
        scheme: str,
        workers: int,
        ps: int,
        *,
        steps: int | None = None,
        hidden: int = HIDDEN,
        options: tuple[str, ...] = (),
    ) -> Sample:
        folder = self.folder(f"distsgd-{scheme}-{workers}w")
        run_dir = folder / "run"
        cmd = [
            sys.executable, "-m", "distsgd", "run", "--scheme", scheme,
            "--workers", str(workers), "--ps", str(ps), "--steps", str(steps or self.steps),
            "--batch-size", str(BATCH_SIZE), "--lr", str(LR), "--threads", "1",
            "--checkpoint-every", "0", "--max-restarts", "0", "--quiet",
            "--run-dir", str(run_dir), *options, str(MLP_SCRIPT), "--hidden", str(hidden),
        ]  # fmt: skip
        log = folder / "launcher.log"
        proc = self.procs.start(cmd, log)
        try:
            (code,) = self.procs.wait([proc], self.timeout)
        finally:
            _stop_run_tasks(run_dir, proc.pid)
        if code not in (0, 3):  # 3: judged diverged; the loop's timing still holds
            raise Failed(f"distsgd run exited {code}: {_tail(log)}")
        done = []
        metrics = run_dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            record = json.loads(line)
            if record.get("event") == "finished_steps" and record["task"].startswith("worker"):
                split = {
                    k[:-2]: float(v)
                    for k, v in record.items()
                    if k.endswith("_s") and isinstance(v, (int, float))
                }
                done.append(
                    {
                        "task": record["task"],
                        "steps": record["local_step"],
                        "seconds": record["seconds"],
                        "start": record["time"] - record["seconds"],
                        "end": record["time"],
                        "split": split,
                        # shards this worker reached through each data path
                        **{k: v for k, v in record.items() if k.endswith("_shards")},
                    }
                )
        if len(done) != workers:
            raise Failed(f"{len(done)} of {workers} workers logged finished_steps: {_tail(log)}")
        return _sample(done, "judged diverged (exit 3)" if code == 3 else "")

    def hogwild_wal_off(self) -> Sample:
        """Figure 1's Hogwild run with its servers' write-ahead log off (row 1b: the log's cost,
        the default being on). Not in --quick: its 30 steps would be the log's warm-up alone
        (the first pushes write log files that have no pages in the page cache yet)."""
        if self.quick:
            raise NotMeasured("not measured in --quick (its steps are the log's warm-up)")
        return self.distsgd("hogwild", 2, 1, options=WAL_OFF)

    # -- PyTorch references -------------------------------------------------------------------
    def _reference(self, mode: str, ranks: int, steps: int, hidden: int) -> Sample:
        folder = self.folder(f"torch-{mode}-{ranks}")
        procs, outs = [], []
        for rank in range(ranks):
            out = folder / f"rank{rank}.json"
            cmd = [sys.executable, str(REFERENCE), mode, "--steps", str(steps)]
            cmd += ["--hidden", str(hidden), "--rank", str(rank), "--out", str(out)]
            if mode == "ddp":
                cmd += ["--world", str(ranks), "--store-file", str(folder / "store-port")]
            elif ranks > 1:
                cmd += ["--peers", str(ranks), "--ready-dir", str(folder / "ready")]
            procs.append(self.procs.start(cmd, folder / f"rank{rank}.log"))
            outs.append(out)
        codes = self.procs.wait(procs, self.timeout)
        if any(codes) or not all(out.exists() for out in outs):
            raise Failed(f"{mode} reference exited {codes}: {_tail(folder / 'rank0.log')}")
        return _sample([json.loads(out.read_text()) for out in outs])

    def plain(
        self, processes: int = 1, *, steps: int | None = None, hidden: int = HIDDEN
    ) -> Sample:
        return self._reference("plain", processes, steps or self.steps, hidden)

    def ddp(self, ranks: int = 2) -> Sample:
        return self._reference("ddp", ranks, self.steps, HIDDEN)

    # -- TensorFlow ---------------------------------------------------------------------------
    def tf(self, workers: int) -> Sample:
        if not self.tf_python:
            raise NotMeasured(TF_MISSING)
        folder = self.folder(f"tf-{workers}w")
        out = folder / "tf.json"
        cmd = [self.tf_python, str(TF_SCRIPT), "--workers", str(workers)]
        cmd += ["--steps", str(self.steps), "--warmup", "5" if self.quick else "20"]
        cmd += ["--out", str(out)]
        proc = self.procs.start(cmd, folder / "tf.log", {"TF_CPP_MIN_LOG_LEVEL": "2"})
        (code,) = self.procs.wait([proc], max(self.timeout, 600))
        if code != 0 or not out.exists():
            raise Failed(f"tf_pss.py exited {code}: {_tail(folder / 'tf.log')}")
        result = json.loads(out.read_text())
        steps = result["worker_steps"]
        wall = time.time()
        per = {"steps": steps / workers, "seconds": result["seconds"]}
        sample = _sample([{**per, "start": wall - result["seconds"], "end": wall}] * workers)
        sample.note = f"TensorFlow {result['tensorflow']}"
        sample.workers = [result]
        return sample

    # -- transport ----------------------------------------------------------------------------
    def transport(self, sizes: list[float]) -> dict[str, Any]:
        folder = self.folder("transport")
        out = folder / "transport.json"
        cmd = [sys.executable, str(TRANSPORT), "--sizes", ",".join(f"{s:g}" for s in sizes)]
        cmd += ["--out", str(out), *(["--quick"] if self.quick else [])]
        proc = self.procs.start(cmd, folder / "transport.log")
        (code,) = self.procs.wait([proc], max(self.timeout, 900))
        if code != 0 or not out.exists():
            raise Failed(f"transport.py exited {code}: {_tail(folder / 'transport.log')}")
        return json.loads(out.read_text())


def interleave(
    repeats: int, measures: dict[str, Callable[[], Sample]], label: str
) -> dict[str, list[Sample] | str]:
    """Run each measure in turn, ``repeats`` rounds (A B A B); a measure that cannot be made
    or fails is not tried again, and its reason replaces its samples."""
    out: dict[str, list[Sample] | str] = {key: [] for key in measures}
    for round_ in range(repeats):
        for key, measure in measures.items():
            if isinstance(out[key], str):
                continue
            started = time.monotonic()
            try:
                sample = measure()
            except NotMeasured as exc:
                out[key] = str(exc)
                continue
            except Failed as exc:
                out[key] = f"failed: {exc}"
                print(f"  {label} {key}: {out[key]}", flush=True)
                continue
            samples = out[key]
            assert isinstance(samples, list)
            samples.append(sample)
            print(
                f"  {label} {key} round {round_ + 1}: {sample.rate:8.1f} worker-steps/s, "
                f"{sample.ms_per_step:7.2f} ms/step ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return out


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    key: str
    figure: str
    ours: str
    reference: str
    block: str
    a: str | None
    b: str | None


WAL_OFF = ("--wal", "off")

ROWS = (
    Row("1", "Hogwild, 2 workers + 1 ps", "distsgd hogwild",
        "TF2 ParameterServerStrategy, 2 workers + 1 ps", "fig1", "distsgd", "tf"),
    Row("1b", "Hogwild, 2 workers + 1 ps: the write-ahead log's cost", "distsgd hogwild (--wal on)",
        "distsgd hogwild, --wal off", "fig1", "distsgd", "nowal"),
    Row("2", "Hogwild, 1 worker + 1 ps", "distsgd hogwild",
        "TF2 ParameterServerStrategy, 1 worker + 1 ps", "fig2", "distsgd", "tf"),
    Row("2b", "Hogwild, 1 worker + 1 ps", "distsgd hogwild",
        "plain PyTorch, 1 process (no communication)", "fig2", "distsgd", "plain"),
    Row("2c", "Hogwild, 1 worker + 1 ps: pull + push per step", "distsgd time split", "",
        "fig2", "distsgd", None),
    Row("3", "all-reduce, 2 workers", "distsgd allreduce",
        "PyTorch DDP (gloo), 2 processes", "fig3", "distsgd", "ddp"),
    Row("4", "DOWNPOUR window 10, 2 workers + 1 ps", "distsgd downpour",
        "2 independent PyTorch processes (no communication)", "fig4", "distsgd", "independent"),
    Row("4b", "plain PyTorch, 1 process", "", "plain PyTorch, 1 process", "fig4", None, "plain"),
)  # fmt: skip


def _paired_ratio(a: list[Sample], b: list[Sample]) -> float:
    """The median over rounds of distsgd's rate ÷ the reference's in the same round: the two
    ran next to each other, so the machine's drift between rounds cancels."""
    return statistics.median(x.rate / y.rate for x, y in zip(a, b, strict=False))


def _median(samples: list[Sample], attr: str = "rate") -> float:
    return statistics.median(getattr(s, attr) for s in samples)


def _rate_text(samples: list[Sample] | str | None) -> str:
    if samples is None:
        return "—"
    if isinstance(samples, str):
        return samples
    values = [s.rate for s in samples]
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.1f}{spread}"


def _split_text(samples: list[Sample] | str | None) -> str:
    if not isinstance(samples, list) or not samples or not samples[0].split_ms:
        return ""
    phases = [p for p in samples[0].split_ms if all(p in s.split_ms for s in samples)]
    parts = [f"{p} {statistics.median(s.split_ms[p] for s in samples):.2f}" for p in phases]
    return " · ".join(parts)


def row_report(row: Row, blocks: dict[str, dict[str, list[Sample] | str]]) -> dict[str, Any]:
    block = blocks.get(row.block)
    if row.key == "4b" and "fig2" in blocks:  # measured once, beside figure 2's distsgd run
        block = {**blocks.get("fig4", {}), "plain": blocks["fig2"]["plain"]}
    if block is None:
        reason = "not run (--figures)"
        return {"key": row.key, "figure": row.figure, "distsgd": reason, "reference": reason}
    a = block.get(row.a) if row.a else None
    b = block.get(row.b) if row.b else None
    out: dict[str, Any] = {
        "key": row.key,
        "figure": row.figure,
        "ours": row.ours,
        "reference_name": row.reference,
        "distsgd": _rate_text(a),
        "reference": _rate_text(b),
        "ratio": None,
        "split": _split_text(a),
        "notes": "",
    }
    for name, samples in (("distsgd_samples", a), ("reference_samples", b)):
        if isinstance(samples, list):
            out[name] = [s.__dict__ for s in samples]
    if isinstance(a, list) and isinstance(b, list) and a and b:
        out["ratio"] = _paired_ratio(a, b)
        out["ratio_of_medians"] = _median(a) / _median(b)
    if row.key == "2c":
        out["reference"] = "—"
        if isinstance(a, list) and a and {"pull", "push"} <= set(a[0].split_ms):
            pull = statistics.median(s.split_ms["pull"] for s in a)
            push = statistics.median(s.split_ms["push"] for s in a)
            out["distsgd"] = f"{pull + push:.2f} ms ({pull:.2f} pull + {push:.2f} push)"
            out["pull_push_ms"] = pull + push
        elif isinstance(a, list):
            out["distsgd"] = "not measured: this build logs no time split"
    notes = []
    if row.key == "4b" and isinstance(b, list) and isinstance(block.get("independent"), list):
        both = block["independent"]
        assert isinstance(both, list)
        notes.append(f"2 independent ÷ 1 process: {_median(both) / _median(b):.2f}")
        if "fig2" in blocks:
            notes.append("measured with figure 2")
    if row.key == "2b" and isinstance(a, list) and isinstance(b, list):
        extra = _median(a, "ms_per_step") - _median(b, "ms_per_step")
        notes.append(f"step time, distsgd minus plain: {extra:+.2f} ms")
    for samples in (a, b):
        if isinstance(samples, list):
            notes += sorted({s.note for s in samples if s.note})
    out["notes"] = "; ".join(notes)
    return out


def _ratio_text(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}"


def _transport_paths(t: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """name: (label, measured) of each data path of a transport result."""
    if "paths" in t:
        return {n: (p["label"], p["available"]) for n, p in t["paths"].items()}
    return {"grpc": ("gRPC", True), "shm": ("shared memory", t["shared_memory_available"])}


def _rounds(repeats: int) -> str:
    return "1 round" if repeats == 1 else f"{repeats} rounds A B A B"


def _split_rows(report: dict[str, Any]) -> list[str]:
    """Markdown rows: where a Hogwild step's milliseconds go (median over rounds)."""
    cases: list[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]] = []
    rows = {r["key"]: r for r in report.get("rows", [])}
    if "distsgd_samples" in rows.get("1", {}):
        cases.append(("2 workers + 1 ps", "2.7 MB", rows["1"]["distsgd_samples"], []))
    if "distsgd_samples" in rows.get("2b", {}):
        plain = rows["2b"].get("reference_samples", [])
        cases.append(("1 worker + 1 ps", "2.7 MB", rows["2b"]["distsgd_samples"], plain))
    for size in report.get("step_sizes", []):
        if "distsgd_samples" in size:
            model = f"{size['megabytes']:.0f} MB"
            cases.append(
                (
                    "1 worker + 1 ps",
                    model,
                    size["distsgd_samples"],
                    size.get("reference_samples", []),
                )
            )
    out = []
    for cluster, model, samples, plain in cases:
        phases = [
            statistics.median(s["split_ms"].get(p, 0.0) for s in samples)
            for p in ("compute", "pull", "push", "wait")
        ]
        if not any(phases):
            continue
        step = statistics.median(s["ms_per_step"] for s in samples)
        ref = f"{statistics.median(s['ms_per_step'] for s in plain):.2f}" if plain else "—"
        comm = 100 * sum(phases[1:]) / max(step, 1e-9)
        cells = " | ".join(f"{v:.2f}" for v in phases)
        out.append(f"| {cluster} | {model} | {step:.2f} | {cells} | {comm:.0f}% | {ref} |")
    return out


def markdown(report: dict[str, Any], level: int = 1) -> str:
    """The report in markdown; ``level`` 2 drops the title and nests every heading one deeper
    (to paste into docs/performance.md)."""
    m = report["machine"]
    h = "#" * (level + 1)
    lines = [
        *(["# distsgd benchmark results", ""] if level == 1 else []),
        f"{m['date']}, distsgd {m['distsgd_commit']}"
        + (
            f" (source changed during the run; at the end: {m['distsgd_commit_after']})"
            if m.get("distsgd_commit_after")
            else ""
        )
        + f"; {m['cpu']}, {m['cores']} cores; "
        f"Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, grpcio {m['grpcio']}"
        + (f", TensorFlow {m['tensorflow']}" if m.get("tensorflow") else "")
        + f"; load average {m['load_before']} before, {m['load_after']} after.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"MLP 784-{HIDDEN}-{HIDDEN}-10 (669,706 float32 parameters, 2.7 MB), batch {BATCH_SIZE}, "
        f"SGD lr {LR}, random inputs, one thread per process; {report['steps']} steps per "
        f"worker, {_rounds(report['repeats'])}; medians (min-max of the rounds). Rates "
        "are worker-steps per second summed over workers, from each loop's own time "
        "(start-up excluded). Ratio: distsgd ÷ reference within each round, the median over the "
        "rounds (above 1: distsgd is faster).",
        "",
        "| # | figure | distsgd (worker-steps/s) | reference (worker-steps/s) | ratio "
        "| distsgd step split (ms per step) | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        figure = r["figure"]
        if r.get("reference_name") and r.get("ours"):
            figure += f", against {r['reference_name']}"
        lines.append(
            f"| {r['key']} | {figure} | {r['distsgd']} | {r['reference']} "
            f"| {_ratio_text(r.get('ratio'))} | {r.get('split', '')} | {r.get('notes', '')} |"
        )
    lines += ["", f"{h} 5. Pull and push through one `distsgd server` (GB/s, 10^9 B/s)", ""]
    t = report["transport"]
    if isinstance(t, str):
        lines.append(t)
    else:
        paths = _transport_paths(t)
        lines += [
            "| model size | "
            + " | ".join(f"{label} (pull / push)" for label, _ in paths.values())
            + " |",
            "| --- |" + " --- |" * len(paths),
        ]
        for s in t["sizes"]:
            cells = [
                f"{s[f'{name}_pull_gbps']:.2f} / {s[f'{name}_push_gbps']:.2f}"
                if available
                else "not available in this build"
                for name, (_, available) in paths.items()
            ]
            lines.append(f"| {s['megabytes']:.0f} MB | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Medians of repeated `ParameterClient.pull(into=...)` and `push()` of the whole model "
            "(4 float32 pieces), one client per data path, the paths alternating; a push includes "
            "the server's SGD update. gRPC: the stream (every other path off); tensor socket: "
            "tensor bytes on a plain TCP connection beside gRPC; shared memory: through a "
            "segment the server shares with the client; gradient in place: a push of a gradient "
            "already in the segment's push area (`ParameterClient.push_buffers()`), where "
            "Hogwild's and DynSGD's backward writes it, so the push copies nothing.",
        ]
    lines += [
        "",
        f"{h} 6. Hogwild step time against model size (1 worker + 1 ps)",
        "",
        "| model size | hidden width | distsgd ms/step | plain PyTorch ms/step | ratio "
        "| distsgd step split (per step) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in report["step_sizes"]:
        lines.append(
            f"| {s['megabytes']:.1f} MB | {s['hidden']} | {s['distsgd']} | {s['reference']} "
            f"| {_ratio_text(s.get('ratio'))} | {s.get('split', '')} |"
        )
    lines += [
        "",
        "Ratio: plain PyTorch's step time ÷ distsgd's within each round, the median over the "
        "rounds (above 1: distsgd is faster).",
    ]
    split = _split_rows(report)
    if split:
        lines += [
            "",
            f"{h} Time split of a Hogwild step (ms per step, mean over workers)",
            "",
            "| cluster | model | step | compute | pull | push | wait | communication "
            "| plain PyTorch step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *split,
            "",
            "Compute is the loop's time outside pull, push and wait: forward, backward, the "
            "batch, the loss check and metrics. Communication: (pull + push + wait) ÷ step.",
        ]
    lines.append("")
    return "\n".join(lines)


def _ms_text(samples: list[Sample] | str) -> str:
    if isinstance(samples, str):
        return samples
    values = [s.ms_per_step for s in samples]
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.1f}{spread}"


SHORT = {
    "1": "hogwild 2w+1ps\nvs TF PSS",
    "2": "hogwild 1w+1ps\nvs TF PSS",
    "2b": "hogwild 1w+1ps\nvs plain 1 process",
    "3": "allreduce 2w\nvs DDP gloo",
    "4": "downpour w10 2w+1ps\nvs 2 independent",
    "4b": "plain PyTorch\n1 process",
}


def _log_axis(axis: Any, ticks: list[float]) -> None:
    """A log axis labelled with the measured sizes themselves."""
    from matplotlib.ticker import FixedLocator, NullLocator

    axis.axes.set_xscale("log")
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(lambda v, _: f"{v:.3g}")


def plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, sizes) = plt.subplots(1, 2, figsize=(14, 4.8), width_ratios=[1.5, 1])
    labels, ours, refs = [], [], []
    for r in report["rows"]:
        if r["key"] not in SHORT:
            continue
        labels.append(f"{r['key']}. {SHORT[r['key']]}")
        for values, name in ((ours, "distsgd_samples"), (refs, "reference_samples")):
            rates = [sample["rate"] for sample in r.get(name, [])]
            values.append(statistics.median(rates) if rates else 0.0)
    xs = range(len(labels))
    bars.bar([x - 0.2 for x in xs], ours, 0.4, label="distsgd")
    bars.bar([x + 0.2 for x in xs], refs, 0.4, label="reference")
    for x, (o, r) in enumerate(zip(ours, refs, strict=True)):
        for dx, value in ((-0.2, o), (0.2, r)):
            text = f"{value:.0f}" if value else ("—" if dx < 0 and x == len(labels) - 1 else "n/m")
            bars.text(x + dx, value, text, ha="center", va="bottom", fontsize=7)
    bars.set_xticks(list(xs), labels, fontsize=7)
    bars.set_ylabel("worker-steps per second (all workers)")
    bars.set_title("MLP 784-512-512-10, batch 64 (medians)")
    bars.legend()
    points = [s for s in report["step_sizes"] if s.get("distsgd_ms") is not None]
    if points:
        mbs = [s["megabytes"] for s in points]
        sizes.plot(mbs, [s["distsgd_ms"] for s in points], "o-", label="distsgd hogwild 1w+1ps")
        ref = [(s["megabytes"], s["reference_ms"]) for s in points if s.get("reference_ms")]
        if ref:
            sizes.plot(*zip(*ref, strict=True), "s--", label="plain PyTorch")
        _log_axis(sizes.xaxis, mbs)
        sizes.set_yscale("log")
        from matplotlib.ticker import LogLocator, NullLocator

        sizes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        sizes.yaxis.set_minor_locator(NullLocator())
        sizes.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
    sizes.set_xlabel("model size (MB)")
    sizes.set_ylabel("ms per step")
    sizes.set_title("step time against model size")
    sizes.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    t = report["transport"]
    if not isinstance(t, str):
        mbs = [s["megabytes"] for s in t["sizes"]]
        colors = {"grpc": "tab:blue", "socket": "tab:green", "shm": "tab:red"}
        colors["inplace"] = "tab:purple"
        for path, (label, available) in _transport_paths(t).items():
            if not available:
                continue
            for kind, style in (("pull", "o-"), ("push", "s--")):
                ys = [s[f"{path}_{kind}_gbps"] for s in t["sizes"]]
                ax.plot(mbs, ys, style, color=colors.get(path), label=f"{label} {kind}")
        _log_axis(ax.xaxis, mbs)
        ax.legend()
    else:
        ax.text(0.5, 0.5, t, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xlabel("model size (MB)")
    ax.set_ylabel("GB/s (10^9 bytes per second)")
    ax.set_title("pull and push through one distsgd server on 127.0.0.1")
    fig.tight_layout()
    fig.savefig(out / "transport.png", dpi=110)
    plt.close(fig)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def distsgd_source() -> tuple[str, str]:
    """(the commit, with a word on uncommitted changes under src/; a fingerprint of the
    source as it is now: the commit, the diff under src/ and its untracked files)."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    changed = [line for line in _git("status", "--porcelain", "--", "src").splitlines() if line]
    text = commit
    if changed:
        text += f" + uncommitted changes in {len(changed)} files under src/"
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", "src").split()
    digest = hashlib.sha1(_git("diff", "HEAD", "--", "src").encode())
    for name in sorted(untracked):
        with contextlib.suppress(OSError):
            digest.update(name.encode() + (ROOT / name).read_bytes())
    return text, f"{commit}:{digest.hexdigest()[:12]}"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    commit, source = distsgd_source()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "grpcio": _version("grpcio"),
        "distsgd_commit": commit,
        "distsgd_source": source,
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="see docs/performance.md",
    )
    parser.add_argument("--quick", action="store_true", help="1 round, tiny step counts")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/<time>/")
    parser.add_argument("--tf-python", help="a Python with tensorflow, for the TF2 rows")
    parser.add_argument("--repeats", type=int, help="rounds A B A B (default 2; quick 1)")
    parser.add_argument("--steps", type=int, help="steps per worker (default 400; quick 30)")
    parser.add_argument(
        "--figures", default="1,2,3,4,5,6", help="which figures to measure (default all)"
    )
    parser.add_argument(
        "--update-doc",
        type=Path,
        metavar="MD",
        help="also put the results between the markers of this page (docs/performance.md) "
        "and its pictures in docs/images/",
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="measure nothing: write the report of an earlier run's results.json again",
    )
    return parser.parse_args(argv)


BEGIN, END = "<!-- benchmark results: begin -->", "<!-- benchmark results: end -->"
DOC_IMAGES = {
    "throughput.png": "performance-throughput.png",
    "transport.png": "performance-transport.png",
}
MAX_IMAGE_BYTES = 200_000


def put_between_markers(doc_path: Path, name: str, text: str) -> None:
    """Put ``text`` between the page's ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    doc = doc_path.read_text(encoding="utf-8")
    if begin not in doc or end not in doc:
        raise SystemExit(f"{doc_path}: no {begin} ... {end} markers")
    head, rest = doc.split(begin, 1)
    doc_path.write_text(f"{head}{begin}\n{text}{end}{rest.split(end, 1)[1]}", encoding="utf-8")


def update_doc(doc: Path, report: dict[str, Any], out: Path) -> None:
    """Replace the results between ``BEGIN`` and ``END`` in ``doc``; copy the pictures beside
    it (``images/``) when they are small enough to commit."""
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to put the results between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{markdown(report, 2)}{END}{tail}", encoding="utf-8")
    images = doc.parent / "images"
    images.mkdir(exist_ok=True)
    for name, target in DOC_IMAGES.items():
        data = (out / name).read_bytes()
        if len(data) > MAX_IMAGE_BYTES:
            print(f"{name} is {len(data)} bytes, over {MAX_IMAGE_BYTES}: not copied")
            continue
        (images / target).write_bytes(data)
    print(f"updated {doc} and {images}/")


def write_report(report: dict[str, Any], out: Path, doc: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plots(report, out)
    print()
    print(text)
    print(f"wrote {out}/results.md, results.json, throughput.png, transport.png")
    if doc is not None:
        update_doc(doc, report, out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        report = json.loads(args.render.read_text())
        write_report(report, args.out or args.render.parent, args.update_doc)
        return 0
    repeats = args.repeats or (1 if args.quick else 2)
    steps = args.steps or (30 if args.quick else 400)
    figures = {f.strip() for f in args.figures.split(",") if f.strip()}
    out = args.out or HERE / "results" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    transport_sizes = [1.0, 4.0] if args.quick else [1.0, 4.0, 16.0, 64.0, 100.0, 256.0]
    step_sizes = [1.0] if args.quick else [1.0, 4.0, 16.0, 64.0]
    tf_python = args.tf_python
    if tf_python:
        probe = subprocess.run(
            [tf_python, "-c", "import tensorflow"], capture_output=True, timeout=300
        )
        if probe.returncode != 0:
            print(f"--tf-python {tf_python}: cannot import tensorflow; TF rows not measured")
            tf_python = None
    report: dict[str, Any] = {
        "machine": machine(),
        "command": shlex.join(["python", "benchmarks/run.py", *(argv or sys.argv[1:])]),
        "steps": steps,
        "repeats": repeats,
        "quick": args.quick,
    }
    procs = Processes()
    started = time.monotonic()
    blocks: dict[str, dict[str, list[Sample] | str]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="distsgd-bench-") as tmp:
            suite = Suite(
                quick=args.quick,
                steps=steps,
                repeats=repeats,
                tf_python=tf_python,
                tmp=Path(tmp),
                procs=procs,
                timeout=120 if args.quick else 600,
            )
            if "1" in figures:
                print("figure 1: hogwild, 2 workers + 1 ps", flush=True)
                blocks["fig1"] = interleave(
                    repeats,
                    {
                        "distsgd": lambda: suite.distsgd("hogwild", 2, 1),
                        "tf": lambda: suite.tf(2),
                        "nowal": suite.hogwild_wal_off,  # row 1b: the log's cost
                    },
                    "1",
                )
            if "2" in figures:
                print("figure 2: hogwild, 1 worker + 1 ps", flush=True)
                blocks["fig2"] = interleave(
                    repeats,
                    {
                        "distsgd": lambda: suite.distsgd("hogwild", 1, 1),
                        "tf": lambda: suite.tf(1),
                        "plain": lambda: suite.plain(1),
                    },
                    "2",
                )
            if "3" in figures:
                print("figure 3: all-reduce, 2 workers", flush=True)
                blocks["fig3"] = interleave(
                    repeats,
                    {"distsgd": lambda: suite.distsgd("allreduce", 2, 0), "ddp": suite.ddp},
                    "3",
                )
            if "4" in figures:
                print("figure 4: downpour window 10, 2 workers + 1 ps", flush=True)
                blocks["fig4"] = interleave(
                    repeats,
                    {
                        "distsgd": lambda: suite.distsgd(
                            "downpour", 2, 1, options=("--window", "10")
                        ),
                        "independent": lambda: suite.plain(2),
                        # plain PyTorch in 1 process (row 4b) is figure 2's, when it runs
                        **({} if "2" in figures else {"plain": lambda: suite.plain(1)}),
                    },
                    "4",
                )
            report["rows"] = [row_report(row, blocks) for row in ROWS]
            report["transport"] = "not run (--figures)"
            if "5" in figures:
                print("figure 5: transport", flush=True)
                try:
                    report["transport"] = suite.transport(transport_sizes)
                except Failed as exc:
                    report["transport"] = f"failed: {exc}"
            report["step_sizes"] = []
            if "6" in figures:
                print("figure 6: hogwild step time against model size", flush=True)
                report["step_sizes"] = step_size_rows(suite, step_sizes, repeats)
    finally:
        procs.stop_all()
    report["machine"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    commit, source = distsgd_source()
    if source != report["machine"]["distsgd_source"]:
        report["machine"]["distsgd_commit_after"] = commit
        print(f"distsgd's source changed during the run (now {commit})", file=sys.stderr)
    tf_versions = [
        s.note.split()[-1]
        for block in blocks.values()
        for samples in [block.get("tf")]
        if isinstance(samples, list)
        for s in samples
    ]
    if tf_versions:
        report["machine"]["tensorflow"] = tf_versions[0]
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(report, out, args.update_doc)
    print(f"measured in {report['seconds']:.0f} s")
    failed = [r["key"] for r in report["rows"] if "failed" in f"{r['distsgd']} {r['reference']}"]
    failed += ["5"] if str(report["transport"]).startswith("failed") else []
    failed += [f"6 ({s['megabytes']:.0f} MB)" for s in report["step_sizes"] if s.get("failed")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def step_size_rows(suite: Suite, sizes: list[float], repeats: int) -> list[dict[str, Any]]:
    import workload

    rows = []
    for size in sizes:
        hidden = workload.hidden_for_mb(size)
        steps = 20 if suite.quick else max(10, round(200 / size**0.7))
        block = interleave(
            repeats,
            {
                "distsgd": lambda h=hidden, n=steps: suite.distsgd(
                    "hogwild", 1, 1, steps=n, hidden=h
                ),
                "plain": lambda h=hidden, n=steps: suite.plain(1, steps=n, hidden=h),
            },
            f"6 ({size:g} MB)",
        )
        a, b = block["distsgd"], block["plain"]
        row: dict[str, Any] = {
            "megabytes": workload.param_count(hidden) * 4 / MB,
            "hidden": hidden,
            "steps": steps,
            "distsgd": _ms_text(a),
            "reference": _ms_text(b),
            "split": _split_text(a),
            "failed": any(isinstance(x, str) for x in (a, b)),
        }
        if isinstance(a, list) and a:
            row["distsgd_ms"] = _median(a, "ms_per_step")
            row["distsgd_samples"] = [s.__dict__ for s in a]
        if isinstance(b, list) and b:
            row["reference_ms"] = _median(b, "ms_per_step")
            row["reference_samples"] = [s.__dict__ for s in b]
        if row.get("distsgd_ms") and row.get("reference_ms"):
            row["ratio"] = _paired_ratio(a, b)
            row["ratio_of_medians"] = row["reference_ms"] / row["distsgd_ms"]
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
