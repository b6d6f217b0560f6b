"""LaunchConfig's typed facts about a run, without starting a process: whether it is collective
(the scheme registry says, once) and what ``--resume`` takes from the saved run."""

from __future__ import annotations

from pathlib import Path

import pytest

from distsgd import schemes
from distsgd.cluster import ClusterSpec
from distsgd.launcher.argv import worker_task
from distsgd.launcher.config import LaunchConfig

SCRIPT = str(Path(__file__).parent / "scripts" / "blobs.py")


@pytest.mark.parametrize("name", schemes.names())
def test_collective_comes_from_the_scheme_registry(name: str) -> None:
    """A run is collective when its scheme has no server half; its default ps count follows."""
    spec = schemes.get(name)
    config = LaunchConfig(script=SCRIPT, scheme=name)
    assert config.collective is spec.collective is (spec.server is None)
    assert config.num_ps == (0 if config.collective else 1)


def test_a_ps_run_with_more_servers_is_not_collective() -> None:
    assert not LaunchConfig(script=SCRIPT, scheme="hogwild", ps=3).collective
    assert LaunchConfig(script=SCRIPT, scheme="allreduce", ps=0).collective


def _registered(config: LaunchConfig, *, active: int) -> int:
    spec = ClusterSpec.local(
        num_workers=config.highest_workers, num_ps=config.num_ps, host="127.0.0.1"
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
    collective = LaunchConfig(script=SCRIPT, scheme="allreduce", workers=2, max_workers=4)
    ps = LaunchConfig(script=SCRIPT, scheme="hogwild", workers=2, max_workers=4, overrides=dynamic)
    assert _registered(collective, active=3) == 3
    assert _registered(ps, active=3) == 2
    assert _registered(LaunchConfig(script=SCRIPT, scheme="allreduce"), active=2) == 0
