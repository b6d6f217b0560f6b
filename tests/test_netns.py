"""Emulated hosts in real network namespaces (distsgd_emulate.netns): hosts reach each other by
address and nothing else does, the links are shaped, and nothing is left after close() or after
a SIGKILL of the process that made them. Skipped where namespaces cannot be made.

Every process a test starts is ended by its PID in a ``finally``, as are the hosts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import netns_refusal, on_emulated_hosts

from distsgd.cluster import TaskId
from distsgd_emulate import netns, netns_keeper, netns_shaping
from distsgd_emulate.hosts import HostPlan, LinkSpec, parse_links, plan_hosts
from distsgd_emulate.netns import AppliedLink, EmulatedHosts, check_capable
from distsgd_emulate.netns_keeper import NetnsError
from distsgd_emulate.netns_shaping import tbf_sizes

SRC = Path(__file__).resolve().parents[1] / "src"
PORT = 5701
PAYLOAD = 2_500_000
"""Bytes per shaped transfer: 1 s at 20 Mbit/s."""

SERVER = """
import socket, sys
address, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((address, port))
s.listen()
print("ready", flush=True)
data = b"x" * size
while True:
    c, _ = s.accept()
    c.sendall(data)
    c.close()
"""

CLIENT = """
import json, socket, sys, time
try:
    wait = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=wait)
except OSError as e:
    print(json.dumps({"error": type(e).__name__}))
    sys.exit()
first, n = None, 0
while chunk := c.recv(1 << 20):
    if first is None:
        first, n0 = time.monotonic(), len(chunk)
    n += len(chunk)
print(json.dumps({"bytes": n, "first": n0, "seconds": time.monotonic() - first}))
"""

HOLDER = """
import json, time
from distsgd_emulate.hosts import plan_hosts
from distsgd.cluster import TaskId
from distsgd_emulate.netns import EmulatedHosts
tasks = [TaskId.parse("worker0"), TaskId.parse("worker1")]
hosts = EmulatedHosts(plan_hosts(count=2, tasks=tasks), management=True)
hosts.start()
print(json.dumps({"keepers": list(hosts.keepers.values()), "prefix": hosts.prefix}), flush=True)
time.sleep(60)
"""


# one at a time; the pure tests take no lock
needs_netns = on_emulated_hosts(netns_refusal(root=False))


def _plan(count: int, links: list[str] | None = None) -> HostPlan:
    tasks = [TaskId.parse(f"worker{i}") for i in range(count)]
    return plan_hosts(count=count, tasks=tasks, links=parse_links(links or []))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _namespace_in_use(inode: int) -> bool:
    """Whether any process is in the network namespace ``inode``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    return True
    return False


