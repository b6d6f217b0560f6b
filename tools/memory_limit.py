"""Run a command, and every process it starts, under a memory limit; report its peak use.

    python tools/memory_limit.py --limit 1G [--data] [--evict FOLDER] -- COMMAND ARGS...

Default: a new memory cgroup (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``; needs root
or a delegated cgroup), which counts everything the processes use: their own memory *and* the
page cache of the files they read, which the kernel must evict to stay under the limit. It
prints the peak (``memory.peak`` / ``memory.max_usage_in_bytes``), the OOM kills and the
processes' own memory at its largest (anonymous pages, sampled every 0.2 s: without the page
cache), then exits with the command's status.

``--evict FOLDER``: first drop the files under FOLDER from the page cache (``posix_fadvise``
``DONTNEED``), so that the command reads them from disk and its cgroup is charged for them: a
page already cached (say, by the process that wrote the data) is charged to whoever read it
first, and would let a run read its data without the limit seeing it.

``--data``: no cgroup, a ``RLIMIT_DATA`` on each process instead (heap and private writable
maps: where an array loaded into memory lives; not read-only file maps, not the page cache).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


def size(text: str) -> int:
    """Bytes from ``512M``, ``1G``, ``1073741824``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def make_cgroup(limit: int) -> tuple[Path, str]:
    """A fresh cgroup with the limit: (its folder, "v1" or "v2")."""
    name = f"distsgd-limit-{os.getpid()}"
    if (V2 / "cgroup.controllers").exists():
        group = V2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")
        return group, "v2"
    if V1.is_dir():
        group = V1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        memsw = group / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit))
        return group, "v1"
    raise SystemExit("no memory cgroup to make here; try --data")


def own_memory(group: Path, version: str) -> int:
    """The processes' own memory now (anonymous pages), without the page cache."""
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    return int(stat["anon"] if version == "v2" else stat["total_rss"])


def report(group: Path, version: str) -> str:
    """The peak use (processes and page cache) and the OOM kills."""
    if version == "v2":
        peak = int((group / "memory.peak").read_text())
        events = dict(line.split() for line in (group / "memory.events").read_text().splitlines())
        kills = events["oom_kill"]
    else:
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        oom = (group / "memory.oom_control").read_text().split()
        kills = oom[oom.index("oom_kill") + 1] if "oom_kill" in oom else "?"
    return f"peak {peak / 2**20:.0f} MiB, OOM kills {kills}"


def evict(folder: Path) -> int:
    """Drop every file under ``folder`` from the page cache; the bytes dropped."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", required=True, type=size, help="e.g. 512M, 1G")
    parser.add_argument("--data", action="store_true", help="RLIMIT_DATA per process, no cgroup")
    parser.add_argument("--evict", type=Path, help="drop this folder's files from the cache")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.evict is not None:
        dropped = evict(args.evict)
        print(
            f"[memory_limit] {dropped / 2**20:.0f} MiB under {args.evict} dropped from the cache",
            file=sys.stderr,
        )
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = time.monotonic()
    if args.data:

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (args.limit, args.limit))

        code = subprocess.call(command, preexec_fn=cap)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(
            f"[memory_limit] RLIMIT_DATA {args.limit / 2**20:.0f} MiB: exit {code}, "
            f"{time.monotonic() - started:.0f}s, largest process peak RSS {peak:.0f} MiB",
            file=sys.stderr,
        )
        return code
    group, version = make_cgroup(args.limit)
    procs = group / "cgroup.procs"
    try:
        join = lambda: procs.write_text(str(os.getpid()))  # noqa: E731 - in the child, before exec
        child = subprocess.Popen(command, preexec_fn=join)
        own = 0
        while child.poll() is None:  # sampled: the processes' own memory at its largest
            own = max(own, own_memory(group, version))
            time.sleep(0.2)
        code = child.returncode
        print(
            f"[memory_limit] cgroup {version} limit {args.limit / 2**20:.0f} MiB: exit {code}, "
            f"{time.monotonic() - started:.0f}s, {report(group, version)}, the processes' own "
            f"memory (no page cache) at most {own / 2**20:.0f} MiB",
            file=sys.stderr,
        )
        return code
    finally:
        for _ in range(50):  # the last processes may take a moment to leave it
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
