"""Private disks of emulated hosts (distsgd_emulate.netns_disks): what a host writes at the
mount point is in its own backing directory only, a task keeps its working directory, a wiped
disk is empty and usable, and nothing is left mounted here after close(). Skipped where
namespaces cannot be made, as tests/test_netns.py is.

Every process a test starts runs to its end under a timeout; the hosts are closed by ``with``
(or ``contextlib.closing``)."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import netns_refusal, on_emulated_hosts
from test_netns import _gone

from distsgd.cluster import TaskId
from distsgd_emulate import netns, netns_keeper
from distsgd_emulate.hosts import HostPlan, plan_hosts
from distsgd_emulate.netns import EmulatedHosts, HostDisks
from distsgd_emulate.netns_disks import DiskSet, enter_argv, mounted_under
from distsgd_emulate.netns_keeper import Mount, NetnsError

pytestmark = pytest.mark.timeout(30)

needs_netns = on_emulated_hosts(netns_refusal(root=False))


def _plan(count: int = 2) -> HostPlan:
    return plan_hosts(count=count, tasks=[TaskId.parse(f"worker{i}") for i in range(count)])


def _disks(base: Path, *, keep: bool = True) -> HostDisks:
    return HostDisks(root=base / "backing", at=base / "disk", keep=keep)


def _sh(
    hosts: EmulatedHosts, host: str, script: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` in ``host``, run to its end."""
    argv = [*hosts.enter(host), "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=cwd)


# --------------------------------------------------------------------------- pure parts


def test_nested_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one inside the other"):
        HostDisks(root=tmp_path, at=tmp_path / "disk")
    with pytest.raises(ValueError, match="one inside the other"):
        HostDisks(root=tmp_path / "disk" / "backing", at=tmp_path / "disk")


def test_without_disks_the_prefix_is_as_before_and_disks_are_refused() -> None:
    hosts = EmulatedHosts(_plan())
    hosts.keepers = {"switch": 10, "host0": 11, "host1": 12}  # as if started
    assert hosts.enter("host0") == ["nsenter", "--net=/proc/11/ns/net", "--"]
    with pytest.raises(ValueError, match="no private disks"):
        hosts.disk_of("host0")
    with pytest.raises(ValueError, match="no private disks"):
        hosts.wipe("host0")


def test_the_prefix_enters_the_mount_namespace_in_the_callers_directory() -> None:
    argv = enter_argv(["nsenter", "--net=/proc/11/ns/net", "--"], 11)
    assert argv[:2] == ["/bin/sh", "-c"] and argv[-1] == "sh"
    inner = shlex.split(argv[2])
    assert inner[:4] == ["exec", "nsenter", "--net=/proc/11/ns/net", "--mount=/proc/11/ns/mnt"]
    assert inner[-2:] == ["$PWD", "$@"]
    with pytest.raises(ValueError, match="ending in --"):
        enter_argv(["nsenter"], 11)


def test_mount_points_are_read_unescaped(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "68 47 254:0 /x /srv/my\\040disk rw - ext4 /dev/vda rw\n"
        "69 47 0:40 / /srv/backing ro - tmpfs tmpfs ro\n"
    )
    found = mounted_under([Path("/srv/my disk"), Path("/srv/backing")], info)
    assert found == ["/srv/my disk", "/srv/backing"]
    assert mounted_under([Path("/srv/my")], info) == []


# --------------------------------------------------------------------------- namespaces


@needs_netns
def test_what_a_host_writes_on_its_disk_only_it_sees(tmp_path: Path) -> None:
    disks = _disks(tmp_path)
    with EmulatedHosts(_plan(), disks=disks) as hosts:
        wrote = _sh(hosts, "host0", f"echo x > {disks.at}/f && ls -A {disks.root}")
        assert wrote.returncode == 0, wrote.stderr
        assert wrote.stdout == ""  # the backing directories are out of the host's sight
        assert (hosts.disk_of("host0") / "f").read_text() == "x\n"
        assert hosts.disk_of("host0") == disks.root / "host0"
        other = _sh(hosts, "host1", f"ls -A {disks.at}")
        assert (other.returncode, other.stdout) == (0, "")
        assert list(disks.at.iterdir()) == []  # nothing mounted on it in this namespace
        assert mounted_under([disks.at, disks.root]) == []
        assert hosts.disk_of("host0").stat().st_mode & 0o777 == 0o700


@needs_netns
def test_a_task_keeps_the_working_directory_it_was_started_in(tmp_path: Path) -> None:
    """Started with Popen's ``cwd`` (not the test's own): a relative path below the mount
    point reaches the host's disk, not the empty directory of this namespace."""
    disks = _disks(tmp_path)
    with EmulatedHosts(_plan(), disks=disks) as hosts:
        done = _sh(hosts, "host1", "pwd && echo y > disk/g", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(tmp_path.resolve())
        assert (hosts.disk_of("host1") / "g").read_text() == "y\n"
        # started in the mount point itself: in the host that is its disk
        inside = _sh(hosts, "host1", "echo w > w && ls", cwd=disks.at)
        assert (inside.returncode, inside.stdout) == (0, "g\nw\n"), inside.stderr
        assert list(disks.at.iterdir()) == []


@needs_netns
def test_a_wiped_disk_is_empty_and_can_be_written_again(tmp_path: Path) -> None:
    disks = _disks(tmp_path)
    outside = tmp_path / "outside"
    outside.write_text("kept")
    with EmulatedHosts(_plan(), disks=disks) as hosts:
        fill = f"cd {disks.at} && mkdir -p a/b && echo 1 > a/b/c && echo 2 > d && ln -s {outside} e"
        assert _sh(hosts, "host0", fill).returncode == 0
        assert _sh(hosts, "host1", f"echo 3 > {disks.at}/h1").returncode == 0
        assert sorted(p.name for p in hosts.disk_of("host0").iterdir()) == ["a", "d", "e"]
        hosts.wipe("host0")
        assert list(hosts.disk_of("host0").iterdir()) == []
        assert outside.read_text() == "kept"  # a link was removed, not what it pointed to
        assert (hosts.disk_of("host1") / "h1").read_text() == "3\n"  # another host's disk kept
        again = _sh(hosts, "host0", f"echo 4 > {disks.at}/n && cat {disks.at}/n && ls {disks.at}")
        assert (again.returncode, again.stdout) == (0, "4\nn\n")


@needs_netns
@pytest.mark.parametrize("keep", [True, False])
def test_close_leaves_no_mount_and_keeps_the_disks_as_asked(tmp_path: Path, keep: bool) -> None:
    disks = _disks(tmp_path, keep=keep)
    hosts = EmulatedHosts(_plan(), disks=disks)
    with contextlib.closing(hosts):
        hosts.start()
        keepers = list(hosts.keepers.values())
        assert _sh(hosts, "host0", f"echo x > {disks.at}/f").returncode == 0
        for host in ("host0", "host1"):  # in each host's mount namespace: its disk, R hidden
            mounts = Path(f"/proc/{hosts.keepers[host]}/mountinfo").read_text()
            assert f"/{host} {disks.at} " in mounts and f" {disks.root} " in mounts
    assert all(_gone(pid) for pid in keepers)
    assert mounted_under([disks.at, disks.root]) == []
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert disks.at.is_dir() and list(disks.at.iterdir()) == []
    if keep:
        assert (disks.root / "host0" / "f").read_text() == "x\n"
    else:
        assert not disks.root.exists()


@needs_netns
def test_disks_in_a_user_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path taken without root (forced here, as tests/test_netns.py does): the mount
    namespaces belong to the hosts' user namespace, where the keepers may mount."""
    monkeypatch.setattr(netns, "check_capable", lambda: netns.Privilege.USER_NAMESPACE)
    disks = _disks(tmp_path)
    hosts = EmulatedHosts(_plan(), disks=disks)
    try:
        hosts.start()
    except NetnsError as e:
        if "unshare: Invalid argument" not in str(e):
            raise
        pytest.skip(f"unshare(CLONE_NEWUSER) refused in this test process: {e}")
    with contextlib.closing(hosts):
        assert "--user=" in " ".join(hosts.enter("host0"))
        done = _sh(hosts, "host0", "echo z > disk/f && ls -A backing", cwd=tmp_path)
        assert (done.returncode, done.stdout) == (0, ""), done.stderr
        assert (hosts.disk_of("host0") / "f").read_text() == "z\n"
        assert _sh(hosts, "host1", "ls -A disk", cwd=tmp_path).stdout == ""
        keepers = list(hosts.keepers.values())
    assert all(_gone(pid) for pid in keepers)
    assert mounted_under([disks.at, disks.root]) == []
    assert os.listdir(disks.at) == []


@needs_netns
def test_a_mount_that_fails_says_why_in_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    fork = netns_keeper.fork_keeper

    def counting_fork(**kwargs: object) -> int:
        pid = fork(**kwargs)  # type: ignore[arg-type]
        started.append(pid)
        return pid

    def bad_mounts(self: DiskSet, host: str) -> tuple[Mount, ...]:
        return (Mount(os.fsencode(self.path(host)), os.fsencode(tmp_path / "none"), None, 0x1000),)

    monkeypatch.setattr(netns_keeper, "fork_keeper", counting_fork)
    monkeypatch.setattr(DiskSet, "mounts", bad_mounts)
    hosts = EmulatedHosts(_plan(), disks=_disks(tmp_path))
    with pytest.raises(NetnsError, match=r"could not start: mount .*/none: No such file") as caught:
        hosts.start()
    assert "\n" not in str(caught.value)
    assert len(started) == 1 and hosts.keepers == {}  # the switch's; host0's never ran
    assert all(_gone(pid) for pid in started)


@needs_netns
def test_hosts_up_with_disks_gives_each_host_its_own(tmp_path: Path) -> None:
    """``distsgd-emulate hosts up --disks AT``: a command run by ``hosts exec`` in one host
    writes under AT on that host's disk alone; when the hosts go down their disks go too,
    nothing mounted."""
    import signal
    import sys

    from conftest import wait_for

    folder, at = tmp_path / "hosts", tmp_path / "at"
    distsgd = [sys.executable, "-m", "distsgd_emulate"]
    up = subprocess.Popen(
        [*distsgd, "hosts", "up", "2", "--dir", str(folder), "--disks", str(at)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for((folder / "hosts.json").exists, 20), up.stderr.read() if up.poll() else ""

        def run(host: str, script: str) -> subprocess.CompletedProcess[str]:
            argv = [*distsgd, "hosts", "exec", "--dir", str(folder), host, "--", "sh", "-c"]
            return subprocess.run([*argv, script], capture_output=True, text=True, timeout=20)

        assert run("host0", f"echo zero > {at}/f").returncode == 0
        assert run("host1", f"test ! -e {at}/f && echo one > {at}/f").returncode == 0
        assert run("host0", f"cat {at}/f").stdout == "zero\n"
        assert (folder / "disks" / "host1" / "f").read_text() == "one\n"
        assert list(at.iterdir()) == []  # this machine's AT: nothing of the hosts
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=30)
    assert up.returncode == 0
    assert not (folder / "disks").exists() and not mounted_under([at, folder])
