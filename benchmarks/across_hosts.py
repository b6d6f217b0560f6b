"""The benchmark suite across emulated hosts: distsgd against TF PSS and DDP over shaped links.

    python benchmarks/across_hosts.py [--links 10gbit,1gbit,100mbit] [--rounds N] [--steps S]
        [--tf-python /tmp/tfenv/bin/python] [--out DIR]

Root only (network namespaces; docs/performance.md, section "Across hosts"). The workload is
``benchmarks/run.py``'s (the MLP 784-512-512-10 of ``workload.py``, one thread per process).
For each link speed, every task runs on an emulated host of its own, each host's link shaped to
that speed (``distsgd_emulate.netns``):

- block ``ps``: Hogwild, sync and DOWNPOUR (window 10), 2 workers + 1 ps (``distsgd run
  --hosts 3 --link RATE``: ps0 on host0, the workers on host1 and host2), against TensorFlow's
  ParameterServerStrategy with its ps on host0 and its workers on host1 and host2
  (``tf_pss.py --placement``; its chief, the coordinator, in this namespace, reaching the hosts
  over the unshaped management link, as distsgd's launcher does: it is a machine of its own in
  a real cluster, and on host0 its dispatches would share the ps's link);
- block ``allreduce``: all-reduce, 2 workers on 2 hosts, against PyTorch DDP (gloo), one rank
  on each of 2 hosts (``reference.py ddp --address``);
- block ``best`` (at ``--best-link``, default 100mbit): the ``CANDIDATES`` each measured once,
  then the fastest of them against TF PSS, A B A B.

Each block runs its measures in turn, A B A B (``--rounds``); a figure is the median over the
rounds, with the ratio distsgd / reference paired within each round, then the median. Rates
are worker-steps per second from each loop's own time (``finished_steps`` in metrics.jsonl; the
references' own timing), as ``run.py`` takes them. Bytes per step per link: what each host's
link carried (sent + received) over the whole run (start-up included), over the run's
worker-steps (the TF reference's warm-up steps included). Writes ``results.md``,
``results.json`` and (with matplotlib) ``throughput.png`` into ``--out``. Every process is
stopped by its PID, every namespace closed, in ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as bench  # noqa: E402  (benchmarks/run.py: its processes, samples, machine)

WORKERS = 2
DEFAULT_LINKS = ("10gbit", "1gbit", "100mbit")
FULL_RATE_BITS = 1_000_000_000
"""At and above this rate a run takes ``--steps`` steps per worker; below, proportionally fewer."""
MIN_STEPS = 40


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One distsgd configuration of a row."""

    key: str
    """Its name in results.json."""
    label: str
    """Its name in the tables."""
    scheme: str
    """``--scheme``."""
    ps: int = 1
    """``--ps`` (each server on a host of its own; 0 for all-reduce)."""
    options: tuple[str, ...] = ()
    """Further ``distsgd run`` options."""

    @property
    def hosts(self) -> int:
        """Emulated hosts of its run: one per task (``spread`` placement)."""
        return WORKERS + self.ps

    def argv(self) -> list[str]:
        """Its ``distsgd run`` options (scheme, cluster, options), without the common ones."""
        cluster = ["--workers", str(WORKERS), *(["--ps", str(self.ps)] if self.ps else [])]
        return ["--scheme", self.scheme, *cluster, *self.options]


