"""``distsgd agent`` (launcher/agent.py): one machine's tasks started, restarted in place when
they die (a worker continues where its pushes stopped, a server from its write-ahead log at its
port), and stopped once the run is over; SIGTERM stops every task it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from conftest import distsgd_cmd, metrics, wait_for

from distsgd.cluster import ClusterSpec, Role, TaskId
from distsgd.launcher.agent import Agent, AgentConfig, parse_tasks, task_argv
from distsgd.transport import write_secret_file

DIGITS = str(Path(__file__).resolve().parents[1] / "src" / "distsgd" / "demo" / "digits.py")
SPEC = ClusterSpec.from_dict({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0", "127.0.0.1:0"]})


def _config(**overrides: object) -> AgentConfig:
    fields: dict[str, object] = {
        "tasks": parse_tasks("worker:1,ps:0"),
        "spec": SPEC,
        "cluster_args": ("--cluster", "c.json"),
        "worker_args": ("--scheme", "hogwild", "train.py"),
        "python": ("py",),
        "folder": Path("d"),
    }
    return AgentConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def test_tasks_parse_servers_first_and_bad_ones_are_refused_in_one_line() -> None:
    assert parse_tasks("worker:1, ps:0,worker:0") == (
        TaskId(job=Role.PS, index=0),
        TaskId(job=Role.WORKER, index=0),
        TaskId(job=Role.WORKER, index=1),
    )
    with pytest.raises(ValueError, match="--tasks 'chief:0'"):
        parse_tasks("chief:0")
    with pytest.raises(ValueError, match="out of range"):
        _config(tasks=parse_tasks("worker:2"))
    with pytest.raises(ValueError, match="twice"):
        _config(tasks=parse_tasks("worker:1,worker1"))
    with pytest.raises(ValueError, match="needs its script"):
        _config(worker_args=())


def test_a_restarted_task_starts_from_its_own_newest_state() -> None:
    config = _config()
    ps, worker = config.tasks
    first = task_argv(config, ps, again=False)
    assert first[:6] == ["py", "server", "--job", "ps", "--task", "0"]
    assert "--restore-latest" not in first and "--address" not in first
    again = task_argv(config, ps, again=True, address="127.0.0.1:7")
    assert "--restore-latest" in again and again[again.index("--address") + 1] == "127.0.0.1:7"
    assert again[again.index("--wal-dir") + 1] == str(Path("d/wal/ps0"))
    assert task_argv(config, worker, again=True) == [
        "py", "worker", "--task", "1", "--cluster", "c.json", "--scheme", "hogwild", "train.py",
    ]  # fmt: skip
    resumed = task_argv(_config(resume_workers=True), worker, again=True)
    assert "--resume-latest" in resumed


def test_the_agent_gives_its_tasks_a_thread_budget_as_run_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without one, each worker's torch took every core, and two workers and a server on one
    machine spun their thread pools against each other (the restart test below: 87 CPU-s
    against 28 on a loaded 2-core machine): the cores left after one per server, shared out
    among the workers; one for a server."""
    monkeypatch.setattr(os, "cpu_count", lambda: 9)
    tasks = parse_tasks("ps:0,worker:0,worker:1")
    agent = Agent(_config(tasks=tasks, folder=tmp_path), echo=print, note=print, run_over=bool)
    threads = {"DISTSGD_THREADS": "4", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert threads.items() <= agent.envs[Role.WORKER].items()
    assert agent.envs[Role.PS]["DISTSGD_THREADS"] == "1"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    lone = Agent(_config(tasks=tasks, folder=tmp_path), echo=print, note=print, run_over=bool)
    assert lone.envs[Role.WORKER]["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("DISTSGD_THREADS", "3")  # a budget the user gave stands
    own = Agent(_config(tasks=tasks, folder=tmp_path), echo=print, note=print, run_over=bool)
    assert own.envs[Role.WORKER]["OMP_NUM_THREADS"] == "3"


def _agent(tmp: Path, *extra: str, tasks: str = "ps:0,worker:0,worker:1") -> subprocess.Popen[str]:
    env = {**os.environ, "DISTSGD_SECRET_FILE": str(tmp / "run.secret")}
    write_secret_file(tmp / "run.secret")
    argv = distsgd_cmd(
        "agent", "--tasks", tasks, "--dir", str(tmp / "agent"),
        "--ps-hosts", "127.0.0.1:0", "--worker-hosts", "127.0.0.1:0,127.0.0.1:0", "--",
        "--scheme", "hogwild", "--run-dir", str(tmp / "run"), *extra, DIGITS,
    )  # fmt: skip
    return subprocess.Popen(
        argv, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _pids(tmp: Path) -> dict[str, int]:
    try:
        return json.loads((tmp / "agent" / "tasks.json").read_text())
    except (OSError, ValueError):
        return {}


def _stepped(tmp: Path, task: str, step: int) -> bool:
    return any(r.get("task") == task and r.get("step", 0) >= step for r in metrics(tmp / "run"))


@pytest.mark.slow  # about 20 s
def test_the_agent_restarts_a_killed_worker_and_server_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path, "--epochs", "10")
    try:
        # every 0.5 s: each look parses the whole metrics.jsonl
        assert wait_for(lambda: _stepped(tmp_path, "worker1", 20), 90, interval=0.5)
        first = _pids(tmp_path)
        os.kill(first["worker1"], signal.SIGKILL)
        assert wait_for(lambda: _pids(tmp_path).get("worker1") != first["worker1"], 30)
        os.kill(first["ps0"], signal.SIGKILL)
        out, err = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, out[-3000:] + err[-3000:]
    out += err
    assert "[agent] worker1 died (exit code -9); restart 1 of 3" in out
    assert "[agent] ps0 died (exit code -9); restart 1 of 3" in out
    assert "worker1: continues at local step" in out
    assert "recovered from" in out  # the server, from its log, at its port
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    # 10 epochs: 0.975-0.983 alone, 0.964 and 0.972 two at once (2026-12-07); at 8 a CI run
    # once scored 0.914, and 0.947-0.958 at 6 with both kills
    assert result["test_accuracy"] >= 0.93
    assert not any(psutil.pid_exists(pid) for pid in _pids(tmp_path).values())


def test_sigterm_stops_every_task_of_the_agent(tmp_path: Path) -> None:
    """A machine with a server only: it serves until the run is over, or SIGTERM."""
    agent = _agent(tmp_path, tasks="ps:0")
    try:
        assert wait_for(lambda: (tmp_path / "agent" / "ps0.address").exists(), 60)
        pids = _pids(tmp_path)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 143, out[-2000:] + err[-2000:]
    assert "interrupted; stopped 1 tasks" in out + err
    assert list(pids) == ["ps0"]
    assert not any(psutil.pid_exists(pid) for pid in pids.values())


def test_the_readme_agent_commands_parse() -> None:
    """The guide's agent lines (docs/guide/many-machines.md, once the README's) are real command
    lines (tests above run the agent itself)."""
    import re
    import shlex

    from distsgd.cli.parser import build_parser, parse_argv

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "many-machines.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "distsgd agent" in b)
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(lines) == 3
    for line in lines:
        args = parse_argv(build_parser(), shlex.split(line)[1:])
        assert args.command == "agent" and parse_tasks(args.tasks)
