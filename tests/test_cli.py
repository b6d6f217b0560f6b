"""The command line: bad input gets one line naming the cause and the fix, and exit code 2."""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import loadclock
import pytest
from conftest import SCRIPTS, run_distsgd, wait_for

from distsgd.cli.main import main as cli_main

BLOBS = str(SCRIPTS / "blobs.py")


def _distsgd(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``distsgd ARGS`` by the CLI's main in this process (in ``cwd``), its output captured: a
    command refused before it starts anything, without a command line of its own (each cost
    a CPU-second). test_task_index_out_of_range and
    test_a_command_line_mistake_is_one_line_with_a_hint run the real command for theirs."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(args)
    except SystemExit as exc:  # argparse's exit, as the command's
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["distsgd", *args], code, out.getvalue(), err.getvalue())


def _error_line(done) -> str:  # type: ignore[no-untyped-def]
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("distsgd: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--scheme", "sync", "--ps", "0", BLOBS], "--ps 1"),
        (["run", "--scheme", "allreduce", "--ps", "2", BLOBS], "--ps 0"),
        (["run", "--scheme", "sync", "--tau", "3", BLOBS], "--tau is an option of easgd"),
        (["run", "--scheme", "sync", "--backup-workers", "2", BLOBS], "backup_workers=2"),
        (["run", "--workers", "0", BLOBS], "--workers"),
        (["run", "missing_script.py"], "missing_script.py not found"),
        (["run", "."], "is a folder"),
        (["run", "--checkpoint-every", "often", BLOBS], "0 (off)"),
        (["run", "--lr", "-1", BLOBS], "lr must be positive"),
        (["run", "--scheme", "downpour", "--window", "0", BLOBS], "window must be at least 1"),
    ],
)
def test_bad_run_arguments(args: list[str], needle: str, tmp_path: Path) -> None:
    line = _error_line(_distsgd(args, cwd=tmp_path))
    assert needle in line


class _Absent(importlib.abc.MetaPathFinder):
    """Finds ``package`` (and its modules) nowhere, as where it is not installed."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.split(".")[0] == self.package:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.parametrize(
    ("package", "args"),
    [
        ("distsgd_compare", ["compare", "--schemes", "sync", "--out", "o", BLOBS]),
        ("distsgd_k8s", ["k8s", "render", "out", BLOBS]),
    ],
)
def test_a_command_whose_package_is_missing_says_so_in_one_line(
    package: str, args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The two commands outside the core (extras/) without their package: exit 2, one line
    naming it and the fix, and nothing written."""
    for name in [n for n in sys.modules if n.split(".")[0] == package]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Absent(package), *sys.meta_path])
    line = _error_line(_distsgd(args, cwd=tmp_path))
    assert f"needs the {package} package, which is not installed" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("cluster", "needle"),
    [
        ({"ps": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5000"]}, "give each task its own port"),
        ({"ps": ["127.0.0.1:5000"], "worker": []}, "no worker"),
        ({"ps": ["127.0.0.1:99999"], "worker": ["127.0.0.1:1"]}, "bad port"),
        ({"evaluator": ["a:1"], "worker": ["127.0.0.1:1"]}, "unknown job 'evaluator'"),
    ],
)
def test_bad_cluster_spec(cluster: dict, needle: str, tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster))
    line = _error_line(_distsgd(["server", "--job", "ps", "--task", "0", "--cluster", str(path)]))
    assert needle in line