PS_SETTINGS = (
    Setting(key="hogwild", label="Hogwild", scheme="hogwild"),
    Setting(
        key="hogwild-overlap",
        label="Hogwild, --overlap",
        scheme="hogwild",
        options=("--overlap",),
    ),
    Setting(key="sync", label="sync", scheme="sync"),
    Setting(
        key="downpour", label="DOWNPOUR window 10", scheme="downpour", options=("--window", "10")
    ),
    Setting(
        key="hogwild-bf16x2",
        label="Hogwild, --wire-dtype bf16 --pull-dtype bf16",
        scheme="hogwild",
        options=("--wire-dtype", "bf16", "--pull-dtype", "bf16"),
    ),
    Setting(
        key="hogwild-int8-bf16",
        label="Hogwild, --wire-dtype int8 --pull-dtype bf16",
        scheme="hogwild",
        options=("--wire-dtype", "int8", "--pull-dtype", "bf16"),
    ),
)
ALLREDUCE = Setting(key="allreduce", label="all-reduce", scheme="allreduce", ps=0)
ALLREDUCE_BF16 = Setting(
    key="allreduce-bf16",
    label="all-reduce, --wire-dtype bf16",
    scheme="allreduce",
    ps=0,
    options=("--wire-dtype", "bf16"),
)
CANDIDATES = (
    Setting(key="hogwild-ps2", label="Hogwild, --ps 2", scheme="hogwild", ps=2),
    Setting(
        key="hogwild-bf16", label="Hogwild, --wire-dtype bf16", scheme="hogwild",
        options=("--wire-dtype", "bf16"),
    ),
    Setting(
        key="hogwild-topk", label="Hogwild, --topk 0.01", scheme="hogwild",
        options=("--topk", "0.01"),
    ),
    Setting(
        key="downpour-w10-ps2", label="DOWNPOUR window 10, --ps 2", scheme="downpour", ps=2,
        options=("--window", "10"),
    ),
    Setting(
        key="downpour-w10-bf16", label="DOWNPOUR window 10, --wire-dtype bf16",
        scheme="downpour", options=("--window", "10", "--wire-dtype", "bf16"),
    ),
    Setting(
        key="downpour-w50", label="DOWNPOUR window 50", scheme="downpour",
        options=("--window", "50"),
    ),
    Setting(
        key="downpour-w50-ps2-bf16", label="DOWNPOUR window 50, --ps 2, --wire-dtype bf16",
        scheme="downpour", ps=2, options=("--window", "50", "--wire-dtype", "bf16"),
    ),
)  # fmt: skip
REFERENCES = {
    "tf": "TF2 ParameterServerStrategy, 2 workers + 1 ps",
    "ddp": "PyTorch DDP (gloo), 2 ranks",
}


