"""The live run view (control/run_view.py) folded from a synthetic ``metrics.jsonl``, its
Prometheus exposition (control/prometheus.py) and ``distsgd top``'s table (control/run_top.py),
drawn under tmux by :func:`~distsgd.control.run_top.watch`."""

from __future__ import annotations

import io
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import synthetic_run
from conftest import ROOT, alive, wait_for

from distsgd.control.prometheus import render
from distsgd.control.run_top import CLEAR, render_top, watch
from distsgd.control.run_view import LiveView, MetricsFollower, RunView, Straggler

NOW = 1_700_000_000.0
FAMILIES = (
    "distsgd_up",
    "distsgd_run_diverged",
    "distsgd_global_step",
    "distsgd_tasks",
    "distsgd_events_total",
    "distsgd_last_record_timestamp_seconds",
    "distsgd_last_step_timestamp_seconds",
    "distsgd_task_up",
    "distsgd_step",
    "distsgd_local_step",
    "distsgd_samples_per_second",
    "distsgd_loss",
    "distsgd_mean_staleness",
    "distsgd_samples_total",
    "distsgd_sent_bytes_total",
    "distsgd_received_bytes_total",
    "distsgd_task_faults_total",
    "distsgd_phase_seconds_total",
    "distsgd_phase_ratio",
    "distsgd_ps_pushes_per_second",
    "distsgd_ps_pulls_per_second",
    "distsgd_ps_push_bytes_per_second",
    "distsgd_ps_pull_bytes_per_second",
    "distsgd_ps_busy_ratio",
)
"""Every family :func:`render` writes (and ``distsgd_straggler_score`` once a detector ran)."""


def _view(tmp_path: Path) -> RunView:
    synthetic_run.write(tmp_path / "run", synthetic_run.lines(NOW))
    return LiveView(tmp_path / "run" / "metrics.jsonl", run="run").refresh()


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_view_folds_steps_events_and_loads(tmp_path: Path) -> None:
    view = _view(tmp_path)
    w0, w1 = view.tasks["worker0"], view.tasks["worker1"]
    assert [t.task for t in view.workers()] == ["worker0", "worker1"]
    assert view.global_step == 40 and dict(view.events) == {
        "membership": 1,
        "fault": 1,
        "shard_load": 1,
    }
    assert (w0.local_step, w0.step, w0.samples, w0.last_step_time) == (20, 40, 320, NOW)
    assert w0.samples_per_second == pytest.approx(304 / 1.9, rel=1e-3)
    assert w1.samples_per_second == pytest.approx(144 / 1.8, rel=1e-3)
    assert w0.recent_split == pytest.approx({"compute": 0.6, "pull": 0.2, "push": 0.2, "wait": 0})
    assert w0.phases == {"compute": 1.2, "pull": 0.4, "push": 0.4, "wait": 0.0}
    assert (w0.loss, w0.mean_staleness, w1.faults, w0.faults) == (0.047619, 0.5, 1, 0)
    assert view.servers[0].rates["busy"] == 0.125 and view.counts()["running"] == 2


def test_states_restarts_and_divergence(tmp_path: Path) -> None:
    view = _view(tmp_path)
    view.fold(
        [
            synthetic_run.step_line("worker1", NOW + 1, 2),  # restarted: its counts went back
            {"time": NOW + 2, "task": "worker0", "step": 41, "event": "finished_steps"},
            {"time": NOW + 3, "task": "launcher", "event": "worker_left", "target": "worker1"},
            {"time": NOW + 4, "task": "worker0", "event": "diverged", "reason": "loss is nan"},
        ]
    )
    w0, w1 = view.tasks["worker0"], view.tasks["worker1"]
    assert (w0.state, w1.state, w1.samples, w1.samples_per_second) == ("finished", "left", 32, None)
    assert view.divergence == "loss is nan" and view.counts() == {
        "running": 0,
        "finished": 1,
        "left": 1,
    }


def test_the_follower_reads_only_new_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.poll() == []  # no file yet
    path.write_bytes(b'{"a": 1}\nnot json\n[1]\n{"b": 2')
    assert follower.poll() == [{"a": 1}]
    assert follower.poll() == []
    with path.open("ab") as f:
        f.write(b'}\n{"c": 3}\n')
    assert follower.poll() == [{"b": 2}, {"c": 3}] and follower.offset == path.stat().st_size


def test_render_has_every_family_with_its_values(tmp_path: Path) -> None:
    text = render(_view(tmp_path))
    for name in FAMILIES:
        kind = "counter" if name.endswith("_total") else "gauge"
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text, name
    # the live view's straggler detector has looked, and names none in this even run
    assert "# TYPE distsgd_straggler_score gauge\n" in text
    assert "distsgd_straggler_score{" not in text
    got = _samples(text)
    w0 = 'run="run",task="worker0"'
    assert got[f"distsgd_last_step_timestamp_seconds{{{w0}}}"] == NOW
    assert got[f"distsgd_samples_total{{{w0}}}"] == 320
    assert got[f"distsgd_samples_per_second{{{w0}}}"] == pytest.approx(304 / 1.9, rel=1e-3)
    assert got[f'distsgd_phase_seconds_total{{{w0},phase="compute"}}'] == 1.2
    assert got[f'distsgd_phase_ratio{{{w0},phase="pull"}}'] == pytest.approx(0.2)
    assert got['distsgd_ps_push_bytes_per_second{run="run",ps="ps0"}'] == 250_000
    assert got['distsgd_task_faults_total{run="run",task="worker1"}'] == 1
    assert got['distsgd_events_total{run="run",event="shard_load"}'] == 1
    assert got['distsgd_up{run="run"}'] == 1 and got['distsgd_global_step{run="run"}'] == 40
    assert got['distsgd_tasks{run="run",state="running"}'] == 2


