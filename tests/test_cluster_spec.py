"""Tests for distsgd.cluster: cluster specs, task ids, files, flags and TF_CONFIG."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distsgd.cluster import (
    JOBS,
    ClusterSpec,
    ClusterSpecError,
    TaskId,
    parse_tf_config,
    resolve_cluster,
)

PS = ["127.0.0.1:2222"]
WORKERS = ["127.0.0.1:2223", "127.0.0.1:2224"]
NO_WORKER = (
    'cluster.worker: no worker task; list at least one address, e.g. worker = ["127.0.0.1:2223"]'
)


def _error(exc_info: pytest.ExceptionInfo[ClusterSpecError]) -> str:
    """The error message, checked to be a single line."""
    message = str(exc_info.value)
    assert "\n" not in message
    assert message
    return message


# --------------------------------------------------------------------------- TaskId


@pytest.mark.parametrize(
    ("text", "job", "index"),
    [
        ("worker:1", "worker", 1),
        ("worker1", "worker", 1),
        ("ps:0", "ps", 0),
        ("ps0", "ps", 0),
        ("worker:12", "worker", 12),
        (" worker:3 ", "worker", 3),
        ("/job:worker/task:2", "worker", 2),
        ("/job:ps/replica:0/task:1", "ps", 1),
    ],
)
def test_task_id_parse(text: str, job: str, index: int) -> None:
    assert TaskId.parse(text) == TaskId(job=job, index=index)


@pytest.mark.parametrize("text", ["", "worker", "worker:", "evaluator:0", "worker:-1", "w:1", "1"])
def test_task_id_parse_rejects_bad_text(text: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        TaskId.parse(text)
    message = _error(exc_info)
    assert repr(text) in message
    assert "worker:0" in message


def test_task_id_properties() -> None:
    assert JOBS == ("ps", "worker")
    assert TaskId(job="ps", index=0).name == "ps0"
    assert TaskId(job="worker", index=1).name == "worker1"
    assert TaskId(job="worker", index=0).is_chief
    assert not TaskId(job="worker", index=1).is_chief
    assert not TaskId(job="ps", index=0).is_chief
    assert hash(TaskId(job="ps", index=0)) == hash(TaskId(job="ps", index=0))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"job": "chief", "index": 0}, "task.job"),
        ({"job": "worker", "index": -1}, "task.index"),
        ({"job": "worker", "index": True}, "task.index"),
        ({"job": "worker", "index": "0"}, "task.index"),
    ],
)
def test_task_id_validates(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        TaskId(**kwargs)  # type: ignore[arg-type]
    assert _error(exc_info).startswith(field + ":")


# --------------------------------------------------------------------------- ClusterSpec basics


def test_spec_basics() -> None:
    spec = ClusterSpec(ps=PS, worker=WORKERS)  # type: ignore[arg-type]
    assert spec.ps == tuple(PS)
    assert spec.worker == tuple(WORKERS)
    assert isinstance(spec.ps, tuple) and isinstance(spec.worker, tuple)
    assert spec.num_ps == 1
    assert spec.num_workers == 2
    assert [t.name for t in spec.tasks()] == ["ps0", "worker0", "worker1"]
    assert spec.address(TaskId(job="worker", index=1)) == "127.0.0.1:2224"
    assert spec.address(TaskId(job="ps", index=0)) == "127.0.0.1:2222"
    assert spec.task("worker", 1) == TaskId(job="worker", index=1)
    assert hash(spec) == hash(ClusterSpec(ps=tuple(PS), worker=tuple(WORKERS)))


def test_spec_without_ps() -> None:
    spec = ClusterSpec(worker=("localhost:5000",))
    assert spec.num_ps == 0
    assert spec.tasks() == [TaskId(job="worker", index=0)]


@pytest.mark.parametrize(
    "address",
    ["[::1]:2222", "[fe80::1%eth0]:80", "host-1.example.com:65535", "10.0.0.1:0", "h:1"],
)
def test_spec_accepts_addresses(address: str) -> None:
    assert ClusterSpec(worker=(address,)).worker == (address,)


def test_with_address() -> None:
    spec = ClusterSpec.local(num_workers=2, num_ps=1)
    task = TaskId(job="worker", index=1)
    updated = spec.with_address(task, "127.0.0.1:4000")
    assert updated.address(task) == "127.0.0.1:4000"
    assert updated.worker[0] == "127.0.0.1:0"
    assert updated.ps == spec.ps
    assert spec.address(task) == "127.0.0.1:0"  # original unchanged


def test_with_address_validates() -> None:
    spec = ClusterSpec(ps=("127.0.0.1:2222",), worker=("127.0.0.1:0",))
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.with_address(TaskId(job="worker", index=0), "127.0.0.1:2222")
    assert "also used by ps[0]" in _error(exc_info)
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.with_address(TaskId(job="worker", index=3), "127.0.0.1:1")
    assert "out of range" in _error(exc_info)


def test_local() -> None:
    spec = ClusterSpec.local(num_workers=3, num_ps=2)
    assert spec.ps == ("127.0.0.1:0",) * 2
    assert spec.worker == ("127.0.0.1:0",) * 3
    assert ClusterSpec.local(num_workers=1, num_ps=0, host="::1").worker == ("[::1]:0",)


@pytest.mark.parametrize(
    ("num_workers", "num_ps", "field"),
    [(0, 1, "num_workers"), (1, -1, "num_ps"), (True, 0, "num_workers")],
)
def test_local_validates(num_workers: int, num_ps: int, field: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.local(num_workers=num_workers, num_ps=num_ps)
    assert _error(exc_info).startswith(field + ":")


def test_port_zero_duplicates_allowed() -> None:
    spec = ClusterSpec(ps=("127.0.0.1:0", "127.0.0.1:0"), worker=("127.0.0.1:0",) * 3)
    assert spec.num_ps == 2 and spec.num_workers == 3


# --------------------------------------------------------------------------- validation errors


@pytest.mark.parametrize(
    ("ps", "worker", "expected"),
    [
        (
            (),
            (),
            NO_WORKER,
        ),
        (
            ("localhost:abc",),
            ("127.0.0.1:2223",),
            "cluster.ps[0]: bad port 'abc' in 'localhost:abc'; use host:port with a port 0-65535",
        ),
        (
            ("127.0.0.1:2222",),
            ("127.0.0.1:2223", "127.0.0.1:2222"),
            "cluster.worker[1]: address 127.0.0.1:2222 is also used by ps[0]; "
            "give each task its own port",
        ),
    ],
)
def test_spec_error_messages_exact(
    ps: tuple[str, ...], worker: tuple[str, ...], expected: str
) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec(ps=ps, worker=worker)
    assert _error(exc_info) == expected


@pytest.mark.parametrize(
    ("address", "needle"),
    [
        ("localhost", "missing port"),
        ("localhost:", "bad port ''"),
        ("localhost:65536", "bad port '65536'"),
        ("localhost:-1", "bad port '-1'"),
        ("localhost:+1", "bad port '+1'"),
        ("localhost: 1", "bad port ' 1'"),
        (":2222", "empty host"),
        ("::1:2222", "must be in brackets"),
        ("[::1:2222", "bad IPv6 host"),
        ("[nothex]:2222", "bad IPv6 host"),
        ("my host:2222", "bad host"),
        ("http://h:2222", "bad host"),
    ],
)
def test_bad_address(address: str, needle: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec(worker=("127.0.0.1:1", address))
    message = _error(exc_info)
    assert message.startswith("cluster.worker[1]: ")
    assert needle in message


@pytest.mark.parametrize(
    ("ps", "worker", "field", "other"),
    [
        ((), ("h:1", "h:1"), "cluster.worker[1]", "worker[0]"),
        (("h:1", "H:1"), ("w:1",), "cluster.ps[1]", "ps[0]"),
        (("[::1]:5",), ("[0:0::1]:5",), "cluster.worker[0]", "ps[0]"),
    ],
)
def test_duplicate_address(
    ps: tuple[str, ...], worker: tuple[str, ...], field: str, other: str
) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec(ps=ps, worker=worker)
    message = _error(exc_info)
    assert message.startswith(field + ": ")
    assert f"also used by {other}" in message
    assert "give each task its own port" in message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"worker": "127.0.0.1:1"}, "cluster.worker"),
        ({"worker": ("127.0.0.1:1", 2)}, "cluster.worker[1]"),
        ({"worker": ("127.0.0.1:1",), "ps": None}, "cluster.ps"),
    ],
)
def test_spec_rejects_non_list(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec(**kwargs)  # type: ignore[arg-type]
    assert _error(exc_info).startswith(field + ": ")


@pytest.mark.parametrize(("job", "index"), [("worker", 2), ("worker", -1), ("ps", 1)])
def test_task_out_of_range(job: str, index: int) -> None:
    spec = ClusterSpec(ps=PS, worker=WORKERS)  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.task(job, index)
    message = _error(exc_info)
    assert f"task index {index} out of range for job {job!r}" in message


def test_task_out_of_range_message_exact() -> None:
    spec = ClusterSpec(worker=WORKERS)  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.task("worker", 3)
    assert (
        _error(exc_info) == "task index 3 out of range for job 'worker' (2 tasks); use --task 0..1"
    )
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.address(TaskId(job="ps", index=0))
    assert "this cluster has no ps tasks" in _error(exc_info)


def test_task_unknown_job() -> None:
    spec = ClusterSpec(worker=WORKERS)  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.task("chief", 0)
    message = _error(exc_info)
    assert "'chief'" in message and "ps, worker" in message


# --------------------------------------------------------------------------- from_dict


@pytest.mark.parametrize(
    "data",
    [
        {"ps": PS, "worker": WORKERS},
        {"cluster": {"ps": PS, "worker": WORKERS}},
        {"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "worker", "index": 0}},
        {"chief": WORKERS[:1], "ps": PS, "worker": WORKERS[1:]},
        {"ps": tuple(PS), "worker": tuple(WORKERS)},
    ],
)
def test_from_dict_forms(data: dict[str, object]) -> None:
    assert ClusterSpec.from_dict(data) == ClusterSpec(ps=tuple(PS), worker=tuple(WORKERS))


def test_from_dict_chief_first() -> None:
    spec = ClusterSpec.from_dict({"worker": ["w0:1", "w1:1"], "chief": ["c:1"]})
    assert spec.worker == ("c:1", "w0:1", "w1:1")
    assert ClusterSpec.from_dict({"chief": ["c:1"]}).worker == ("c:1",)


def test_to_dict_round_trip() -> None:
    spec = ClusterSpec(ps=("a:1", "b:2"), worker=("[::1]:3", "c:0", "c:0"))
    data = spec.to_dict()
    assert data == {"ps": ["a:1", "b:2"], "worker": ["[::1]:3", "c:0", "c:0"]}
    assert ClusterSpec.from_dict(data) == spec
    assert ClusterSpec.from_dict(json.loads(json.dumps(data))) == spec


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"ps": PS, "worker": WORKERS, "evaluator": ["e:1"]},
            "cluster: unknown job 'evaluator'; allowed jobs are ps, worker (and TF_CONFIG's chief)",
        ),
        (
            {},
            NO_WORKER,
        ),
        (
            {"ps": ["localhost:abc"], "worker": WORKERS},
            "cluster.ps[0]: bad port 'abc' in 'localhost:abc'; use host:port with a port 0-65535",
        ),
        (
            {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2222"]},
            "cluster.worker[1]: address 127.0.0.1:2222 is also used by ps[0]; "
            "give each task its own port",
        ),
    ],
)
def test_from_dict_error_messages_exact(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_dict(data)
    assert _error(exc_info) == expected


@pytest.mark.parametrize(
    ("data", "field", "needle"),
    [
        ({"master": ["m:1"], "worker": WORKERS}, "cluster", "unknown job 'master'"),
        ({"workers": WORKERS}, "cluster", "unknown job 'workers'"),
        ({"worker": "127.0.0.1:1"}, "cluster.worker", "expected a list"),
        ({"worker": {"a": 1}}, "cluster.worker", "expected a list"),
        ({"worker": WORKERS, "ps": 3}, "cluster.ps", "expected a list"),
        ({"worker": ["a:1", None]}, "cluster.worker[1]", 'expected a "host:port" string'),
        ({"chief": ["c:1", "d:1"], "worker": WORKERS}, "cluster.chief", "exactly one"),
        ({"chief": "c:1"}, "cluster.chief", "expected a list"),
        ({"chief": ["c:1"], "worker": ["c:1"]}, "cluster.worker[0]", "also used by chief[0]"),
        ({"chief": ["c:1"], "worker": ["w:1", "w:x"]}, "cluster.worker[1]", "bad port 'x'"),
        ({"cluster": ["a:1"]}, "cluster", "expected 'cluster'"),
        ({"cluster": {"worker": WORKERS}, "extra": 1}, "cluster", "unexpected key 'extra'"),
        ({"cluster": {"evaluator": ["e:1"]}}, "cluster", "unknown job 'evaluator'"),
    ],
)
def test_from_dict_errors(data: dict[str, object], field: str, needle: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_dict(data)
    message = _error(exc_info)
    assert message.startswith(field + ": ")
    assert needle in message


def test_from_dict_unknown_job_lists_allowed() -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_dict({"worker": WORKERS, "evaluator": ["e:1"]}, source="myjob")
    message = _error(exc_info)
    assert message.startswith("myjob: unknown job 'evaluator'")
    assert "ps, worker" in message


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_dict(["a:1"])  # type: ignore[arg-type]
    assert _error(exc_info).startswith("cluster: ")


# --------------------------------------------------------------------------- from_file


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.json", json.dumps({"ps": PS, "worker": WORKERS})),
        ("c.json", json.dumps({"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "ps"}})),
        ("c.JSON", json.dumps({"chief": WORKERS[:1], "worker": WORKERS[1:], "ps": PS})),
        (
            "c.toml",
            '[cluster]\nps = ["127.0.0.1:2222"]\nworker = ["127.0.0.1:2223", "127.0.0.1:2224"]\n',
        ),
        ("c.toml", 'ps = ["127.0.0.1:2222"]\nworker = ["127.0.0.1:2223", "127.0.0.1:2224"]\n'),
        (
            "c.toml",
            'ps = ["127.0.0.1:2222"]\nchief = ["127.0.0.1:2223"]\nworker = ["127.0.0.1:2224"]\n',
        ),
    ],
)
def test_from_file(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    expected = ClusterSpec(ps=tuple(PS), worker=tuple(WORKERS))
    assert ClusterSpec.from_file(path) == expected
    assert ClusterSpec.from_file(str(path)) == expected


def test_from_file_toml_without_ps(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nworker = ["localhost:0", "localhost:0"]\n', encoding="utf-8")
    assert ClusterSpec.from_file(path) == ClusterSpec.local(
        num_workers=2, num_ps=0, host="localhost"
    )


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("c.toml", "[cluster\nworker = 1", "invalid TOML"),
        ("c.json", "{not json", "invalid JSON"),
        ("c.json", "[1, 2]", "expected an object"),
        ("c.yaml", "worker: [a:1]", "unknown cluster file type '.yaml'"),
        ("cluster", "{}", "unknown cluster file type (no suffix)"),
        ("c.json", b"\xff\xfe\x00", "not UTF-8"),
        ("c.json", '{"worker": []}', "cluster.worker: no worker task"),
        ("c.toml", 'worker = ["a:1"]\nevaluator = ["e:1"]\n', "cluster: unknown job 'evaluator'"),
        ("c.toml", 'worker = "a:1"\n', "cluster.worker: expected a list"),
        ("c.toml", '[cluster]\nworker = ["a:1", "a:1"]\n', "cluster.worker[1]: address a:1"),
    ],
)
def test_from_file_errors(tmp_path: Path, name: str, content: str | bytes, needle: str) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_file(path)
    message = _error(exc_info)
    assert message.startswith(f"{path}: ")
    assert needle in message


def test_from_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_file(path)
    message = _error(exc_info)
    assert message.startswith(f"{path}: ")
    assert "not found" in message and "--cluster" in message


def test_from_file_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "dir.json"
    path.mkdir()
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_file(path)
    message = _error(exc_info)
    assert message.startswith(f"{path}: cannot read cluster file")


# --------------------------------------------------------------------------- from_flags


@pytest.mark.parametrize(
    ("ps_hosts", "worker_hosts", "ps", "worker"),
    [
        ("127.0.0.1:2222", "127.0.0.1:2223,127.0.0.1:2224", PS, WORKERS),
        (None, "h:1", [], ["h:1"]),
        ("", "h:1", [], ["h:1"]),
        (" a:1 , b:2 ,", "h:1,", ["a:1", "b:2"], ["h:1"]),
        ("[::1]:1", "[::1]:2", ["[::1]:1"], ["[::1]:2"]),
    ],
)
def test_from_flags(
    ps_hosts: str | None, worker_hosts: str, ps: list[str], worker: list[str]
) -> None:
    spec = ClusterSpec.from_flags(ps_hosts=ps_hosts, worker_hosts=worker_hosts)
    assert spec.to_dict() == {"ps": ps, "worker": worker}


@pytest.mark.parametrize(
    ("ps_hosts", "worker_hosts", "field", "needle"),
    [
        ("a:1", None, "--worker-hosts", "no worker task"),
        ("a:1", "", "--worker-hosts", "no worker task"),
        ("a:x", "b:1", "--ps-hosts[0]", "bad port 'x'"),
        ("a:1", "b:1,a:1", "--worker-hosts[1]", "also used by ps[0]"),
    ],
)
def test_from_flags_errors(
    ps_hosts: str | None, worker_hosts: str | None, field: str, needle: str
) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        ClusterSpec.from_flags(ps_hosts=ps_hosts, worker_hosts=worker_hosts)
    message = _error(exc_info)
    assert message.startswith(field + ": ")
    assert needle in message


# --------------------------------------------------------------------------- TF_CONFIG


def test_tf_config_round_trip() -> None:
    spec = ClusterSpec(ps=tuple(PS), worker=tuple(WORKERS))
    for task in spec.tasks():
        text = spec.to_tf_config(task)
        assert json.loads(text)["task"] == {"type": task.job, "index": task.index}
        assert parse_tf_config(text) == (spec, task)


def test_to_tf_config_validates_task() -> None:
    spec = ClusterSpec(worker=WORKERS)  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError) as exc_info:
        spec.to_tf_config(TaskId(job="worker", index=5))
    assert "out of range" in _error(exc_info)


def test_parse_tf_config_without_task() -> None:
    text = json.dumps({"cluster": {"worker": WORKERS}})
    assert parse_tf_config(text) == (ClusterSpec(worker=tuple(WORKERS)), None)
    text = json.dumps({"cluster": {"worker": WORKERS}, "task": {}, "environment": "cloud"})
    assert parse_tf_config(text)[1] is None


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ({"type": "chief", "index": 0}, TaskId(job="worker", index=0)),
        ({"type": "worker", "index": 0}, TaskId(job="worker", index=1)),
        ({"type": "worker", "index": 1}, TaskId(job="worker", index=2)),
        ({"type": "ps", "index": 0}, TaskId(job="ps", index=0)),
    ],
)
def test_parse_tf_config_chief_mapping(task: dict[str, object], expected: TaskId) -> None:
    text = json.dumps(
        {"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"]}, "task": task}
    )
    spec, parsed = parse_tf_config(text)
    assert spec == ClusterSpec(ps=("p:1",), worker=("c:1", "w:1", "w:2"))
    assert parsed == expected


@pytest.mark.parametrize(
    ("text", "field", "needle"),
    [
        ("{not json", "TF_CONFIG", "invalid JSON"),
        ("[]", "TF_CONFIG", '"cluster"'),
        ('{"task": {"type": "worker", "index": 0}}', "TF_CONFIG", '"cluster"'),
        ('{"cluster": {"worker": ["a:1"]}, "bogus": 1}', "TF_CONFIG", "unexpected key 'bogus'"),
        (
            '{"cluster": {"worker": ["a:1"], "evaluator": ["e:1"]}}',
            "TF_CONFIG.cluster",
            "unknown job 'evaluator'",
        ),
        ('{"cluster": {"worker": "a:1"}}', "TF_CONFIG.cluster.worker", "expected a list"),
        (
            '{"cluster": {"worker": ["a:1", "a:1"]}}',
            "TF_CONFIG.cluster.worker[1]",
            "also used by worker[0]",
        ),
        ('{"cluster": {"worker": ["a:1"]}, "task": 3}', "TF_CONFIG.task", "expected an object"),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}',
            "TF_CONFIG.task.type",
            "unknown type 'evaluator'",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
            "TF_CONFIG.task.index",
            "no chief tasks",
        ),
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
            "TF_CONFIG.task.index",
            "index 2 out of range for job 'worker' (2 tasks); use 0..1",
        ),
        (
            '{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, '
            '"task": {"type": "worker", "index": 1}}',
            "TF_CONFIG.task.index",
            "index 1 out of range for job 'worker' (1 tasks)",
        ),
        (
            '{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, '
            '"task": {"type": "chief", "index": 1}}',
            "TF_CONFIG.task.index",
            "out of range for job 'chief'",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}',
            "TF_CONFIG.task.index",
            "expected an integer",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}',
            "TF_CONFIG.task.index",
            "no ps tasks",
        ),
    ],
)
def test_parse_tf_config_errors(text: str, field: str, needle: str) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        parse_tf_config(text)
    message = _error(exc_info)
    assert message.startswith(field + ": ")
    assert needle in message


# --------------------------------------------------------------------------- resolve_cluster


@pytest.fixture
def cluster_file(tmp_path: Path) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text('[cluster]\nworker = ["file:1"]\n', encoding="utf-8")
    return str(path)


TF_CONFIG = json.dumps(
    {"cluster": {"worker": ["tf:1", "tf:2"]}, "task": {"type": "worker", "index": 1}}
)


def test_resolve_prefers_file(cluster_file: str) -> None:
    spec, task = resolve_cluster(
        cluster_file=cluster_file,
        worker_hosts="flag:1",
        environ={"TF_CONFIG": TF_CONFIG},
    )
    assert spec.worker == ("file:1",)
    assert task is None


def test_resolve_flags_before_tf_config() -> None:
    spec, task = resolve_cluster(
        ps_hosts="p:1", worker_hosts="flag:1", environ={"TF_CONFIG": TF_CONFIG}
    )
    assert spec == ClusterSpec(ps=("p:1",), worker=("flag:1",))
    assert task is None


def test_resolve_tf_config() -> None:
    spec, task = resolve_cluster(environ={"TF_CONFIG": TF_CONFIG})
    assert spec.worker == ("tf:1", "tf:2")
    assert task == TaskId(job="worker", index=1)
    spec, task = resolve_cluster(ps_hosts="", worker_hosts=" ", environ={"TF_CONFIG": TF_CONFIG})
    assert task == TaskId(job="worker", index=1)


def test_resolve_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", TF_CONFIG)
    assert resolve_cluster()[1] == TaskId(job="worker", index=1)
    monkeypatch.delenv("TF_CONFIG")
    assert "TF_CONFIG" not in os.environ
    with pytest.raises(ClusterSpecError):
        resolve_cluster()


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "}])
def test_resolve_nothing_given(environ: dict[str, str]) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        resolve_cluster(environ=environ)
    message = _error(exc_info)
    assert "--cluster FILE" in message
    assert "--ps-hosts/--worker-hosts" in message
    assert "TF_CONFIG" in message


def test_resolve_propagates_errors(tmp_path: Path) -> None:
    with pytest.raises(ClusterSpecError) as exc_info:
        resolve_cluster(cluster_file=str(tmp_path / "missing.json"), environ={})
    assert "missing.json" in _error(exc_info)
    with pytest.raises(ClusterSpecError) as exc_info:
        resolve_cluster(environ={"TF_CONFIG": "{"})
    assert _error(exc_info).startswith("TF_CONFIG: ")
