"""Emulated hosts with a management link (``distsgd hosts up``, ``distsgd run --hosts``) are
named for ``ip netns``: ``ip netns list`` shows ``distsgd-host0``, ..., ``ip netns exec`` enters
them, and the names go with the hosts; a name left by a creator killed by SIGKILL is removed
when the next set starts."""

from __future__ import annotations

import subprocess

from conftest import netns_refusal, on_emulated_hosts

from distsgd_emulate.hosts import plan_machines
from distsgd_emulate.netns import EmulatedHosts
from distsgd_emulate.netns_keeper import NETNS_DIR

needs_root_netns = on_emulated_hosts(netns_refusal(root=True))


def _ip(*args: str) -> str:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def _listed() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


@needs_root_netns
def test_hosts_are_named_for_ip_netns_and_the_names_go_with_them() -> None:
    _ip("netns", "add", "distsgd-host7")  # as a creator killed by SIGKILL leaves it
    try:
        with EmulatedHosts(plan_machines(count=2), management=True) as hosts:
            assert hosts.names == {"host0": "distsgd-host0", "host1": "distsgd-host1"}
            listed = _listed()
            assert {"distsgd-host0", "distsgd-host1"} <= listed
            assert "distsgd-host7" not in listed  # left behind: removed at the start
            addresses = _ip("netns", "exec", "distsgd-host1", "ip", "-br", "addr")
            assert "198.18.0.2/24" in addresses
    finally:
        if (NETNS_DIR / "distsgd-host7").exists():
            _ip("netns", "delete", "distsgd-host7")
    assert not {"distsgd-host0", "distsgd-host1"} & _listed()
    assert hosts.names == {}


@needs_root_netns
def test_hosts_without_a_management_link_are_not_named() -> None:
    with EmulatedHosts(plan_machines(count=1)) as hosts:
        assert hosts.names == {} and "distsgd-host0" not in _listed()
