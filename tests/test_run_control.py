"""The launcher's run control (``launcher/control.py``) and a task's side of it
(``control/remote_files.py``): the run folder's files over the network, checked by the one table
of what tasks write (``control.folder.TASK_FILES``). A server on loopback, port 0; no task
processes."""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from distsgd.control.faults import Fault, FaultInjector, kill_landed, kill_marker
from distsgd.control.folder import LocalFiles, task_file
from distsgd.control.remote_files import ControlError, RemoteFiles
from distsgd.control.task import TaskEnv
from distsgd.launcher.control import ControlServer
from distsgd.transport.errors import PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import METADATA_KEY

SECRET = "s" * 32


@pytest.fixture
def control(tmp_path: Path) -> Iterator[ControlServer]:
    server = ControlServer(tmp_path / "run", host="127.0.0.1", secret=SECRET)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def files(control: ControlServer) -> Iterator[RemoteFiles]:
    remote = RemoteFiles(control.address, secret=SECRET, timeout=5.0)
    try:
        yield remote
    finally:
        remote.close()


def _raw_put(control: ControlServer, first: pb.RunFileChunk, *data: bytes, secret: str = SECRET):
    """A PutFile as a peer may send it, past the client's own checks."""
    with grpc.insecure_channel(control.address) as channel:
        stub = pb_grpc.RunControlStub(channel)
        chunks = [first, *(pb.RunFileChunk(data=d) for d in data), pb.RunFileChunk(last=True)]
        return stub.PutFile(iter(chunks), timeout=5, metadata=((METADATA_KEY, secret),))


def _first(name: str, write: int = pb.RUN_FILE_WRITE_REPLACE, version: int = PROTOCOL_VERSION):
    header = pb.RequestHeader(protocol_version=version, worker=-1)
    return pb.RunFileChunk(header=header, name=name, write=write)


def test_files_round_trip_into_the_launchers_folder(control: ControlServer, files: RemoteFiles):
    run = control.service.run_dir
    files.put("ps0.address", b"198.18.0.1:4000\n")
    assert files.get("ps0.address") == b"198.18.0.1:4000\n"
    assert files.get("ps1.address") is None
    files.put_stream("final_model.pt", lambda f: f.write(b"w" * 9_000_000))  # 3 chunks
    assert (run / "final_model.pt").read_bytes() == b"w" * 9_000_000
    assert stat.S_IMODE((run / "final_model.pt").stat().st_mode) == 0o600
    files.put("faults/kill-worker1-at-40.due", b"41\n")
    files.remove("faults/kill-worker1-at-40.due")
    assert not (run / "faults/kill-worker1-at-40.due").exists()
    assert sorted(p.name for p in run.iterdir()) == ["faults", "final_model.pt", "ps0.address"]


def test_metrics_lines_arrive_whole_with_their_tensorboard_events(
    control: ControlServer, files: RemoteFiles
) -> None:
    other = RemoteFiles(control.address, secret=SECRET, timeout=5.0)
    lines = [
        (json.dumps({"time": 1.0 + i, "task": f"worker{i % 2}", "step": i, "loss": 0.5}) + "\n")
        for i in range(200)
    ]
    for i, line in enumerate(lines):
        (files if i % 2 == 0 else other).append("metrics.jsonl", line.encode())
    files.close()
    other.close()
    text = (control.service.run_dir / "metrics.jsonl").read_text()
    assert sorted(text.splitlines(keepends=True)) == sorted(lines)
    board = control.service.run_dir / "tensorboard"
    pytest.importorskip("tensorboard")
    assert sorted(p.name for p in board.iterdir()) == ["worker0", "worker1"]