def test_labels_and_help_are_escaped_and_odd_values_spelled() -> None:
    view = RunView(run='a"b\\c\nd')
    view.fold([{"time": 1.5, "task": "worker0", "samples": 0, "loss": math.nan}])
    view.stragglers = [
        Straggler(task="worker0", score=math.inf, cause='slow "disk"\\', chronic=True)
    ]
    text = render(view)
    assert 'distsgd_up{run="a\\"b\\\\c\\nd"} 1\n' in text
    assert 'distsgd_loss{run="a\\"b\\\\c\\nd",task="worker0"} NaN\n' in text
    assert 'cause="slow \\"disk\\"\\\\",chronic="true"} +Inf\n' in text
    assert "# TYPE distsgd_straggler_score gauge\n" in text
    assert all("\n" not in line for line in text.splitlines())


def test_promtool_finds_the_exposition_valid(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or ROOT / ".ci-prometheus" / "usr" / "bin" / "promtool"
    if not Path(promtool).is_file():
        pytest.skip("promtool is not installed (.ci/run unpacks it into .ci-prometheus/)")
    view = _view(tmp_path)
    view.stragglers = [Straggler(task="worker1", score=2.5, cause="compute")]
    done = subprocess.run(
        [str(promtool), "check", "metrics"], input=render(view), text=True, capture_output=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_top_table(tmp_path: Path) -> None:
    view = _view(tmp_path)
    view.stragglers = [Straggler(task="worker1", score=2.5, cause="compute", chronic=True)]
    text = render_top(view, width=120, now=NOW + 5)
    lines = text.splitlines()
    assert lines[0].startswith("distsgd top  run run  step 40  workers: 2 running  240 samples/s")
    w0 = next(line for line in lines if line.startswith("worker0"))
    assert re.search(r"worker0 +running +40 +20 +160 +0\.0476 +0\.50 +5s  cmp 60% pull 20%", w0)
    assert any(re.match(r"ps0 +12\.5 +12\.0 +0\.25 +0\.50 +0\.12", line) for line in lines)
    assert "  worker1    score 2.50  cause compute  (chronic)" in lines
    assert lines[-1] == "events: fault 1, membership 1, shard_load 1"
    assert max(len(line) for line in render_top(view, width=40).splitlines()) == 40


def test_watch_redraws_until_stopped(tmp_path: Path) -> None:
    synthetic_run.write(tmp_path / "run", synthetic_run.lines())
    out, stop = io.StringIO(), threading.Event()
    thread = threading.Thread(target=watch, args=(tmp_path / "run", out, 0.05, stop))
    thread.start()
    assert wait_for(lambda: out.getvalue().count("distsgd top") >= 2, 10)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and CLEAR not in out.getvalue()  # not a terminal: no clearing


@pytest.mark.skipif(not Path("/usr/bin/tmux").exists(), reason="tmux is not installed")
def test_watch_draws_in_place_on_a_terminal_under_tmux(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    synthetic_run.write(run_dir, synthetic_run.lines())
    tmux = ["/usr/bin/tmux", "-L", f"distsgd-test-{uuid.uuid4().hex[:12]}", "-f", "/dev/null"]
    code = (
        "import sys; from distsgd.control.run_top import watch; watch(sys.argv[1], sys.stdout, 0.2)"
    )
    command = " ".join([sys.executable, "-c", f"'{code}'", str(run_dir)])
    env = {**os.environ, "TERM": "xterm"}
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "160", "-y", "40", command],
        check=True,
        env=env,
        timeout=10,
    )

    def pane() -> str:
        done = subprocess.run(
            [*tmux, "capture-pane", "-p"], capture_output=True, text=True, timeout=10
        )
        return done.stdout

    pid = None
    try:
        shown = subprocess.run(
            [*tmux, "display", "-p", "#{pane_pid}"], capture_output=True, text=True, timeout=10
        )
        pid = int(shown.stdout)
        assert wait_for(lambda: "worker1" in pane(), 20), pane()
        first = pane()
        assert first.startswith("distsgd top  run run  step 40") and first.count("distsgd top") == 1
        synthetic_run.write(run_dir, [synthetic_run.step_line("worker2", time.time(), 7)], mode="a")
        assert wait_for(lambda: "worker2" in pane(), 10), pane()
        assert pane().count("distsgd top") == 1  # redrawn in place, not scrolled
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)  # this test's own server only
    assert pid is not None and wait_for(lambda: alive([pid]) == [], 10), "watch outlived tmux"
