"""LaunchConfig's typed facts about a run, without starting a process: whether it is collective
(the scheme registry says, once) and what ``--resume`` takes from the saved run."""

from __future__ import annotations

from pathlib import Path

import pytest

from distsgd import schemes
from distsgd.cluster import ClusterSpec
from distsgd.launcher.argv import worker_task
from distsgd.launcher.config import ClusterSize, LaunchConfig

SCRIPT = str(Path(__file__).parent / "scripts" / "blobs.py")


@pytest.mark.parametrize("name", schemes.names())
def test_collective_comes_from_the_scheme_registry(name: str) -> None:
    """A run is collective when its scheme has no server half; its default ps count follows."""
    spec = schemes.get(name)
    config = LaunchConfig(script=SCRIPT, scheme=name)
    assert config.collective is spec.collective is (spec.server is None)
    assert config.num_ps == (0 if config.collective else 1)


def test_a_ps_run_with_more_servers_is_not_collective() -> None:
    assert not LaunchConfig(script=SCRIPT, scheme="hogwild", size=ClusterSize(ps=3)).collective
    assert LaunchConfig(script=SCRIPT, scheme="allreduce", size=ClusterSize(ps=0)).collective


def _registered(config: LaunchConfig, *, active: int) -> int:
    spec = ClusterSpec.local(
        num_workers=config.size.highest_workers, num_ps=config.num_ps, host="127.0.0.1"
    )
    env = worker_task(
        config,
        0,
        spec=spec,
        run_dir=Path("/tmp/run"),
        run_id="r",
        rendezvous="",
        ps_address_files=[],
        active=active,
        resume=None,
    )
    return env.registered_workers


def test_an_elastic_worker_registers_by_the_run_kind() -> None:
    """An elastic collective run trains with the workers started now (its process group); a
    parameter-server one registers --workers; a fixed run registers none."""
    dynamic = {"world_size": "dynamic"}
    collective = LaunchConfig(
        script=SCRIPT, scheme="allreduce", size=ClusterSize(workers=2, max_workers=4)
    )
    ps = LaunchConfig(
        script=SCRIPT,
        scheme="hogwild",
        overrides=dynamic,
        size=ClusterSize(workers=2, max_workers=4),
    )
    assert _registered(collective, active=3) == 3
    assert _registered(ps, active=3) == 2
    assert _registered(LaunchConfig(script=SCRIPT, scheme="allreduce"), active=2) == 0


def _saved(tmp_path: Path, scheme: str, **given: int) -> Path:
    """A run folder holding the RunSpec of a launch with ``given``."""
    config = LaunchConfig(script=SCRIPT, run_dir=tmp_path, scheme=scheme, size=ClusterSize(**given))
    config.run_spec(run_id="abc").save(tmp_path)
    return tmp_path


def test_a_resumed_elastic_run_keeps_its_saved_bounds(tmp_path: Path) -> None:
    """--resume without --min-workers/--max-workers (0 from the command line) comes back with
    the saved bounds: an elastic run stays elastic."""
    run_dir = _saved(tmp_path, scheme="allreduce", workers=2, min_workers=1, max_workers=4)
    resumed = LaunchConfig.resumed(run_dir, min_workers=0, max_workers=0)
    size = resumed.size
    assert (size.lowest_workers, size.workers, size.highest_workers) == (1, 2, 4)
    assert size.elastic and resumed.resume and resumed.run_id == "abc"
    assert LaunchConfig.resumed(run_dir).size.highest_workers == 4  # not given at all: the same


def test_bounds_given_on_resume_replace_the_saved_ones(tmp_path: Path) -> None:
    run_dir = _saved(tmp_path, scheme="allreduce", workers=2, min_workers=1, max_workers=4)
    resumed = LaunchConfig.resumed(run_dir, min_workers=2, max_workers=3)
    assert (resumed.size.lowest_workers, resumed.size.highest_workers) == (2, 3)
    fixed = LaunchConfig.resumed(run_dir, min_workers=2, max_workers=2)
    assert not fixed.size.elastic


def test_a_resumed_fixed_run_stays_fixed(tmp_path: Path) -> None:
    run_dir = _saved(tmp_path, scheme="allreduce", workers=2)
    resumed = LaunchConfig.resumed(run_dir, min_workers=0, max_workers=0)
    assert not resumed.size.elastic and resumed.size.highest_workers == 2
