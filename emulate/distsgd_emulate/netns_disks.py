"""Private disks of emulated hosts (:mod:`distsgd_emulate.netns`): with
``EmulatedHosts(plan, disks=HostDisks(root=R, at=A))`` every host has a disk of its own at the
same path ``A``, so that what one host writes there reaches another only over their links,
and a fault can lose a host's disk (:meth:`DiskSet.wipe`). The rest of the file system stays
the machine's, shared by all the hosts.

Layout, for hosts ``host0..hostN-1``::

    the machine's mount namespace:  R/host0 .. R/hostN-1  the backing directories (0700): what
                                                          EmulatedHosts.disk_of returns
                                    A                     an ordinary empty directory
    host i's mount namespace:       A                     R/hosti, bind-mounted
                                    R                     an empty read-only tmpfs

Each host's keeper (:mod:`distsgd_emulate.netns_keeper`) unshares a mount namespace along with
its network namespace and, before it execs, makes the whole tree private (so no mount of it
propagates to the machine's namespace), binds its backing directory at ``A``, then covers ``R``
with an empty read-only tmpfs (the backing directories out of a host's sight by their real
path; the bind at ``A`` still reaches its own). No mount is made in the machine's namespace;
a host's mounts go with its mount namespace, when its keeper and the last task in it end.
Without root the keepers are root in the hosts' user namespace, which owns the mount
namespaces: the same mounts are allowed there.

Entering (:func:`enter_argv`): ``nsenter`` also gets ``--mount=/proc/KEEPER/ns/mnt``. Entering
a mount namespace sets the working directory to its root (``/``), and nsenter's ``--wd=DIR``
(util-linux 2.38) opens DIR *before* it enters: the task's working directory would stay in the
machine's mount tree, where a relative path below ``A`` reaches the machine's empty ``A``, not
the host's disk. So two ``/bin/sh -c`` go around nsenter: the outer one hands over its working
directory (``$PWD``: that of whatever started it, a ``cwd=`` of Popen included), the inner one,
in the host, changes to the same path there and execs the task; one PID throughout, two execs
more. A working directory the hosts cannot see (under ``R``) fails the task (``cd``, exit 2).

Limits: the hosts share the machine's PID namespace, so root in one host could still reach
another host's disk by ``/proc/PID/root`` of a process there; the disks keep apart tasks that
use their own paths, they are no security boundary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distsgd_emulate.netns_keeper import Mount, NetnsError

__all__ = ["DiskSet", "HostDisks", "enter_argv", "mounted_under"]

log = logging.getLogger(__name__)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
KEEP_CWD = 'cd -- "$0" && exec "$@"'
"""The inner shell's script: to the working directory it is given ($0), then the task."""
MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True, kw_only=True)
class HostDisks:
    """Where the emulated hosts' private disks are (the paths are made absolute, symbolic
    links resolved); ValueError where one path is inside the other."""

    root: Path
    """A directory of their own (made where missing): ``root/HOST`` backs host HOST's disk. The
    hosts see an empty read-only directory here."""
    at: Path
    """The mount point: where every host sees its own disk (made where missing; in the
    machine's namespace it stays an ordinary directory, nothing mounted on it)."""
    keep: bool = True
    """Leave the backing directories, with what the hosts wrote, at close; False: remove them
    (and ``root``, where it was made for them and is left empty)."""

    def __post_init__(self) -> None:
        root, at = Path(self.root).resolve(), Path(self.at).resolve()
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "at", at)
        if at.is_relative_to(root) or root.is_relative_to(at):
            raise ValueError(
                f"the hosts' disks: the mount point {at} and the backing root {root} must not "
                "be one inside the other; give each a directory of its own"
            )


class DiskSet:
    """The private disks of one set of emulated hosts (:attr:`EmulatedHosts.disks`)."""

    def __init__(self, disks: HostDisks, hosts: Sequence[str]) -> None:
        self.disks = disks
        self.hosts = tuple(hosts)
        self._made_root = False

    def path(self, host: str) -> Path:
        """``host``'s backing directory, as the creator sees it."""
        return self.disks.root / host

    def prepare(self) -> None:
        """Make the mount point and the backing directories (0700; one that exists keeps what
        it holds); ValueError where one is there but no directory."""
        root, at = self.disks.root, self.disks.at
        self._made_root = not root.exists()
        for path in (at, root, *map(self.path, self.hosts)):
            with contextlib.suppress(FileExistsError):
                path.mkdir(parents=True, mode=0o700)
            if path.is_symlink() or not path.is_dir():
                raise ValueError(f"the hosts' disks: {path} is there but no directory")
        for host in self.hosts:
            os.chmod(self.path(host), 0o700)

    def mounts(self, host: str) -> tuple[Mount, ...]:
        """What ``host``'s keeper mounts in its mount namespace (see the module's docstring)."""
        root, at = os.fsencode(self.disks.root), os.fsencode(self.disks.at)
        hidden = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        return (
            Mount(None, b"/", None, MS_REC | MS_PRIVATE),
            Mount(os.fsencode(self.path(host)), at, None, MS_BIND),
            Mount(b"tmpfs", root, b"tmpfs", hidden, b"mode=000,size=4k"),
        )

    def wipe(self, host: str) -> None:
        """Remove everything in ``host``'s backing directory (which stays, empty, and mounted
        in the host): its disk is lost. Stop its tasks first: one still writing may leave more.
        NetnsError where something could not be removed."""
        where = self.path(host)
        try:
            entries = list(os.scandir(where))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise NetnsError(f"could not wipe {host}'s disk ({where}): {e}") from None
        log.info("wiped %s's disk (%s): %d entries", host, where, len(entries))

    def release(self) -> list[str]:
        """At close, once the keepers ended: the backing directories removed unless kept; the
        mount points under the root or the mount point in the machine's namespace (none, by
        design)."""
        if not self.disks.keep:
            for host in self.hosts:
                try:
                    shutil.rmtree(self.path(host))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("could not remove %s's disk: %s", host, e)
            if self._made_root:
                with contextlib.suppress(OSError):
                    self.disks.root.rmdir()
        return mounted_under([self.disks.root, self.disks.at])


def mounted_under(paths: Sequence[Path], mountinfo: Path = MOUNTINFO) -> list[str]:
    """The mount points in ``mountinfo`` (this process's mount namespace) at or below any of
    ``paths`` (absolute, symbolic links resolved)."""
    points = []
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if any(Path(point).is_relative_to(path) for path in paths):
            points.append(point)
    return points


def enter_argv(nsenter: Sequence[str], keeper: int) -> list[str]:
    """The argv prefix that starts a program in a host with a private disk: ``nsenter`` (the
    host's prefix, ending in ``--``) with the keeper's mount namespace too, inside the two
    shells that keep the working directory (see the module's docstring)."""
    if not nsenter or nsenter[-1] != "--":
        raise ValueError(f"not an nsenter prefix ending in --: {list(nsenter)}")
    inner = [*nsenter[:-1], f"--mount=/proc/{keeper}/ns/mnt", "--", "/bin/sh", "-c", KEEP_CWD]
    return ["/bin/sh", "-c", f'exec {shlex.join(inner)} "$PWD" "$@"', "sh"]