@pytest.mark.parametrize(
    ("name", "write", "data"),
    [
        ("../escape.address", pb.RUN_FILE_WRITE_REPLACE, b"x"),  # outside the folder
        ("/etc/ps0.address", pb.RUN_FILE_WRITE_REPLACE, b"x"),
        ("secret", pb.RUN_FILE_WRITE_REPLACE, b"x"),  # the launcher's own file
        ("config.json", pb.RUN_FILE_WRITE_REPLACE, b"{}"),
        ("metrics.jsonl", pb.RUN_FILE_WRITE_REPLACE, b"{}\n"),  # appended only
        ("ps0.address", pb.RUN_FILE_WRITE_APPEND, b"x"),  # replaced only
        ("ps0.address", pb.RUN_FILE_WRITE_REPLACE, b"x" * 257),  # over its size
        ("metrics.jsonl", pb.RUN_FILE_WRITE_APPEND, b'{"a": 1}'),  # a line not ended
        ("metrics.jsonl", pb.RUN_FILE_WRITE_APPEND, b"[1]\n"),  # not an object
        ("metrics.jsonl", pb.RUN_FILE_WRITE_APPEND, b"\xff\n"),  # not text
    ],
)
def test_a_peer_cannot_write_what_the_table_does_not_allow(
    control: ControlServer, name: str, write: int, data: bytes
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _raw_put(control, _first(name, write), data)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run = control.service.run_dir
    assert not run.exists() or not [p for p in run.rglob("*") if p.is_file()]
    assert not (run.parent / "escape.address").exists()


def test_wrong_secret_and_protocol_are_refused(control: ControlServer) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _raw_put(control, _first("ps0.address"), b"x", secret="t" * 32)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as caught:
        _raw_put(control, _first("ps0.address", version=PROTOCOL_VERSION + 1), b"x")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    wrong = RemoteFiles(control.address, secret="t" * 32, timeout=2.0)
    with pytest.raises(ControlError) as refused:
        wrong.get("ps0.address")
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    wrong.close()


def test_a_replacement_cut_short_leaves_the_old_file(control: ControlServer) -> None:
    files = RemoteFiles(control.address, secret=SECRET, timeout=5.0)
    files.put("result.json", b'{"old": true}\n')
    files.close()

    def broken() -> Iterator[pb.RunFileChunk]:
        yield _first("result.json")
        yield pb.RunFileChunk(data=b'{"new"')
        raise RuntimeError("the task died mid-stream")

    with grpc.insecure_channel(control.address) as channel:
        stub = pb_grpc.RunControlStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.PutFile(broken(), timeout=5, metadata=((METADATA_KEY, SECRET),))
    run = control.service.run_dir
    # the server's handler sees the cancelled stream after the client does
    deadline = time.monotonic() + 5
    while len(list(run.iterdir())) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (run / "result.json").read_text() == '{"old": true}\n'
    assert [p.name for p in run.iterdir()] == ["result.json"]  # no temporary file left


@pytest.mark.parametrize("name", ["result.json", "metrics.jsonl"])
def test_a_stream_that_ends_without_its_last_chunk_writes_nothing(
    control: ControlServer, name: str
) -> None:
    """A cancelled call can end the server's reading as a whole stream would (seen under
    load: a cut-short replacement was renamed into place). Only a stream whose final chunk
    says ``last`` is written; one that just ends is CANCELLED and changes nothing."""
    write = pb.RUN_FILE_WRITE_APPEND if name.endswith(".jsonl") else pb.RUN_FILE_WRITE_REPLACE
    with grpc.insecure_channel(control.address) as channel:
        stub = pb_grpc.RunControlStub(channel)
        chunks = iter([_first(name, write), pb.RunFileChunk(data=b'{"cut": true}\\n')])
        with pytest.raises(grpc.RpcError) as cut:
            stub.PutFile(chunks, timeout=5, metadata=((METADATA_KEY, SECRET),))
    assert cut.value.code() == grpc.StatusCode.CANCELLED
    assert list(control.service.run_dir.iterdir()) == []


def test_appends_to_a_launcher_that_is_gone_are_dropped_not_raised(tmp_path: Path) -> None:
    server = ControlServer(tmp_path, host="127.0.0.1", secret=SECRET)
    files = RemoteFiles(server.address, secret=SECRET, timeout=1.0)
    server.close()
    files.append("metrics.jsonl", b'{"task": "worker0"}\n')
    files.close()  # flushes: the launcher does not answer
    assert files.dropped == len(b'{"task": "worker0"}\n')
    with pytest.raises(ControlError):
        RemoteFiles(server.address, secret=SECRET, timeout=1.0).get("ps0.address")


def test_the_client_refuses_names_the_table_does_not_hold(files: RemoteFiles) -> None:
    for call in (
        lambda: files.put("x/../../etc/passwd", b""),
        lambda: files.append("result.json", b"{}\n"),
        lambda: files.get("metrics.jsonl"),  # not read back by tasks
    ):
        with pytest.raises(ValueError):
            call()
    assert task_file("faults/lose-host-worker1-at-40.landed").readable


def test_a_kill_mark_travels_both_ways(control: ControlServer, files: RemoteFiles) -> None:
    """A worker at a kill's step marks it due through the run control and holds still until
    the launcher (on its own disk) marks it landed."""
    run = control.service.run_dir
    fault = Fault.parse("kill:worker:1@step=5")
    injector = FaultInjector([fault], files=files)
    landed = threading.Timer(0.3, lambda: kill_landed(run, fault))
    landed.start()
    injector.before_step(6)
    landed.join()
    assert kill_marker(run, fault, "due").read_text() == "6\n"
    assert not injector.kills
    assert FaultInjector([fault], files=None).kills == []  # no run folder: no kills


def test_a_worker_learns_the_servers_addresses_from_the_run_control(
    control: ControlServer, files: RemoteFiles
) -> None:
    env = TaskEnv(
        cluster={"ps": ["198.18.0.1:0", "198.18.0.2:7"], "worker": ["198.18.0.3:0"]},
        task_index=0,
        scheme="hogwild",
        control=control.address,
    )
    threading.Timer(0.2, lambda: files.put("ps0.address", b"198.18.0.1:4100\n")).start()
    bound = env.with_ps_addresses(5.0, files=files)
    assert bound.cluster["ps"] == ["198.18.0.1:4100", "198.18.0.2:7"]
    with pytest.raises(TimeoutError, match="ps1 did not report its address in the run control"):
        TaskEnv(
            cluster={"ps": ["198.18.0.1:0", "198.18.0.2:0"], "worker": ["198.18.0.3:0"]},
            task_index=0,
            scheme="hogwild",
            control=control.address,
        ).with_ps_addresses(0.3, files=RemoteFiles(control.address, secret=SECRET))


def test_local_files_keep_the_same_rules(tmp_path: Path) -> None:
    files = LocalFiles(tmp_path)
    files.append("metrics.jsonl", b"{}\n")
    files.put("ps3.address", b"127.0.0.1:1\n")
    assert files.get("ps3.address") == b"127.0.0.1:1\n"
    with pytest.raises(ValueError):
        files.put("../x", b"")


def test_replicas_on_an_engines_nodes_report_to_the_run_control(tmp_path: Path) -> None:
    """On Ray the engine places a replica (no emulated host) and it reports its address to
    the run control; one that is up is taken to hold its server's snapshot."""
    from distsgd.launcher.replicas import Replicas

    started: list[tuple[str, list[str], object]] = []

    class _Task:
        name = "replica0"

        def poll(self) -> int | None:
            return None

    def start(name: str, argv: list[str], host: object) -> _Task:
        started.append((name, argv, host))
        return _Task()

    replicas = Replicas(
        place=lambda ps: ("ray-node.invalid", None),
        run_dir=tmp_path,
        run_id="r",
        python=["distsgd"],
        start_task=start,  # type: ignore[arg-type]
        wait_address=lambda task, path: "198.18.0.3:4000",
        holds=None,
        note=print,
        event=lambda **_: None,
        control="198.18.0.253:5000",
    )
    assert not replicas.holds_state(0)  # not started
    replicas.start(1)
    ((name, argv, host),) = started
    assert (name, host) == ("replica0", None)
    assert argv[argv.index("--address") + 1] == "ray-node.invalid:0"
    assert argv[argv.index("--control") + 1] == "198.18.0.253:5000"
    assert "--address-file" not in argv
    assert replicas.address(0) == "198.18.0.3:4000" and replicas.holds_state(0)