@contextlib.contextmanager
def _server(hosts: EmulatedHosts, host: str, address: str, size: int = 2) -> Iterator[None]:
    argv = [*hosts.enter(host), sys.executable, "-S", "-c", SERVER, address, str(PORT), str(size)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        proc.kill()
        proc.wait(timeout=5)


def _client(hosts: EmulatedHosts, host: str, address: str, wait: float = 5.0) -> dict[str, float]:
    argv = [*hosts.enter(host), sys.executable, "-S", "-c", CLIENT, address, str(PORT), str(wait)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
    return json.loads(done.stdout)


def _reply_from_here(address: str) -> bytes | None:
    """What a server at ``address`` says to this process (None: nothing answers).

    Where the machine's default route leads to a proxy that accepts every connection (as in
    some sandboxes), the connection is made, but not to the host's server: its 2 bytes never
    come."""
    try:
        with socket.create_connection((address, PORT), timeout=0.5) as conn:
            return conn.recv(2)
    except OSError:
        return None


# --------------------------------------------------------------------------- pure parts


def test_tbf_sizes_follow_the_documented_formula() -> None:
    assert tbf_sizes(20_000_000) == (65_536, 65_536 + 125_000)
    assert tbf_sizes(1_000_000_000) == (250_000, 250_000 + 6_250_000)
    for rate in (1_000, 10**6, 10**8, 10**10):
        burst, limit = tbf_sizes(rate)
        assert burst >= 65_536 and limit > burst


def test_applied_link_names_what_is_missing() -> None:
    spec = LinkSpec.parse("10mbit,5ms,1ms")
    link = AppliedLink(
        host="host0",
        spec=spec,
        rate_bits=spec.rate_bits,
        burst_bytes=1,
        limit_bytes=2,
        delay_applied=False,
    )
    assert link.missing == ("delay 5ms", "jitter 1ms")
    none = AppliedLink(
        host="host1",
        spec=None,
        rate_bits=None,
        burst_bytes=None,
        limit_bytes=None,
        delay_applied=True,
    )
    assert none.missing == ()


def test_no_privilege_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "_userns_allowed", lambda: False)
    with pytest.raises(ValueError, match="CAP_NET_ADMIN") as caught:
        check_capable()
    assert "\n" not in str(caught.value) and ";" in str(caught.value)


def test_enter_before_start_is_refused() -> None:
    with pytest.raises(ValueError, match="start the hosts"):
        EmulatedHosts(_plan(2)).enter("host0")


# --------------------------------------------------------------------------- namespaces


@needs_netns
def test_hosts_reach_each_other_by_address_and_nothing_else_does() -> None:
    plan = _plan(3)
    with EmulatedHosts(plan) as hosts:
        assert set(hosts.keepers) == {"switch", "host0", "host1", "host2"}
        addr0 = plan.host("host0").address
        with _server(hosts, "host0", addr0):
            assert _client(hosts, "host1", addr0)["bytes"] == 2
            assert _client(hosts, "host2", addr0)["bytes"] == 2
            # host1's loopback is its own: host0's server is not on it
            assert _client(hosts, "host1", "127.0.0.1") == {"error": "ConnectionRefusedError"}
            # the machine's own namespace does not reach host0's server
            assert _reply_from_here(addr0) != b"xx"
        assert hosts.root_links() == []


@needs_netns
def test_hosts_in_a_user_namespace_reach_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path taken without root (forced here: as root it runs the same way; checked by
    hand as uid 65534 too)."""
    monkeypatch.setattr(netns, "check_capable", lambda: netns.Privilege.USER_NAMESPACE)
    plan = _plan(2, ["100mbit"])
    hosts = EmulatedHosts(plan)
    try:
        hosts.start()
    except NetnsError as e:
        if "unshare: Invalid argument" not in str(e):
            raise
        # Seen once in 3 full runs as root (cause not found yet): the forced path's unshare of a
        # user namespace refused with EINVAL; any other failure still fails the test.
        pytest.skip(f"unshare(CLONE_NEWUSER) refused in this test process: {e}")
    with contextlib.closing(hosts):
        assert hosts.privilege is netns.Privilege.USER_NAMESPACE
        assert "--user=" in " ".join(hosts.enter("host1"))
        addr0 = plan.host("host0").address
        with _server(hosts, "host0", addr0):
            assert _client(hosts, "host1", addr0)["bytes"] == 2
        keepers = list(hosts.keepers.values())
    assert all(_gone(pid) for pid in keepers)


def _rate(result: dict[str, float]) -> float:
    """Bits per second after the first read (which the bucket's burst may have filled)."""
    return (result["bytes"] - result["first"]) * 8 / result["seconds"]


@needs_netns
@pytest.mark.slow  # about 3 s: three transfers of 1 s at the shaped rate or less
def test_links_are_shaped_to_their_rate_both_ways() -> None:
    """host1 has a 20mbit link: what it receives (host0 -> host1) and what it sends
    (host1 -> host2) each go at 20 Mbit/s; host0 -> host2 at 1gbit is much faster.

    One transfer at a time: bulk transfers both ways at once over one link measured 13-18
    Mbit/s on the sending side (each direction's ACKs queue behind the other's data in the
    shaper's FIFO, as on a real link with a FIFO queue; this kernel has no flow-queueing
    qdisc to put under tbf)."""
    plan = _plan(3, ["1gbit", "host1=20mbit"])
    with EmulatedHosts(plan) as hosts:
        assert [a.rate_bits for a in hosts.applied] == [10**9, 20 * 10**6, 10**9]
        addr0, addr1 = plan.host("host0").address, plan.host("host1").address
        with _server(hosts, "host0", addr0, PAYLOAD), _server(hosts, "host1", addr1, PAYLOAD):
            slow = {"in": _client(hosts, "host1", addr0), "out": _client(hosts, "host2", addr1)}
            fast = _client(hosts, "host2", addr0)
        counted = hosts.counters()
    rates = {way: _rate(result) for way, result in slow.items()}
    print(
        f"20mbit link: {rates['in'] / 1e6:.1f} Mbit/s in, {rates['out'] / 1e6:.1f} out; "
        f"1gbit link: {_rate(fast) / 1e6:.0f} Mbit/s"
    )
    for way, result in slow.items():
        assert result["bytes"] == PAYLOAD
        assert 16e6 <= rates[way] <= 24e6, f"{way}: {rates[way] / 1e6:.1f} Mbit/s on 20mbit"
        assert fast["seconds"] * 10 < result["seconds"]
    assert fast["bytes"] == PAYLOAD
    # headers included; what host0 sent to host1 includes what host1's full queue dropped
    # and host0 sent again (see tbf_sizes), so only a bound for it
    assert 2 * PAYLOAD < counted["host0"].sent < 3 * PAYLOAD
    assert PAYLOAD < counted["host1"].sent < 1.1 * PAYLOAD
    assert PAYLOAD < counted["host1"].received < 1.1 * PAYLOAD
    assert 2 * PAYLOAD < counted["host2"].received < 2.2 * PAYLOAD


@needs_netns
def test_close_ends_the_keepers_and_the_namespaces() -> None:
    hosts = EmulatedHosts(_plan(2))
    try:
        hosts.start()
        pids = list(hosts.keepers.values())
        inodes = [_netns_inode(pid) for pid in pids]
        assert all(i != _netns_inode(os.getpid()) for i in inodes)
    finally:
        hosts.close()
    assert hosts.keepers == {}
    assert all(_gone(pid) for pid in pids)
    assert not any(_namespace_in_use(i) for i in inodes)
    assert hosts.root_links() == []


@needs_netns
def test_a_failed_start_says_why_in_one_line_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[int] = []
    fork = netns_keeper.fork_keeper

    def counting_fork(**kwargs: object) -> int:
        pid = fork(**kwargs)  # type: ignore[arg-type]
        started.append(pid)
        return pid

    monkeypatch.setattr(netns_keeper, "fork_keeper", counting_fork)
    monkeypatch.setattr(EmulatedHosts, "port", lambda self, host: "x" * 20)  # too long
    hosts = EmulatedHosts(_plan(2))
    expected = r"ip failed in switch .*; the command was: ip link add x+ type veth"
    with pytest.raises(NetnsError, match=expected) as caught:
        hosts.start()
    assert "\n" not in str(caught.value)
    assert len(started) == 3 and hosts.keepers == {}
    assert all(_gone(pid) for pid in started)


NO_SYS_ADMIN = """
from distsgd.cluster import TaskId
from distsgd_emulate.hosts import plan_hosts
from distsgd_emulate.netns import EmulatedHosts
hosts = EmulatedHosts(plan_hosts(count=1, tasks=[TaskId.parse("worker0")]))
try:
    hosts.start()
except ValueError as e:
    print(e)
print(hosts.keepers)
"""


@needs_netns
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_root_without_cap_sys_admin_is_refused_in_one_line() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    argv = ["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c", NO_SYS_ADMIN]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env, check=True)
    assert done.stdout.splitlines() == [
        "emulated hosts: no network namespace may be made here (unshare: Operation not "
        "permitted); run as root with CAP_SYS_ADMIN, or allow unprivileged user namespaces",
        "{}",
    ]


def _links_here() -> str:
    return subprocess.run(
        ["ip", "-br", "link"], capture_output=True, text=True, timeout=5, check=True
    ).stdout


@needs_netns
def test_the_management_link_joins_this_namespace_to_the_hosts_unshaped_and_uncounted() -> None:
    plan = _plan(2, ["20mbit"])
    with EmulatedHosts(plan, management=True) as hosts:
        assert hosts.root_links() == [hosts.management_link]
        assert netns.MANAGEMENT_ADDRESS in _links_here_addresses()
        addr0 = plan.host("host0").address
        before = hosts.counters()
        with _server(hosts, "host0", addr0):
            assert _reply_from_here(addr0) == b"xx"  # this namespace reaches host0's server
        # host1 reaches a server in this namespace at the management address
        listener = socket.create_server((netns.MANAGEMENT_ADDRESS, PORT))
        try:
            listener.settimeout(5)
            argv = [*hosts.enter("host1"), sys.executable, "-c", CLIENT]
            client = subprocess.Popen(
                [*argv, netns.MANAGEMENT_ADDRESS, str(PORT)], stdout=subprocess.PIPE, text=True
            )
            try:
                conn, _ = listener.accept()
                conn.sendall(b"yy")
                conn.close()
                out, _ = client.communicate(timeout=10)
            finally:
                client.kill()
                client.wait(timeout=5)
            assert json.loads(out)["bytes"] == 2
        finally:
            listener.close()
        after = hosts.counters()
        # host0's bytes to this namespace crossed host0's link; host1's to us crossed host1's
        assert after["host0"].sent > before["host0"].sent
        assert after["host1"].sent > before["host1"].sent
        assert set(after) == {"host0", "host1"}
    assert hosts.root_links() == []
    assert netns.MANAGEMENT_ADDRESS not in _links_here_addresses()


@needs_netns
def test_a_second_management_link_is_refused_and_leaves_nothing() -> None:
    with EmulatedHosts(_plan(1), management=True):
        second = EmulatedHosts(_plan(1), management=True)
        with pytest.raises(ValueError, match="one at a time on a machine"):
            second.start()
        assert second.keepers == {}
        assert second.root_links() == []


def _links_here_addresses() -> str:
    return subprocess.run(
        ["ip", "-br", "addr"], capture_output=True, text=True, timeout=5, check=True
    ).stdout


def test_management_link_without_root_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "check_capable", lambda: netns.Privilege.USER_NAMESPACE)
    with pytest.raises(ValueError, match="need root"):
        EmulatedHosts(_plan(1), management=True).start()