@dataclass(frozen=True, kw_only=True)
class Block:
    """Measures run in turn, A B A B; the last one is the reference of the others."""

    link: str
    """The link every host has (``--link``)."""
    name: str
    """``ps``, ``allreduce``, ``screen`` (candidates once each) or ``best``."""
    settings: tuple[Setting, ...]
    """The distsgd measures, in order."""
    reference: str | None
    """``tf``, ``ddp`` or None (a screen)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """Every measure, the reference last."""
        return (*(s.key for s in self.settings), *([self.reference] if self.reference else []))


def plan(links: Sequence[str], best_link: str | None) -> list[Block]:
    """The blocks of a run, in order (the ``best`` block's setting is chosen by its screen)."""
    blocks = []
    for link in links:
        blocks.append(Block(link=link, name="ps", settings=PS_SETTINGS, reference="tf"))
        blocks.append(
            Block(
                link=link,
                name="allreduce",
                settings=(ALLREDUCE, ALLREDUCE_BF16),
                reference="ddp",
            )
        )
        if link == best_link:
            blocks.append(Block(link=link, name="screen", settings=CANDIDATES, reference=None))
    return blocks


def order(keys: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, measure) in the order they run: every measure of round 1, then of round 2..."""
    return [(r, key) for r in range(rounds) for key in keys]


def steps_for(rate_bits: int, steps: int) -> int:
    """Steps per worker on a link of ``rate_bits``: ``steps`` at 1 Gbit/s and above, fewer
    below in proportion (a 100 Mbit/s Hogwild step takes tens of milliseconds), at least 40."""
    if rate_bits >= FULL_RATE_BITS:
        return steps
    return max(min(MIN_STEPS, steps), round(steps * rate_bits / FULL_RATE_BITS))


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def paired_ratio(ours: Sequence[float], reference: Sequence[float]) -> float | None:
    """Median over the rounds of ours / reference within the round (rounds both measured)."""
    ratios = [a / b for a, b in zip(ours, reference, strict=False) if b > 0]
    return statistics.median(ratios) if ratios else None


def bytes_per_step(counted: dict[str, dict[str, int]], worker_steps: int) -> dict[str, float]:
    """Bytes each host's link carried (sent + received) per worker-step, by host."""
    if worker_steps <= 0:
        return {}
    return {host: (c["sent"] + c["received"]) / worker_steps for host, c in sorted(counted.items())}


# --------------------------------------------------------------------------- measuring


@dataclass
class Measurement:
    """One run of one measure."""

    rate: float
    """Worker-steps per second, summed over the workers."""
    worker_steps: int
    """Steps of every worker together (the TF warm-up included), the divisor of ``per_step``."""
    per_step: dict[str, float] = field(default_factory=dict)
    """Bytes per worker-step over each host's link."""
    load: str = ""
    """The load average when it ended."""
    note: str = ""


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _counters(hosts: Any) -> dict[str, dict[str, int]]:
    return {n: {"sent": c.sent, "received": c.received} for n, c in hosts.counters().items()}


def _diff(
    after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    return {
        host: {k: after[host][k] - before[host][k] for k in ("sent", "received")} for host in after
    }


@dataclass
class Runner:
    """Runs one measure on emulated hosts shaped to ``link``."""

    procs: bench.Processes
    tmp: Path
    tf_python: str | None
    timeout: float
    counter: int = 0

    def folder(self, name: str) -> Path:
        self.counter += 1
        path = self.tmp / f"{self.counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def distsgd(self, setting: Setting, link: str, steps: int) -> Measurement:
        folder = self.folder(f"{setting.key}-{link}")
        run_dir = folder / "run"
        cmd = [
            sys.executable, "-m", "distsgd", "run", *setting.argv(), "--steps", str(steps),
            "--batch-size", str(bench.BATCH_SIZE), "--lr", str(bench.LR), "--threads", "1",
            "--checkpoint-every", "0", "--max-restarts", "0", "--quiet",
            "--hosts", str(setting.hosts), "--link", link,
            "--run-dir", str(run_dir), str(bench.MLP_SCRIPT),
        ]  # fmt: skip
        log = folder / "launcher.log"
        proc = self.procs.start(cmd, log)
        try:
            (code,) = self.procs.wait([proc], self.timeout)
        finally:
            bench._stop_run_tasks(run_dir, proc.pid)
        if code not in (0, 3):
            raise bench.Failed(f"distsgd run exited {code}: {bench._tail(log)}")
        done = [
            record
            for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if record.get("event") == "finished_steps" and record["task"].startswith("worker")
        ]
        if len(done) != WORKERS:
            raise bench.Failed(f"{len(done)} of {WORKERS} workers finished: {bench._tail(log)}")
        rate = sum(r["local_step"] / r["seconds"] for r in done)
        worker_steps = sum(int(r["local_step"]) for r in done)
        counted = json.loads((run_dir / "hosts.json").read_text()).get("bytes", {})
        return Measurement(
            rate=rate,
            worker_steps=worker_steps,
            per_step=bytes_per_step(counted, worker_steps),
            note="judged diverged (exit 3)" if code == 3 else "",
        )

    @contextlib.contextmanager
    def _hosts(self, count: int, link: str) -> Iterator[Any]:
        from distsgd_emulate.hosts import parse_links, plan_machines
        from distsgd_emulate.netns import EmulatedHosts

        plan_ = plan_machines(count=count, links=parse_links([link]))
        with EmulatedHosts(plan_, management=True) as hosts:
            yield hosts

    def tf(self, link: str, steps: int, warmup: int) -> Measurement:
        if not self.tf_python:
            raise bench.NotMeasured(bench.TF_MISSING)
        folder = self.folder(f"tf-{link}")
        out = folder / "tf.json"
        with self._hosts(3, link) as hosts:
            placement = {
                "chief": "198.18.0.253",
                "ps": [{"address": "198.18.0.1", "prefix": hosts.enter("host0")}],
                "worker": [
                    {"address": f"198.18.0.{i + 2}", "prefix": hosts.enter(f"host{i + 1}")}
                    for i in range(WORKERS)
                ],
            }
            (folder / "placement.json").write_text(json.dumps(placement))
            cmd = [self.tf_python, str(bench.TF_SCRIPT), "--workers", str(WORKERS)]
            cmd += ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
            cmd += ["--placement", str(folder / "placement.json")]
            before = _counters(hosts)
            proc = self.procs.start(cmd, folder / "tf.log", {"TF_CPP_MIN_LOG_LEVEL": "2"})
            (code,) = self.procs.wait([proc], max(self.timeout, 600))
            counted = _diff(_counters(hosts), before)
        if code != 0 or not out.exists():
            raise bench.Failed(f"tf_pss.py exited {code}: {bench._tail(folder / 'tf.log')}")
        result = json.loads(out.read_text())
        worker_steps = (steps + warmup) * WORKERS
        return Measurement(
            rate=float(result["worker_steps_per_second"]),
            worker_steps=worker_steps,
            per_step=bytes_per_step(counted, worker_steps),
            note=f"TensorFlow {result['tensorflow']}",
        )

    def ddp(self, link: str, steps: int) -> Measurement:
        folder = self.folder(f"ddp-{link}")
        with self._hosts(WORKERS, link) as hosts:
            procs, outs = [], []
            before = _counters(hosts)
            for rank in range(WORKERS):
                out = folder / f"rank{rank}.json"
                cmd = [*hosts.enter(f"host{rank}"), sys.executable, str(bench.REFERENCE), "ddp"]
                cmd += ["--steps", str(steps), "--rank", str(rank), "--world", str(WORKERS)]
                cmd += ["--store-file", str(folder / "store-port"), "--address", "198.18.0.1"]
                cmd += ["--out", str(out)]
                env = {"GLOO_SOCKET_IFNAME": "eth0"}
                procs.append(self.procs.start(cmd, folder / f"rank{rank}.log", env))
                outs.append(out)
            codes = self.procs.wait(procs, self.timeout)
            counted = _diff(_counters(hosts), before)
        if any(codes) or not all(out.exists() for out in outs):
            raise bench.Failed(f"ddp exited {codes}: {bench._tail(folder / 'rank0.log')}")
        ranks = [json.loads(out.read_text()) for out in outs]
        return Measurement(
            rate=sum(r["steps"] / r["seconds"] for r in ranks),
            worker_steps=steps * WORKERS,
            per_step=bytes_per_step(counted, steps * WORKERS),
        )


BUSY = ("is already on a link", "network is in use by")
"""How distsgd says that another run on emulated hosts holds the launcher's address (the
address itself, or the lock of the hosts' network, distsgd_emulate/netns_lock.py)."""
BUSY_WAIT_S, BUSY_TRIES = 5.0, 120


def _when_free(measure_once: Callable[[], Measurement]) -> Measurement:
    """``measure_once()``, tried again while another run on emulated hosts (the tests of
    others) holds the launcher's address 198.18.0.253: up to 10 minutes."""
    for _ in range(BUSY_TRIES - 1):
        try:
            return measure_once()
        except (ValueError, bench.Failed) as e:
            if not any(busy in str(e) for busy in BUSY):
                raise
            print(f"    198.18.0.253 is busy; trying again in {BUSY_WAIT_S:g} s", flush=True)
            time.sleep(BUSY_WAIT_S)
    return measure_once()


def run_block(
    block: Block, rounds: int, measures: dict[str, Callable[[], Measurement]]
) -> dict[str, list[Measurement] | str]:
    """Every measure of ``block`` in :func:`order`; one that cannot be made or fails is not
    tried again, its reason in place of its measurements."""
    out: dict[str, list[Measurement] | str] = {key: [] for key in block.keys}
    for round_, key in order(block.keys, rounds):
        got = out[key]
        if isinstance(got, str):
            continue
        started = time.monotonic()
        try:
            m = _when_free(measures[key])
        except bench.NotMeasured as e:
            out[key] = str(e)
            continue
        except (bench.Failed, ValueError, OSError, RuntimeError) as e:  # NetnsError too
            out[key] = f"failed: {e}"
            print(f"  {block.link} {key}: {out[key]}", flush=True)
            continue
        m.load = _load()
        got.append(m)
        print(
            f"  {block.link} {block.name} {key} round {round_ + 1}: {m.rate:8.1f} worker-steps/s"
            f" ({time.monotonic() - started:.0f} s, load {m.load})",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------- report


def _rates(samples: list[dict[str, Any]] | str) -> list[float]:
    return [] if isinstance(samples, str) else [s["rate"] for s in samples]


def _rate_text(samples: list[dict[str, Any]] | str) -> str:
    if isinstance(samples, str):
        return samples
    rates = _rates(samples)
    if not rates:
        return "—"
    mid = statistics.median(rates)
    return f"{mid:.1f} ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else f"{mid:.1f}"


def _bytes_text(samples: list[dict[str, Any]] | str) -> str:
    """MB per worker-step over each host's link, the median over the rounds."""
    if isinstance(samples, str) or not samples:
        return "—"
    hosts = sorted({h for s in samples for h in s["per_step"]})
    return " · ".join(
        f"{h} {statistics.median(s['per_step'].get(h, 0.0) for s in samples) / 1e6:.2f}"
        for h in hosts
    )


def block_rows(block: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per distsgd setting of a block: its rates, its reference's, the paired ratio."""
    measures = block["measures"]
    ref_key = block["reference"]
    ref = measures.get(ref_key, "—") if ref_key else "—"
    rows = []
    for key in block["settings"]:
        ours = measures[key]
        ratio = paired_ratio(_rates(ours), _rates(ref)) if ref_key else None
        rows.append(
            {
                "key": key,
                "label": block["labels"][key],
                "ours": _rate_text(ours),
                "reference": _rate_text(ref) if ref_key else "—",
                "ratio": ratio,
                "median": median_or_none(_rates(ours)),
                "ours_bytes": _bytes_text(ours),
                "reference_bytes": _bytes_text(ref) if ref_key else "—",
            }
        )
    return rows


def best_of(block: dict[str, Any]) -> str | None:
    """The screen's fastest setting (by its median rate), or None if none ran."""
    medians = {k: median_or_none(_rates(block["measures"][k])) for k in block["settings"]}
    ran = {k: v for k, v in medians.items() if v is not None}
    return max(ran, key=lambda k: ran[k]) if ran else None


def _ratio_text(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}"


TARGETS: tuple[tuple[str, str, str | None, float | None, str], ...] = (
    ("1gbit", "ps", "hogwild-int8-bf16", 1.5, "Hogwild ≥ 1.5x TF PSS at 1 Gbit/s"),
    ("1gbit", "allreduce", "allreduce-bf16", 1.0, "all-reduce ≥ 1.0x DDP at 1 Gbit/s"),
    ("100mbit", "best", None, 3.0, "best distsgd setting ≥ 3x TF PSS at 100 Mbit/s"),
    ("1gbit", "ps", "hogwild", None, "Hogwild, float32: parity expected (the same bytes)"),
    ("1gbit", "ps", "hogwild-bf16x2", None, "Hogwild, bf16 both ways"),
    ("1gbit", "allreduce", "allreduce", None, "all-reduce, float32: parity expected (DDP)"),
)
"""(link, block, row or None for each of the block's rows, goal or None, text). Each goal is
judged on one row named here before the run (the compressed setting meant for a link-bound
step); the float32 rows move the same bytes as their references and are listed, not judged."""


def targets(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, met) for each target whose block ran."""
    out = []
    for link, name, key, goal, text in TARGETS:
        for block in report["blocks"]:
            if block["link"] != link or block["name"] != name:
                continue
            for row in block_rows(block):
                if key is None or row["key"] == key:
                    ratio = row["ratio"]
                    judged = ratio is not None and goal is not None
                    met = ("yes" if ratio >= goal else "no") if judged else "—"
                    out.append((text, f"{_ratio_text(ratio)} ({row['label']})", met))
    return out


BLOCK_TITLES = {
    "ps": "2 workers + 1 ps (3 hosts; --ps 2: 4 hosts) against TF2 ParameterServerStrategy",
    "allreduce": "all-reduce, 2 workers on 2 hosts, against PyTorch DDP (gloo), 2 ranks on 2 hosts",
    "screen": "candidates for the bandwidth-bound link, one run each (no reference)",
    "best": "the screen's fastest setting against TF2 ParameterServerStrategy",
}


def markdown(report: dict[str, Any]) -> str:
    """The tables of results.md (and of docs/performance.md's "Across hosts")."""
    m = report["machine"]
    lines = [
        f"{m['date']}, distsgd {m['distsgd_commit']}; {m['cpu']}, {m['cores']} cores; "
        f"load average {m['load_before']} before, {report.get('load_after', '?')} after.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['rounds']} rounds A B A B per block; medians (min-max of the rounds), "
        "worker-steps/s summed over the workers; ratio: distsgd ÷ reference within each round, "
        "the median over the rounds. Bytes: MB per worker-step over each host's link "
        "(sent + received, the whole run).",
    ]
    for block in report["blocks"]:
        lines += [
            "",
            f"### {block['link']}: {BLOCK_TITLES[block['name']]}",
            "",
            f"{block['steps']} steps per worker; load average {block['load_before']} before, "
            f"{block['load_after']} after.",
            "",
            "| distsgd | worker-steps/s | reference | ratio | MB per step, distsgd | "
            "MB per step, reference |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in block_rows(block):
            lines.append(
                f"| {row['label']} | {row['ours']} | {row['reference']} | "
                f"{_ratio_text(row['ratio'])} | {row['ours_bytes']} | {row['reference_bytes']} |"
            )
    found = targets(report)
    if found:
        lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {t} | {got} | {met} |" for t, got, met in found]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out: Path) -> bool:
    """throughput.png: worker-steps/s against link speed, one line per measure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from distsgd.cluster.rates import parse_rate

    lines: dict[str, list[tuple[float, float]]] = {}
    for block in report["blocks"]:
        if block["name"] not in ("ps", "allreduce"):
            continue
        for key in (*block["settings"], block["reference"]):
            rate = median_or_none(_rates(block["measures"][key]))
            label = block["labels"][key]
            if rate is not None:
                lines.setdefault(label, []).append((parse_rate(block["link"]) / 1e6, rate))
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        points.sort()
        axis.plot(*zip(*points, strict=True), marker="o", label=label)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("link speed (Mbit/s), every host")
    axis.set_ylabel("worker-steps/s (2 workers)")
    axis.set_title("MLP 2.7 MB across emulated hosts")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=90)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default=",".join(DEFAULT_LINKS), help="link speeds, in turn")
    parser.add_argument("--rounds", type=int, default=2, help="rounds A B A B per block")
    parser.add_argument("--steps", type=int, default=200, help="steps per worker at >= 1gbit")
    parser.add_argument("--tf-python", help="a Python with tensorflow, for the TF PSS rows")
    parser.add_argument("--best-link", default="100mbit", help="where to screen the candidates")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/hosts-<time>/")
    parser.add_argument("--render", type=Path, help="measure nothing: report this results.json")
    parser.add_argument(
        "--update-doc",
        type=Path,
        help="put the tables between this page's markers (performance.md)",
    )
    return parser.parse_args(argv)


def _block_record(block: Block, steps: int) -> dict[str, Any]:
    labels = {s.key: s.label for s in block.settings}
    if block.reference:
        labels[block.reference] = REFERENCES[block.reference]
    return {
        "link": block.link,
        "name": block.name,
        "reference": block.reference,
        "settings": [s.key for s in block.settings],
        "labels": labels,
        "steps": steps,
        "load_before": _load(),
    }


def _measures(runner: Runner, block: Block, steps: int) -> dict[str, Callable[[], Measurement]]:
    """How to take each measure of ``block`` once."""
    out: dict[str, Callable[[], Measurement]] = {
        s.key: functools.partial(runner.distsgd, s, block.link, steps) for s in block.settings
    }
    warmup = 5 if steps < 100 else 20
    out["tf"] = functools.partial(runner.tf, block.link, steps, warmup)
    out["ddp"] = functools.partial(runner.ddp, block.link, steps)
    return out


def measure(args: argparse.Namespace, runner: Runner, report: dict[str, Any]) -> None:
    """Every block of the plan, in order, into ``report["blocks"]``."""
    from distsgd.cluster.rates import parse_rate

    links = [link.strip() for link in args.links.split(",") if link.strip()]
    blocks = plan(links, args.best_link)
    by_key = {s.key: s for s in (*PS_SETTINGS, ALLREDUCE, ALLREDUCE_BF16, *CANDIDATES)}
    while blocks:
        block = blocks.pop(0)
        steps = steps_for(parse_rate(block.link), args.steps)
        record = _block_record(block, steps)
        measures = _measures(runner, block, steps)
        rounds = 1 if block.name == "screen" else args.rounds
        got = run_block(block, rounds, measures)
        record["measures"] = {
            k: v if isinstance(v, str) else [asdict(m) for m in v] for k, v in got.items()
        }
        record["load_after"] = _load()
        report["blocks"].append(record)
        if block.name == "screen" and (best := best_of(record)) is not None:
            blocks.insert(
                0, Block(link=block.link, name="best", settings=(by_key[best],), reference="tf")
            )


BEGIN, END = "<!-- across hosts: begin -->", "<!-- across hosts: end -->"
DOC_IMAGE = "performance-across-hosts.png"


def put_between_markers(text: str, tables: str) -> str:
    """``text`` with ``tables`` in place of what stood between ``BEGIN`` and ``END``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} markers; add them where the tables go")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{tables}{END}{tail}"


def write(report: dict[str, Any], out: Path, doc: Path | None = None) -> None:
    """results.json, results.md and throughput.png into ``out``; with ``doc``, the tables
    between its markers and the picture in its ``images/`` (if under run.py's size limit)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "results.md").write_text(text)
    drawn = plot(report, out)
    print(text, flush=True)
    if doc is None:
        return
    doc.write_text(put_between_markers(doc.read_text(encoding="utf-8"), text), encoding="utf-8")
    if drawn and (out / "throughput.png").stat().st_size <= bench.MAX_IMAGE_BYTES:
        (doc.parent / "images" / DOC_IMAGE).write_bytes((out / "throughput.png").read_bytes())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        write(json.loads(args.render.read_text()), args.out or args.render.parent, args.update_doc)
        return 0
    out = args.out or HERE / "results" / datetime.now().strftime("hosts-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": bench.machine(),
        "command": shlex.join(["python", "benchmarks/across_hosts.py", *(argv or sys.argv[1:])]),
        "rounds": args.rounds,
        "blocks": [],
    }
    procs = bench.Processes()
    tmp = out / "runs"
    tmp.mkdir(exist_ok=True)
    runner = Runner(procs=procs, tmp=tmp, tf_python=args.tf_python, timeout=900)
    try:
        measure(args, runner, report)
    finally:
        procs.stop_all()
        report["load_after"] = _load()
        write(report, out, args.update_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