def test_task_index_out_of_range(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[cluster]\nps = ["127.0.0.1:0"]\nworker = ["127.0.0.1:0"]\n')
    line = _error_line(run_distsgd(["server", "--task", "3", "--cluster", str(path)]))
    assert "out of range" in line


def test_help_scheme_alone_lists_the_catalogue() -> None:
    done = _distsgd(["run", "--help-scheme"])
    assert done.returncode == 0
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == [
        "sync",
        "hogwild",
        "downpour",
        "agn",
        "sagn",
        "easgd",
        "eamsgd",
        "allreduce",
        "dynsgd",
        "localsgd",
        "diloco",
        "asyncdiloco",
    ]


@pytest.mark.slow
def test_manual_cluster_with_server_and_worker_commands(spawn, tmp_path: Path) -> None:
    """The seed's way: one `server` per ps task and one `worker` per worker, TF_CONFIG style."""
    addr_file = tmp_path / "ps0.address"
    init = tmp_path / "init.json"
    init.write_text(json.dumps({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0", "127.0.0.1:0"]}))
    server = spawn(
        [
            "server",
            "--job_name",
            "ps",
            "--task_index",
            "0",
            "--cluster",
            str(init),
            "--address-file",
            str(addr_file),
        ]
    )
    assert wait_for(addr_file.exists, 30), "ps did not report its address"
    ps_address = addr_file.read_text().strip()
    cluster = {"ps": [ps_address], "worker": ["127.0.0.1:0", "127.0.0.1:0"]}
    run_dir = tmp_path / "run"
    workers = []
    for i in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        workers.append(
            spawn(
                [
                    "worker",
                    "--scheme",
                    "hogwild",
                    "--run-dir",
                    str(run_dir),
                    BLOBS,
                    "--steps",
                    "30",
                ],
                env={"TF_CONFIG": tf_config},
            )
        )
    for w in workers:
        out, _ = loadclock.communicate(w, 120)
        assert w.returncode == 0, out
    assert json.loads((run_dir / "result.json").read_text())["test_accuracy"] > 0.5
    os.kill(server.pid, signal.SIGTERM)
    out, _ = loadclock.communicate(server, 20)
    assert server.returncode == 0, out
    assert "stopping" in out


def test_run_folder_of_an_earlier_run_is_not_reused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    line = _error_line(_distsgd(["run", "--run-dir", str(tmp_path), BLOBS]))
    assert "holds an earlier run" in line and f"--resume {tmp_path}" in line


def test_resume_refuses_options_it_would_ignore(tmp_path: Path) -> None:
    line = _error_line(_distsgd(["run", "--resume", str(tmp_path), "--workers", "4", BLOBS]))
    assert "drop SCRIPT, --workers" in line


def test_resume_of_a_folder_that_is_no_run(tmp_path: Path) -> None:
    line = _error_line(_distsgd(["run", "--resume", str(tmp_path)]))
    assert "not a distsgd run folder" in line


@pytest.mark.slow
def test_a_failed_task_is_reported_on_stderr(tmp_path: Path) -> None:
    """Run-time failures go to standard error like argument errors, with the task named."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import torch, torch.nn.functional as F, distsgd\n"
        "calls = 0\n"
        "def loss(out, y):  # fails at the third step, once training runs\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 3:\n"
        "        raise RuntimeError('no data here')\n"
        "    return F.cross_entropy(out, y)\n"
        "x = torch.randn(64, 4)\n"
        "data = (x, (x[:, 0] > 0).long())\n"
        "distsgd.train(model=torch.nn.Linear(4, 2), loss_fn=loss, train_data=data)\n"
    )
    done = run_distsgd(
        ["run", "--max-restarts", "0", "--quiet", "--run-dir", str(tmp_path / "run"), str(script)]
    )
    assert done.returncode == 1
    assert re.search(r"distsgd: error: task worker\d failed \(exit code 1\)", done.stderr)
    assert "distsgd: error" not in done.stdout


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("import distsgd\nx = (\n", "(SyntaxError at line 2: '(' was never closed)"),
        ("import no_such_module_here\n", "(ModuleNotFoundError at line 1: No module named"),
        ("raise SystemExit('no data here')\n", "(exit: no data here)"),
        ("import sys\nsys.exit(2)\n", "(exit code 2)"),
        ("x = 1\n", "finished without calling distsgd.train() or making a distsgd.Worker"),
        ("import sys\nsys.exit(0)\n", "finished without calling distsgd.train() or making"),
    ],
    ids=["syntax", "import", "exit-text", "exit-code", "no-train", "exit-0"],
)
def test_a_script_that_fails_before_training_stops_the_run_without_restarts(
    tmp_path: Path, source: str, says: str
) -> None:
    """Its own code failed (the same again on a restart): one line, exit 1, no restart."""
    script = tmp_path / "early.py"
    script.write_text(source)
    done = run_distsgd(
        ["run", "--workers", "2", "--quiet", "--run-dir", str(tmp_path / "run"), str(script)]
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distsgd: error: worker") and says in last, done.stderr
    assert "restart" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--hosts", "4", "--workers", "2", BLOBS], "use --hosts 3 or fewer"),
        (["run", "--link", "1gbit", BLOBS], "add --hosts N"),
        (["run", "--placement", "pack", BLOBS], "add --hosts N"),
        (["demo", "--hosts", "2", "--ray"], "drop --hosts or --ray"),
        (["run", "--hosts", "2", "--link", "fast", BLOBS], "fast"),
        (["run", "--hosts", "2", "--link", "worker7=1gbit", BLOBS], "worker7"),
    ],
)
def test_bad_host_flags(args: list[str], needle: str, tmp_path: Path) -> None:
    line = _error_line(_distsgd(args, cwd=tmp_path))
    assert needle in line


def test_a_fault_set_past_the_end_of_the_run_is_reported(tmp_path: Path) -> None:
    done = run_distsgd(
        [
            "run",
            "--quiet",
            "--inject-fault",
            "kill:worker:1@step=99999",
            "--run-dir",
            str(tmp_path / "run"),
            BLOBS,
        ]
    )
    assert done.returncode == 0, done.stderr
    assert (
        "distsgd: warning: --inject-fault kill:worker:1@step=99999 was never injected: the run "
        "ended at global step"
    ) in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["run", "--scheme", "hogwld", BLOBS],
            "invalid choice: 'hogwld' (did you mean 'hogwild'?)",
        ),
        (["run", "--workers", "two", BLOBS], "argument --workers: invalid int value: 'two'"),
        (["frobnicate"], "invalid choice: 'frobnicate' (choose from run, demo,"),
        (["run", "--placment", "pack", BLOBS], "unrecognized arguments: --placment"),
    ],
)
def test_a_command_line_mistake_is_one_line_with_a_hint(args: list[str], says: str) -> None:
    done = run_distsgd(args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].endswith(" --help"), done.stderr


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("UNAUTHENTICATED", "(UNAUTHENTICATED): missing or wrong run secret"),
        ("UNAVAILABLE", "; check that a server listens at 127.0.0.1:9"),
        ("DEADLINE_EXCEEDED", "; the other tasks of the run must start within the wait"),
    ],
)
def test_a_refused_or_unreachable_server_is_an_error_not_a_bug(
    code: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import grpc

    from distsgd.cli import main as cli_main
    from distsgd.transport.errors import RemoteError

    def fails(args: object, argv: object) -> int:
        message = "missing or wrong run secret" if code == "UNAUTHENTICATED" else "no answer"
        raise RemoteError("127.0.0.1:9", "Register", grpc.StatusCode[code], message)

    monkeypatch.setattr(cli_main, "_dispatch", fails)
    assert cli_main.main(["doctor", "run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distsgd: error: Register on parameter server 127.0.0.1:9 failed")
    assert says in err and "a bug" not in err and err.count("\n") == 1


# -- the surface of distsgd run: core flags in --help, every flag frozen ---------------------
RUN_FLAGS = (
    "--alpha",
    "--backup-workers",
    "--batch-size",
    "--checkpoint-every",
    "--delta",
    "--device",
    "--doctor-after",
    "--dylu",
    "--dynamic-graph",
    "--epochs",
    "--eval-batch-size",
    "--eval-every",
    "--evict-after",
    "--fork-server",
    "--fragments",
    "--help",
    "--help-all",
    "--help-scheme",
    "--hosts",
    "--inject-fault",
    "--inner-lr",
    "--inner-steps",
    "--link",
    "--loader-workers",
    "--local-optimizer",
    "--log-every",
    "--lr",
    "--lr-cut",
    "--lr-rule",
    "--lr-schedule",
    "--max-restarts",
    "--max-rollbacks",
    "--max-workers",
    "--merge",
    "--metrics-address",
    "--min-workers",
    "--momentum",
    "--nesterov-period",
    "--nonfinite",
    "--outer-lr",
    "--outer-momentum",
    "--overlap",
    "--overlap-steps",
    "--param-placement",
    "--period",
    "--placement",
    "--powersgd-rank",
    "--powersgd-start",
    "--ps",
    "--pull-dtype",
    "--quiet",
    "--ray",
    "--rebalance",
    "--replicas-to-aggregate",
    "--resume",
    "--run-dir",
    "--scheme",
    "--seed",
    "--server-lr",
    "--shared-memory",
    "--staleness",
    "--step-timeout",
    "--steps",
    "--switch-step",
    "--tau",
    "--tensor-socket",
    "--threads",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--topk",
    "--validation",
    "--wal",
    "--warmup",
    "--weight-decay",
    "--window",
    "--wire-dtype",
    "--worker-lrs",
    "--workers",
    "--world-size",
)
"""Every flag of ``distsgd run``: a flag added or removed changes this on purpose (issue 39)."""

COMMANDS = (
    "run",
    "demo",
    "compare",
    "plan",
    "server",
    "worker",
    "agent",
    "elastic",
    "doctor",
    "k8s",
)
"""Every subcommand of ``distsgd``, in its --help's order: at most 10, and one added or removed
changes this on purpose (issue 39; ``hosts`` is ``distsgd-emulate hosts``)."""


def test_the_subcommands_are_frozen() -> None:
    from distsgd.cli.parser import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert tuple(commands) == COMMANDS and len(COMMANDS) <= 10


def test_run_help_shows_the_core_flags_and_help_all_every_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from distsgd.cli.main import main
    from distsgd.cli.parser import RUN_CORE, build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    every = sorted(s for a in run._actions for s in a.option_strings if s.startswith("--"))
    assert tuple(every) == RUN_FLAGS
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = set(re.findall(r"^  (-[-\w]+)", capsys.readouterr().out, flags=re.MULTILINE))
    assert shown == {*RUN_CORE, "-h", "--help-all"} and len(shown) <= 15
    with pytest.raises(SystemExit):
        main(["run", "--help-all"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in RUN_FLAGS if flag != "--help")
