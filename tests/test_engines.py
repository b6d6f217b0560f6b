"""The engine seam (launcher/engines/): the flags choose an engine, the launcher asks the engine
and never which one it is, and an engine is one module plus one registry line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distsgd.launcher import engines
from distsgd.launcher.config import LaunchConfig
from distsgd.launcher.progress import Console
from distsgd.launcher.run import launch

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCHER = Path(engines.__file__).parent.parent


def _config(tmp_path: Path, **changes: object) -> LaunchConfig:
    return LaunchConfig(
        script=str(SCRIPTS / "blobs.py"),
        script_args=("--steps", "6"),
        scheme="hogwild",
        workers=1,
        ps=1,
        run_dir=tmp_path / "run",
        quiet=True,
        **changes,  # type: ignore[arg-type]
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