@needs_netns
def test_a_sigkilled_creator_leaves_nothing() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, env=env
    )
    keepers: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        keepers, prefix = info["keepers"], info["prefix"]
        inodes = [_netns_inode(pid) for pid in keepers]
        assert f"{prefix}-m" in _links_here()  # the management link's end in this namespace
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_gone(pid) for pid in keepers):
            time.sleep(0.05)
        assert all(_gone(pid) for pid in keepers)
        assert not any(_namespace_in_use(i) for i in inodes)
        # the management link's end in this namespace goes with the switch namespace, which
        # the kernel takes down shortly after its keeper ends
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and prefix in _links_here():
            time.sleep(0.05)
        assert prefix not in _links_here()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=5)
        for pid in keepers:  # the child's keepers, should the test fail before they died
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                if psutil.Process(pid).name() == "sleep":
                    os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- faults


@contextlib.contextmanager
def _streaming(hosts: EmulatedHosts, host: str, address: str) -> Iterator[subprocess.Popen[str]]:
    """A client receiving from ``address`` in the background (its JSON line on stdout)."""
    argv = [*hosts.enter(host), sys.executable, "-S", "-c", CLIENT, address, str(PORT)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=5)


def _qdiscs(hosts: EmulatedHosts, host: str) -> str:
    argv = [*hosts.enter(host), "tc", "qdisc", "show", "dev", "eth0"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=5, check=True).stdout


