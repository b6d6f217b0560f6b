"""A real multi-node Ray cluster on emulated hosts (root; not part of CI, about a minute): one Ray
node per host of ``distsgd-emulate hosts up``, so that ``distsgd run --ray=ADDR`` can be tried
across nodes. The head is ``ray start --head --block`` inside host0 (198.18.0.1, GCS on port 6379 of
host0's own port space), every other host runs ``ray start --address=HEAD --block`` with its own
node address; each node has its own ``--temp-dir`` under one scratch folder (``/tmp/rayhosts-*``,
0700) and the cluster uses Ray's token authentication with a fresh token.

:func:`ray_on_hosts` is the reusable part: a context manager that brings the cluster up, waits
until a driver inside host0 sees every node alive, and on the way out (an exception or Ctrl-C
included) ends every node's process group and session, then the hosts, removes its folders, and
raises if a process or a namespace of the cluster is left. While it is up it holds the test
suite's locks of runs on emulated hosts and on Ray (where the suite has made them), so that
neither disturbs the other. Run as a script it checks the
cluster: a driver in host0 starts one task pinned to each node, which reports the node's address
as Ray sees it and connects to the head's GCS over TCP; prints a JSON summary (seconds to bring
up and tear down, nodes, what each task saw, memory of the nodes, what was left)::

    python benchmarks/ray_hosts.py [--count 3] [--link 1gbit] [--cpus 2] [--out DIR]

Why the flags: a host has no default route, so Ray's own guess of its address (a UDP socket
"towards" 8.8.8.8) fails and falls back to 127.0.0.1; ``--node-ip-address`` gives each node its
host's address, which every node's servers and tasks then use. The hosts share this machine's
file system and PID namespace: the temporary folders must differ, and a driver finds "local"
raylets by scanning every process on the machine, so one that should attach to its own host's
node passes ``ray.init(_node_ip_address=...)`` (else it attaches to the head's). Draining on
SIGTERM is turned off (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0``): a node would otherwise ask
the GCS to drain it and wait up to 30 s before it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import getpass
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DISTSGD = [sys.executable, "-m", "distsgd"]
EMULATE = [sys.executable, "-m", "distsgd_emulate"]
"""``distsgd-emulate``: the emulated hosts' command."""
RAY_START = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
HEAD_PORT = 6379
"""The GCS port of the head, in host0's own port space (each host has its own)."""
START_TIMEOUT_S = 240.0
"""How long the hosts and every node may take to come up (2 cores: about 20-40 s)."""
LOCK_WAIT_S = 600.0
"""How long to wait for another set of emulated hosts on this machine to go (one at a time)."""
STOP_GRACE_S = 10.0
"""How long a node (or the hosts) may take to stop after SIGTERM before SIGKILL."""
SUITE_LOCKS = ("hosts", "ray")
"""The test suite's locks (tests/conftest.py LOCKED_GROUPS, in name order) held while the cluster
is up, those of every pytest run that has made them: its tests on emulated hosts and on Ray wait
for the cluster, and it for them (one set of emulated hosts at a time on a machine; 2 cores). A
pytest run that starts while the cluster is up does not wait for it."""
NODES_SNIPPET = """
import ipaddress, json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
print(json.dumps(sorted(alive, key=ipaddress.ip_address)))
"""
"""A driver that prints the addresses of the cluster's alive nodes (argv[1]: the GCS)."""


