"""Every listening socket of a collective run is where the user said: the rendezvous store and
the gloo data plane on loopback for `distsgd run`, the store's keys under the run id, and a
warning for a collective rendezvous or data plane beyond loopback."""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import SCRIPTS, task_pids

from distsgd.control.rendezvous import host_store
from distsgd.runtime.collective import (
    TRUSTED_NETWORK_ENV,
    Collective,
    data_plane,
    exposure_warning,
)

WAIT = timedelta(seconds=10)


def _listening(pid: int) -> set[tuple[str, int]]:
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def test_host_store_listens_on_its_host_only() -> None:
    store, port = host_store("127.0.0.1", WAIT)
    assert port > 0
    assert ("127.0.0.1", port) in _listening(psutil.Process().pid)
    assert not [a for a in _listening(psutil.Process().pid) if a[1] == port and a[0] != "127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", port, None, False, WAIT)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_host_store_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        store, port = host_store("::1", WAIT)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    assert ("::1", port) in _listening(psutil.Process().pid)
    store.set("k", "v")
    assert dist.TCPStore("::1", port, None, False, WAIT).get("k") == b"v"


def test_host_store_refuses_a_bad_host_and_a_busy_port() -> None:
    with pytest.raises(ValueError, match=r"does not resolve.*give an IP address"):
        host_store("no-such-host.invalid", WAIT)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(OSError, match=r"cannot listen on 127.0.0.1:\d+.*free the port"):
            host_store("127.0.0.1", WAIT, port=busy.getsockname()[1])
    finally:
        busy.close()


def test_data_plane_is_the_workers_own_host_or_the_interfaces_named() -> None:
    assert data_plane("gloo", "127.0.0.1:0", {}) == ("127.0.0.1", True)
    assert data_plane("gloo", "[::1]:2222", {}) == ("::1", True)
    assert data_plane("gloo", "10.0.0.2:2222", {}) == ("10.0.0.2", False)
    where, loopback = data_plane("gloo", "0.0.0.0:2222", {})
    assert "hostname" in where and not loopback
    assert data_plane("gloo", "10.0.0.2:2222", {"GLOO_SOCKET_IFNAME": "lo"})[1]
    assert not data_plane("gloo", "127.0.0.1:0", {"GLOO_SOCKET_IFNAME": "eth0"})[1]
    assert not data_plane("nccl", "127.0.0.1:0", {})[1]
    assert data_plane("nccl", "127.0.0.1:0", {"NCCL_SOCKET_IFNAME": "lo"})[1]


def test_exposure_warning_beyond_loopback_unless_trusted() -> None:
    assert exposure_warning("127.0.0.1:5000", ("127.0.0.1", True), {}) is None
    assert exposure_warning("localhost:5000", ("::1", True), {}) is None
    for rendezvous, plane in (
        ("10.0.0.2:2222", ("127.0.0.1", True)),
        ("127.0.0.1:5000", ("10.0.0.3", False)),
    ):
        warning = exposure_warning(rendezvous, plane, {})
        assert warning is not None and "\n" not in warning
        for words in ("gloo", "neither TLS nor the run secret", "trusted network only"):
            assert words in warning
        assert exposure_warning(rendezvous, plane, {TRUSTED_NETWORK_ENV: "1"}) is None
    both = exposure_warning("10.0.0.2:2222", ("10.0.0.2", False), {})
    assert both is not None and "rendezvous 10.0.0.2:2222 and data plane on 10.0.0.2" in both


@pytest.fixture
def one_rank_group() -> Iterator[tuple[dist.TCPStore, Collective]]:
    store, port = host_store("127.0.0.1", WAIT)
    group = Collective(
        rendezvous=f"127.0.0.1:{port}",
        rank=0,
        world_size=1,
        host_store=False,
        timeout=10.0,
        device=torch.device("cpu"),
        run_id="abc123",
        address="127.0.0.1:0",
    )
    try:
        yield store, group
    finally:
        group.close()


def test_group_keys_under_the_run_id_and_gloo_on_loopback(one_rank_group) -> None:  # type: ignore[no-untyped-def]
    store, group = one_rank_group
    keys = store.list_keys()
    assert keys and all(k.startswith("distsgd/abc123/") for k in keys), keys
    sockets = _listening(psutil.Process().pid)
    assert len(sockets) >= 2  # the store and gloo's device
    assert all(_loopback(ip) for ip, _ in sockets), sockets
    tensors = [torch.ones(3)]
    group.allreduce_mean(tensors)
    assert tensors[0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.own_fork_server  # it finds the workers' sockets in the launcher's tree
@pytest.mark.parametrize("scheme", ["allreduce"])
def test_collective_run_listens_on_loopback_only(spawn, tmp_path: Path, scheme: str) -> None:  # type: ignore[no-untyped-def]
    """Every LISTEN socket of the launcher and its workers, sampled through a whole run (every
    0.2 s: each sample walks the machine's process table for the launcher's tree; the
    workers' gloo sockets listen from their group's start to its end, 150 paced steps)."""
    run_dir = tmp_path / "run"
    args = ["run", "--workers", "2", "--scheme", scheme, "--quiet", "--run-dir", str(run_dir)]
    launcher = spawn([*args, str(SCRIPTS / "blobs.py"), "--steps", "150", "--slow", "0.01"])
    seen: dict[int, set[tuple[str, int]]] = {}
    while launcher.poll() is None:
        try:
            tree = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc in tree:
            seen.setdefault(proc.pid, set()).update(_listening(proc.pid))
        time.sleep(0.2)
    out = launcher.stdout.read() if launcher.stdout else ""
    assert launcher.returncode == 0, out[-3000:]
    exposed = {pid: a for pid, addrs in seen.items() for a in addrs if not _loopback(a[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"
    workers = [pid for name, pid in task_pids(run_dir).items() if name.startswith("worker")]
    assert seen.get(launcher.pid), "the launcher's rendezvous store was never seen"
    assert all(seen.get(pid) for pid in workers), f"a worker's gloo socket was never seen: {seen}"