@needs_netns
def test_a_cut_host_is_unreachable_until_healed_and_its_transfer_resumes() -> None:
    """host1 cut off 0.3 s into a 1 s transfer from host0: no byte crosses its link and no
    connection is made while it is cut; healed, the same connection carries the rest (TCP
    sends again once the link is back) and new connections work. Its shaper is unchanged."""
    plan = _plan(2, ["20mbit"])
    with EmulatedHosts(plan) as hosts:
        addr0 = plan.host("host0").address
        with _server(hosts, "host0", addr0, PAYLOAD), _streaming(hosts, "host1", addr0) as proc:
            time.sleep(0.3)
            hosts.cut("host1")
            assert hosts.cut_off == {"host1"}
            time.sleep(0.2)  # what was in the switch port's queue when it went down
            before = hosts.counters()["host1"]
            assert "error" in _client(hosts, "host1", addr0, wait=0.5)
            assert "error" in _client(hosts, "host0", plan.host("host1").address, wait=0.5)
            during = hosts.counters()["host1"]
            hosts.heal("host1")
            assert hosts.cut_off == set()
            out, _ = proc.communicate(timeout=8)
        after = hosts.counters()["host1"]
        assert (during.sent, during.received) == (before.sent, before.received)
        assert json.loads(out)["bytes"] == PAYLOAD
        assert after.received > during.received + PAYLOAD // 2
        with _server(hosts, "host0", addr0):
            assert _client(hosts, "host1", addr0)["bytes"] == 2
        assert "rate 20Mbit" in _qdiscs(hosts, "host1")


