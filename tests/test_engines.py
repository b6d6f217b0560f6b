"""The engine seam (launcher/engines/): the flags choose an engine, the launcher asks the engine
and never which one it is, and an engine is one module plus one registry line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distsgd.launcher import engines
from distsgd.launcher.config import ClusterSize, Hosting, LaunchConfig
from distsgd.launcher.progress import Console
from distsgd.launcher.run import launch

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCHER = Path(engines.__file__).parent.parent


def _config(tmp_path: Path, **changes: object) -> LaunchConfig:
    return LaunchConfig(
        script=str(SCRIPTS / "blobs.py"),
        script_args=("--steps", "6"),
        scheme="hogwild",
        size=ClusterSize(workers=1, ps=1),
        hosting=Hosting(**changes),  # type: ignore[arg-type]
        run_dir=tmp_path / "run",
        quiet=True,
    )


def test_the_flags_choose_the_engine(tmp_path: Path) -> None:
    local = engines.engine_for(_config(tmp_path))
    assert (local.name, local.places_tasks, local.assigns_devices) == ("local", False, False)
    ray = engines.engine_for(_config(tmp_path, ray=""))
    assert (ray.name, ray.flag, ray.places_tasks, ray.assigns_devices) == (
        "Ray",
        "--ray",
        True,
        True,
    )
    with pytest.raises(ValueError, match="Ray places its tasks itself; drop --hosts or --ray"):
        _config(tmp_path, ray="", hosts=2)


def test_no_launcher_module_outside_engines_asks_which_engine_runs() -> None:
    asks = re.compile(r"config\.ray|\.ray is|(from|import) distsgd\.launcher\.engines\.")
    found = [
        f"{path.relative_to(LAUNCHER)}:{n}"
        for path in sorted(LAUNCHER.rglob("*.py"))
        if "engines" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line) and not line.lstrip().startswith("#")
    ]
    assert found == [], "ask engines.engine_for(config) instead"


def test_an_engine_module_is_imported_only_when_a_run_chooses_it() -> None:
    code = (
        "import sys, distsgd.launcher.run, distsgd.launcher.engines as e\n"
        "assert 'distsgd.launcher.engines.ray' not in sys.modules\n"
        "assert 'distsgd.launcher.engines.local' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


RECORDING = """
from distsgd.launcher.engines import Engine
from distsgd.launcher.engines.local import ENGINE as LOCAL

STARTED = []


def _start(config, run_dir, console):
    supervisor = LOCAL.start(config, run_dir, console)
    start = supervisor.start

    def recorded(name, argv, env):
        STARTED.append(name)
        return start(name, argv, env)

    supervisor.start = recorded
    return supervisor


ENGINE = Engine(name="recording", flag="--recording", places_tasks=False,
                assigns_devices=False, start=_start)
"""


def test_a_new_engine_is_one_module_and_one_registry_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine of the test's own (local processes, each start recorded) runs a whole run."""
    (tmp_path / "recording_engine.py").write_text(RECORDING)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "recording", "recording_engine")
    monkeypatch.setattr(engines, "engine_name", lambda config: "recording")
    outcome = launch(_config(tmp_path), Console(quiet=True))
    assert outcome.exit_code == 0, outcome
    import recording_engine  # type: ignore[import-not-found]

    assert sorted(recording_engine.STARTED) == ["ps0", "worker0"]


# -- Ray across nodes, decided without a cluster ----------------------------------------------
class _FakeRay:
    def __init__(self, alive: int) -> None:
        self.alive = alive

    def nodes(self) -> list[dict[str, object]]:
        alive = [{"NodeID": f"node{i}", "Alive": True} for i in range(self.alive)]
        return [*alive, {"NodeID": "gone", "Alive": False}]


def _plan(alive: int, bundles: list[str], spread: bool = True) -> list[tuple[list[str], str]]:
    pytest.importorskip("ray")
    from distsgd.launcher.engines.ray import RaySupervisor

    supervisor = RaySupervisor.__new__(RaySupervisor)  # no Ray: only the plan is asked
    supervisor.ray = _FakeRay(alive)
    return supervisor._plan({name: {"CPU": 1.0} for name in bundles}, spread)


def test_ray_spreads_the_servers_over_nodes_of_their_own_where_there_are_enough() -> None:
    tasks = ["ps0", "ps1", "worker0", "worker1", "worker2", "worker3"]
    assert _plan(3, tasks) == [(["ps0", "ps1"], "STRICT_SPREAD"), (tasks[2:], "SPREAD")]
    assert _plan(1, tasks) == [(["ps0", "ps1"], "SPREAD"), (tasks[2:], "SPREAD")]  # one node
    assert _plan(3, ["ps0", "worker0"]) == [(["ps0"], "SPREAD"), (["worker0"], "SPREAD")]
    assert _plan(3, ["worker0", "worker1"]) == [(["worker0", "worker1"], "SPREAD")]  # allreduce
    assert _plan(3, tasks, spread=False) == [(tasks, "STRICT_PACK")]  # --placement pack


def test_a_ray_task_binds_its_nodes_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor puts its node's address in place of the launcher's placeholder, in the
    command line and in the environment (the task's description)."""
    ray = pytest.importorskip("ray")
    from distsgd.launcher.engines.ray import NODE_HOST, TaskRunner

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "198.18.0.2")
    runner = TaskRunner()
    argv = [sys.executable, "-c", "import os, sys; print(sys.argv[1], os.environ['WHERE'])"]
    pid, node = runner.start([*argv, f"{NODE_HOST}:0"], {"WHERE": f'{{"a": "{NODE_HOST}:0"}}'})
    assert node == "198.18.0.2" and pid > 0
    runner.process.wait(timeout=30)  # type: ignore[union-attr]
    lines, code = runner.read(0)
    assert code == 0 and lines == ['198.18.0.2:0 {"a": "198.18.0.2:0"}\n']


def test_placement_is_checked_and_shapes_ray_too(tmp_path: Path) -> None:
    assert _config(tmp_path, ray="", placement="pack").hosting.placement == "pack"
    with pytest.raises(ValueError, match="--placement must be spread or pack"):
        _config(tmp_path, ray="", placement="strict")
    with pytest.raises(ValueError, match="add --hosts N"):
        _config(tmp_path, placement="pack")  # local processes on one machine: nothing to place