@dataclass
class RayHosts:
    """A Ray cluster with one node per emulated host, as :func:`ray_on_hosts` brought it up."""

    address: str
    """The head's GCS, ``ip:port`` (198.18.0.1:6379): ``ray.init(address=...)``, ``--ray=``."""
    hosts_dir: Path
    """The ``--dir`` of the emulated hosts (``distsgd-emulate hosts exec --dir``)."""
    env: dict[str, str]
    """What a driver needs in its environment besides :data:`os.environ` (the token)."""
    hosts: dict[str, str]
    """Each host's name and address, host0 (the head) first."""
    temp_dirs: dict[str, Path]
    """Each host's Ray ``--temp-dir`` (removed on the way out)."""
    nodes: list[str] = field(default_factory=list)
    """The node addresses a driver in host0 saw alive."""
    sessions: dict[str, int] = field(default_factory=dict)
    """Each host's ``ray start`` PID: its process group and session."""
    left: list[str] = field(default_factory=list)
    """After the way out: what was left (processes, namespaces); :func:`ray_on_hosts` raises
    if any."""

    disks: Path | None = None
    """Where each host sees its private disk (``hosts up --disks``; None: no private disks)."""

    def disk_of(self, host: str) -> Path:
        """``host``'s private disk as this process sees it (``hosts up --disks``)."""
        return self.hosts_dir / "disks" / host

    def seen(self, path: Path, host: str = "host0") -> Path:
        """``path`` as ``host`` sees it, from this process: on its private disk where the path
        is under :attr:`disks`, else the same path."""
        if self.disks is None or not path.is_relative_to(self.disks):
            return path
        return self.disk_of(host) / path.relative_to(self.disks)

    def exec_argv(self, host: str, command: Sequence[str]) -> list[str]:
        """The argv that runs ``command`` inside emulated host ``host``."""
        return [*EMULATE, "hosts", "exec", "--dir", str(self.hosts_dir), host, "--", *command]

    def driver_env(self) -> dict[str, str]:
        """This process's environment with :attr:`env`: for a driver of the cluster."""
        return {**_base_env(), **self.env}

    def run(
        self, host: str, command: Sequence[str], *, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside ``host`` with :meth:`driver_env`; its output captured."""
        return subprocess.run(
            self.exec_argv(host, command),
            env=self.driver_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def processes(self) -> list[psutil.Process]:
        """The live processes of the nodes (every process in a ``ray start``'s session: Ray's
        workers have process groups of their own)."""
        return _in_sessions(set(self.sessions.values()))


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # would override --address / make --head join a cluster
    return env


def _in_sessions(sids: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) in sids:
                found.append(proc)
    return found


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no {path})"
    return f"{path}:\n  " + "\n  ".join(text[-lines:] or ["(empty)"])


class _Cluster:
    """The processes and files behind one :class:`RayHosts`; :meth:`close` ends them all."""

    def __init__(
        self, *, count: int, link: str | None, work: Path, cpus: int, disks: Path | None = None
    ) -> None:
        if not 1 <= count <= 252:
            raise ValueError(f"count must be 1 to 252, not {count}")
        self.count, self.link, self.work, self.cpus = count, link, work, cpus
        self.disks = disks
        self.scratch: Path | None = None
        self.up: subprocess.Popen[bytes] | None = None
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.reapers: list[subprocess.Popen[bytes]] = []
        self.netns: set[int] = set()  # the hosts' network namespaces (inode numbers)
        self.sids: set[int] = set()
        self.view: RayHosts | None = None

    def start(self, timeout: float) -> RayHosts:
        self.work.mkdir(parents=True, exist_ok=True)
        # short: Ray's socket paths under a node's folder must fit in 107 bytes
        self.scratch = Path(tempfile.mkdtemp(prefix="rayhosts-", dir="/tmp"))
        token = self.scratch / "auth_token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        hosts = self._start_hosts(timeout)
        deadline = time.monotonic() + timeout
        address = f"{hosts['host0']}:{HEAD_PORT}"
        self.view = view = RayHosts(
            address=address,
            hosts_dir=self.work / "hosts",
            env={
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(token),
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # 0 would pin Ray to 127.0.0.1
            },
            hosts=hosts,
            temp_dirs={name: self.scratch / f"n{i}" for i, name in enumerate(hosts)},
            disks=None if self.disks is None else self.disks.resolve(),
        )
        self._start_node(view, "host0", ["--head", f"--port={HEAD_PORT}"])
        self._wait_for_head(view, deadline)
        for name in list(hosts)[1:]:
            self._start_node(view, name, [f"--address={address}"])
        view.nodes = self._wait_for_nodes(view, deadline)
        return view

    def _start_hosts(self, timeout: float) -> dict[str, str]:
        """``distsgd-emulate hosts up`` (``timeout`` seconds for one try), again while another set
        holds this machine's hosts (it refuses then); the hosts' names and addresses once
        ``hosts.json`` is there."""
        folder, log = self.work / "hosts", self.work / "hosts-up.log"
        state = folder / "hosts.json"
        argv = [*EMULATE, "hosts", "up", str(self.count), "--dir", str(folder)]
        argv += [] if self.link is None else ["--link", self.link]
        argv += [] if self.disks is None else ["--disks", str(self.disks)]
        lock_deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            with open(log, "wb") as out:
                self.up = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C is ours: we take the hosts down in order
                )  # fmt: skip
            self.sids.add(self.up.pid)
            self.reapers.append(self._reaper(self.up.pid, None))
            deadline = time.monotonic() + timeout
            while not state.exists() and self.up.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the emulated hosts did not come up; {_tail(log)}")
                time.sleep(0.2)
            if self.up.poll() is None:
                break
            said = log.read_text(errors="replace")
            busy = "is in use by" in said or "wait for it to end" in said
            if not busy or time.monotonic() > lock_deadline:
                raise RuntimeError(f"`distsgd-emulate hosts up` failed; {_tail(log)}")
            time.sleep(2.0)  # another set of emulated hosts is up: wait for it to go
        record = json.loads(state.read_text())
        for host in record["hosts"]:
            self.netns.add(os.stat(f"/proc/{host['keeper']}/ns/net").st_ino)
        return {host["name"]: host["address"] for host in record["hosts"]}

    def _reaper(self, pgid: int, folder: Path | None) -> subprocess.Popen[bytes]:
        """Ends the group ``pgid`` (and removes ``folder``) should this process die."""
        argv = [sys.executable, "-m", "distsgd.launcher.reaper", str(pgid)]
        return subprocess.Popen(
            argv + ([] if folder is None else [str(folder)]),
            env={**os.environ, "DISTSGD_PARENT_PID": str(os.getpid())},
            stdin=subprocess.DEVNULL,
        )

    def _start_node(self, view: RayHosts, host: str, role: list[str]) -> None:
        argv = [
            *RAY_START, *role, f"--node-ip-address={view.hosts[host]}",
            f"--num-cpus={self.cpus}", "--disable-usage-stats",
            f"--temp-dir={view.temp_dirs[host]}",
        ]  # fmt: skip
        if host == "host0":
            argv.append("--include-dashboard=false")  # refused on a node that is not the head
        env = {**view.driver_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        with open(self.work / f"ray-{host}.log", "wb") as out:
            process = subprocess.Popen(
                view.exec_argv(host, argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.nodes[host] = process
        self.sids.add(process.pid)
        view.sessions[host] = process.pid
        # should this process die: the head's reaper removes the whole scratch folder
        folder = self.scratch if host == "host0" else view.temp_dirs[host]
        self.reapers.append(self._reaper(process.pid, folder))

    def _check_nodes(self) -> None:
        for host, process in self.nodes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"ray start in {host} exited ({process.returncode}); "
                    f"{_tail(self.work / f'ray-{host}.log')}"
                )

    def _wait_for_head(self, view: RayHosts, deadline: float) -> None:
        current = view.temp_dirs["host0"] / "ray_current_cluster"
        while not (current.is_file() and current.read_text().strip()):
            self._check_nodes()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head did not start; {_tail(self.work / 'ray-host0.log')}")
            time.sleep(0.2)

    def _wait_for_nodes(self, view: RayHosts, deadline: float) -> list[str]:
        """Until a driver in host0 sees every node alive: their addresses."""
        said = ""
        while True:
            self._check_nodes()
            try:
                done = view.run("host0", [sys.executable, "-c", NODES_SNIPPET, view.address])
                lines = done.stdout.strip().splitlines()
                seen = json.loads(lines[-1]) if done.returncode == 0 and lines else []
                said = (done.stderr or done.stdout).strip()[-2000:]
            except (subprocess.TimeoutExpired, ValueError) as e:
                seen, said = [], repr(e)
            if len(seen) == self.count:
                return seen
            if time.monotonic() > deadline:
                logs = "\n".join(_tail(self.work / f"ray-{host}.log") for host in self.nodes)
                raise TimeoutError(
                    f"a driver in host0 saw {len(seen)} of {self.count} nodes alive "
                    f"({seen}); the driver said: {said or '(nothing)'}\n{logs}"
                )
            time.sleep(1.0)

    def close(self) -> None:
        """End the nodes (the others, then the head), the hosts, the reapers; remove the
        folders; raise RuntimeError naming what is left, if anything."""
        heads = {host: p for host, p in self.nodes.items() if host == "host0"}
        others = {host: p for host, p in self.nodes.items() if host != "host0"}
        for group in (others, heads):
            _end_sessions(list(group.values()))
        if self.up is not None:
            _end_sessions([self.up], grace=3 * STOP_GRACE_S)
        for reaper in self.reapers:  # each exits once its group is gone
            try:
                reaper.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()
        if self.scratch is not None:
            for _ in range(5):  # again if a process that was ending still wrote into it
                shutil.rmtree(self.scratch, ignore_errors=True)
                if not self.scratch.exists():
                    break
                time.sleep(0.2)
        left = self._left(settle=STOP_GRACE_S)
        if self.view is not None:
            self.view.left = left
        if left:
            raise RuntimeError(f"Ray on emulated hosts left {len(left)} behind: {left}")

    def _left(self, settle: float) -> list[str]:
        """What is left: processes of the nodes' sessions, in the hosts' namespaces or
        naming the scratch folder; the hosts' namespaces still named (``ip netns list``);
        the scratch folder. Waits up to ``settle`` seconds for what is still ending."""
        deadline = time.monotonic() + settle
        while True:
            left = _processes_left(self.sids, self.netns, self.scratch)
            left += _namespaces_left(self.netns)
            if self.scratch is not None and self.scratch.exists():
                left.append(f"folder {self.scratch}")
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def _end_sessions(processes: list[subprocess.Popen[bytes]], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to each process's group (each leads a session of its own); SIGKILL to the
    group and to everything left in its session after ``grace`` seconds (Ray's workers have
    groups of their own); the leaders reaped."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    sids = {process.pid for process in processes}
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in processes) and not _in_sessions(sids):
            break
        time.sleep(0.1)
    for _ in range(20):  # again: a process that was forking leaves a child the signal missed
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        stragglers = _in_sessions(sids)
        for proc in stragglers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if not stragglers:
            break
        time.sleep(0.1)
    for process in processes:
        process.wait()


def _processes_left(sids: set[int], netns: set[int], scratch: Path | None) -> list[str]:
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    left = []
    for proc in psutil.process_iter(["cmdline", "name", "status"]):
        if proc.pid in mine or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(OSError, psutil.Error):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if (
                os.getsid(proc.pid) in sids
                or (scratch is not None and str(scratch) in cmdline)
                or os.stat(f"/proc/{proc.pid}/ns/net").st_ino in netns
            ):
                left.append(f"process {proc.pid} {cmdline[:120] or proc.info['name']}")
    return left


def _namespaces_left(netns: set[int]) -> list[str]:
    """The hosts' namespaces that ``ip netns list`` still names (by their inode: a name may
    already be another set's)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    left = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        with contextlib.suppress(OSError):
            if name and os.stat(f"/run/netns/{name}").st_ino in netns:
                left.append(f"netns {name}")
    return left


@contextlib.contextmanager
def _suite_locks() -> Iterator[None]:
    """Hold the test suite's locks that exist (opened to read: nothing is made or written):
    each pytest run has its own, in its base folder ``/tmp/pytest-of-USER/pytest-N`` (the
    parent of its workers' base folders); by group, then by run, as each test takes them."""
    folder = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    seen: set[tuple[int, int]] = set()  # a file once: a second flock of it would wait on ours
    with contextlib.ExitStack() as stack:
        for group in SUITE_LOCKS:
            name = f"distsgd-{group}-tests.lock"
            for path in sorted([folder / name, *folder.glob(f"pytest-[0-9]*/{name}")]):
                with contextlib.suppress(OSError):
                    held = stack.enter_context(open(path, "rb"))
                    info = os.fstat(held.fileno())
                    if (info.st_dev, info.st_ino) not in seen:
                        seen.add((info.st_dev, info.st_ino))
                        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def ray_on_hosts(
    count: int = 3,
    *,
    link: str | None = "1gbit",
    work: Path,
    cpus: int = 2,
    timeout: float = START_TIMEOUT_S,
    disks: Path | None = None,
) -> Iterator[RayHosts]:
    """A Ray cluster with one node per emulated host (``count`` hosts, ``link`` their rate,
    None: unshaped; ``cpus`` per node); ``work`` keeps the hosts' folder and the ``ray
    start`` logs. Yields once a driver in host0 sees every node alive; on the way out ends
    everything and raises RuntimeError if a process or a namespace is left. Root only. Holds
    the test suite's locks of runs on emulated hosts and on Ray meanwhile (:data:`SUITE_LOCKS`).
    ``disks``: each host sees a private disk there (``distsgd-emulate hosts up --disks``; a
    host's, as this process sees it: :meth:`RayHosts.disk_of`)."""
    with _suite_locks():
        cluster = _Cluster(count=count, link=link, work=work, cpus=cpus, disks=disks)
        try:
            yield cluster.start(timeout)
        finally:
            cluster.close()


CHECK_SNIPPET = """
import json, socket, sys, time, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

@ray.remote(num_cpus=0)
def probe(head):
    import socket, time, ray
    host, port = head.rsplit(":", 1)
    started = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            tcp = {"ok": True, "from": conn.getsockname()[0]}
    except OSError as e:
        tcp = {"ok": False, "error": repr(e)}
    tcp["ms"] = round(1000 * (time.monotonic() - started), 2)
    return {"node_ip": ray.util.get_node_ip_address(), "tcp_to_head": tcp}

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
started = time.monotonic()
refs = {
    ip: probe.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote(sys.argv[1])
    for ip, node_id in nodes.items()
}
tasks = {ip: ray.get(ref, timeout=120) for ip, ref in refs.items()}
print(json.dumps({
    "driver_node_ip": ray.util.get_node_ip_address(),
    "tasks_s": round(time.monotonic() - started, 2),
    "tasks": tasks,
}))
"""
"""A driver that runs one task pinned to each node (argv[1]: the GCS) and prints what each saw."""


def _memory(cluster: RayHosts) -> dict[str, float]:
    rss = uss = 0
    processes = cluster.processes()
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            rss, uss = rss + info.rss, uss + info.uss
    return {"processes": len(processes), "rss_mib": rss / 2**20, "uss_mib": uss / 2**20}


def _check(cluster: RayHosts) -> dict[str, object]:
    """One task per node from a driver in host0; what it saw, every node's address right."""
    done = cluster.run("host0", [sys.executable, "-c", CHECK_SNIPPET, cluster.address])
    if done.returncode != 0:
        raise RuntimeError(f"the check's driver failed ({done.returncode}): {done.stderr[-2000:]}")
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    tasks = seen["tasks"]
    wrong = [
        ip
        for ip, task in tasks.items()
        if task["node_ip"] != ip or not task["tcp_to_head"]["ok"]
        or task["tcp_to_head"]["from"] != ip
    ]  # fmt: skip
    if sorted(tasks) != sorted(cluster.hosts.values()) or wrong:
        raise RuntimeError(f"the nodes' tasks saw the wrong addresses: {json.dumps(seen)}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--link", default="1gbit", help="the hosts' rate; 'none': unshaped")
    parser.add_argument("--cpus", type=int, default=2, help="--num-cpus of each node")
    parser.add_argument("--out", type=Path, default=None, help="keep the logs here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # tear down too
    work = args.out or Path(tempfile.mkdtemp(prefix="rayhosts-work-"))
    link = None if args.link == "none" else args.link
    started = time.monotonic()
    summary: dict[str, object] = {"count": args.count, "link": link}
    with ray_on_hosts(args.count, link=link, work=work, cpus=args.cpus) as cluster:
        summary["up_s"] = round(time.monotonic() - started, 2)
        summary["address"] = cluster.address
        summary["nodes"] = cluster.nodes
        summary["memory"] = {k: round(v, 1) for k, v in _memory(cluster).items()}
        summary["check"] = _check(cluster)
        summary["memory_after_tasks"] = {k: round(v, 1) for k, v in _memory(cluster).items()}
        ending = time.monotonic()
    summary["down_s"] = round(time.monotonic() - ending, 2)
    summary["left"] = cluster.left
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        summary["logs"] = str(work)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