def _counted_rate(hosts: EmulatedHosts, host: str, proc: subprocess.Popen[str]) -> float:
    """Bits/s ``host`` received while ``proc`` ran, read from its link's counters every 0.1 s:
    from the first sample after bytes began to flow to the last before they stopped."""
    samples = []
    while proc.poll() is None:
        samples.append((time.monotonic(), hosts.counters()[host].received))
        time.sleep(0.1)
    start = samples[0][1]
    moving = [i for i, (_, got) in enumerate(samples) if got > start]
    end = samples[-1][1]
    first = moving[0]
    last = max(i for i, (_, got) in enumerate(samples) if got < end)
    assert last > first + 4, f"too few samples while bytes flowed: {samples}"
    (t0, b0), (t1, b1) = samples[first], samples[last]
    return (b1 - b0) * 8 / (t1 - t0)


@needs_netns
def test_a_link_is_slowed_both_ways_and_restored() -> None:
    """host1's 100mbit link set to 20mbit: host1 receives at 20 Mbit/s by its counters (frames,
    headers included) and sends at 20 Mbit/s of payload; restored, it is fast again."""
    plan = _plan(3, ["100mbit"])
    with EmulatedHosts(plan) as hosts:
        addr0, addr1 = plan.host("host0").address, plan.host("host1").address
        hosts.set_rate("host1", 20_000_000)
        assert hosts.rates == {"host1": 20_000_000}
        with _server(hosts, "host0", addr0, PAYLOAD), _server(hosts, "host1", addr1, PAYLOAD):
            with _streaming(hosts, "host1", addr0) as proc:
                counted = _counted_rate(hosts, "host1", proc)
                received = json.loads(proc.communicate(timeout=5)[0])
            sent = _client(hosts, "host2", addr1)
            hosts.set_rate("host1", None)
            assert hosts.rates == {}
            fast = _client(hosts, "host1", addr0)
        assert "rate 100Mbit" in _qdiscs(hosts, "host1")
    print(
        f"20mbit set: {counted / 1e6:.1f} Mbit/s in by the counters, "
        f"{_rate(sent) / 1e6:.1f} out; restored: {_rate(fast) / 1e6:.1f} in"
    )
    assert received["bytes"] == PAYLOAD
    assert 16e6 <= counted <= 24e6
    assert 16e6 <= _rate(sent) <= 24e6
    assert _rate(fast) > 60e6


@needs_netns
def test_an_unshaped_link_is_shaped_and_unshaped_again() -> None:
    with EmulatedHosts(_plan(2)) as hosts:
        hosts.set_rate("host1", None)  # nothing set: nothing to undo
        hosts.set_rate("host1", 5_000_000)
        assert "rate 5Mbit" in _qdiscs(hosts, "host1")
        hosts.set_rate("host1", None)
        assert "tbf" not in _qdiscs(hosts, "host1")
    with pytest.raises(ValueError, match="not started"):
        hosts.cut("host1")


# --------------------------------------------------------------------------- bytes per pair


TC_CLASSES = """class tbf 1:1 parent 1: leaf 10:

class htb 10:fe root leaf 8341: prio 0 rate 100Gbit ceil 100Gbit burst 0b cburst 0b
 Sent 84 bytes 2 pkt (dropped 0, overlimits 2 requeues 0)
 backlog 0b 0p requeues 0

class htb 10:1a root leaf 8340: prio 0 rate 100Gbit ceil 100Gbit burst 0b cburst 0b
 Sent 123456 bytes 90 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_counting_classes_are_read_and_scripted() -> None:
    assert netns_shaping.class_bytes(TC_CLASSES) == {0xFE: 84, 0x1A: 123_456}
    script = netns_shaping.egress_script(
        "eth0", rate_bits=10_000_000, sizes=(65_536, 190_536), destinations=[(2, "198.18.0.2")]
    )
    assert script.splitlines()[:2] == [
        "qdisc add dev eth0 root handle 1: tbf rate 10000000bit burst 65536 limit 190536",
        "qdisc add dev eth0 parent 1:1 handle 10: htb default fe",
    ]
    assert "parent 10:2 bfifo limit 190536" in script
    assert "match ip dst 198.18.0.2/32 flowid 10:2" in script
    unshaped = netns_shaping.egress_script(
        "eth0", rate_bits=None, sizes=None, destinations=[(2, "198.18.0.2")]
    )
    assert unshaped.startswith("qdisc add dev eth0 root handle 10: htb")
    assert "tbf" not in unshaped and "bfifo" not in unshaped


@needs_netns
def test_bytes_are_counted_per_pair_of_hosts_across_rate_changes_and_cuts() -> None:
    """A transfer host0 -> host2 counts in that pair, not in host0 -> host1; the counts go on
    through a new rate, a cut and heal, and (on an unshaped host) a shaper set and taken off."""
    plan = _plan(3, ["worker0=200mbit"])
    addr0, addr2 = plan.host("host0").address, plan.host("host2").address
    with (
        EmulatedHosts(plan) as hosts,
        _server(hosts, "host0", addr0, PAYLOAD),
        _server(hosts, "host2", addr2, PAYLOAD),
    ):
        assert _client(hosts, "host2", addr0)["bytes"] == PAYLOAD
        first = hosts.pair_counters()
        hosts.set_rate("host0", 100_000_000)  # tbf to tbf: changed in place
        hosts.cut("host0")
        hosts.heal("host0")
        assert _client(hosts, "host2", addr0)["bytes"] == PAYLOAD
        hosts.set_rate("host2", 100_000_000)  # unshaped to shaped: made again
        assert _client(hosts, "host1", addr2)["bytes"] == PAYLOAD
        hosts.set_rate("host2", None)
        assert "tbf" not in _qdiscs(hosts, "host2")
        assert _client(hosts, "host1", addr2)["bytes"] == PAYLOAD
        hosts.set_rate("host0", None)
        assert "rate 200Mbit" in _qdiscs(hosts, "host0")
        last = hosts.pair_counters()
    assert set(first) == {"host0", "host1", "host2"}
    assert set(first["host0"]) == {"host0", "host1", "host2", netns.LAUNCHER, netns.ELSEWHERE}
    assert PAYLOAD <= first["host0"]["host2"] < 1.2 * PAYLOAD
    assert first["host0"]["host1"] == first["host0"]["host0"] == first["host0"]["launcher"] == 0
    assert 0 < first["host2"]["host0"] < PAYLOAD // 10  # the ACKs
    assert 2 * PAYLOAD <= last["host0"]["host2"] < 2.4 * PAYLOAD
    assert last["host0"]["host1"] == 0
    assert 2 * PAYLOAD <= last["host2"]["host1"] < 2.4 * PAYLOAD
    assert last["host2"]["host0"] < PAYLOAD // 10


@needs_netns
def test_a_second_set_of_hosts_is_refused_naming_the_first(tmp_path: Path) -> None:
    """Another process holding the hosts' lock (as a run or `distsgd hosts up` does): a second
    set of hosts with a management link refuses in one line naming it, and leaves nothing."""
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(SRC)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        second = EmulatedHosts(_plan(1), management=True)
        with pytest.raises(ValueError) as refused:
            second.start()
        assert f"pid {holder.pid} (emulated hosts dstest" in str(refused.value)
        assert "one at a time" in str(refused.value) and "\n" not in str(refused.value)
        assert second.keepers == {} and second.root_links() == []
    finally:
        holder.kill()
        holder.wait(timeout=5)
    with EmulatedHosts(_plan(1), management=True) as hosts:  # the holder gone: the lock is free
        assert hosts.keepers


LOCK_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from distsgd_emulate.hosts import HOST_NETWORK
from distsgd_emulate.netns_lock import HostsLock
lock = HostsLock(str(HOST_NETWORK), what="emulated hosts dstest")
lock.acquire()
print("locked", flush=True)
time.sleep(60)
"""
