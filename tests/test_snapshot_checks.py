"""A shard file (a write-ahead-log snapshot, a checkpoint's psN.npz) is checked before it is
served, as Register checks a model: a damaged one is named with its damage, and the server
falls back to the newest good state (an older snapshot, or the log)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distsgd.ps import wal
from distsgd.ps.rules import PushMeta
from distsgd.ps.service import ParameterService
from distsgd.ps.shard import Shard
from distsgd.ps.shard_file import CorruptCheckpoint
from distsgd.schemes import make_server_rule

OPTIONS = {"lr": 0.1, "momentum": 0.9}


def _shard(pushes: int = 2) -> Shard:
    shard = Shard(
        index=0,
        scheme="hogwild",
        options_json=json.dumps(OPTIONS),
        num_workers=2,
        values={"w": np.ones((4, 3), np.float32), "b": np.zeros(3)},
        rule=make_server_rule("hogwild", OPTIONS, 2),
    )
    for _ in range(pushes):
        grads = {k: np.full_like(v, 0.5) for k, v in shard.values.items()}
        shard.push(grads, PushMeta(worker=0, incarnation=1, base_version=shard.version))
    return shard


Damage = Callable[[dict[str, Any], dict[str, np.ndarray]], None]


def _nan(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    arrays["values/w"] = arrays["values/w"].copy()
    arrays["values/w"][1, 2] = np.nan


def _int_dtype(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    arrays["values/w"] = arrays["values/w"].astype(np.int32)


def _shape(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    arrays["values/w"] = arrays["values/w"].reshape(3, 4)


def _momentum_shape(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    (name,) = [k for k in arrays if k.startswith("rule/") and k.endswith("/w")]
    arrays[name] = np.zeros(7, np.float32)


def _version_text(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    header["version"] = "two"


def _finished_number(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    header["finished"] = 3


DAMAGES: dict[str, tuple[Damage, str]] = {
    "nan": (_nan, "piece 'w' holds NaN or Inf"),
    "dtype": (_int_dtype, "piece 'w' is int32, not float16, float32 or float64"),
    "shape": (_shape, r"piece 'w' is float32\[3, 4\], its header says float32\[4, 3\]"),
    "momentum": (_momentum_shape, r"rule state .*w' has shape \[7\], its piece \[4, 3\]"),
    "version": (_version_text, "header field 'version' is 'two', not a count"),
    "finished": (_finished_number, "header field 'finished' has type int, not list"),
}


def _damaged(data: bytes, damage: Damage) -> bytes:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    header = json.loads(arrays.pop("header").tobytes())
    damage(header, arrays)
    return Shard.pack(arrays, header)


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_damaged_shard_file_is_named_with_its_damage(tmp_path: Path, case: str) -> None:
    damage, why = DAMAGES[case]
    path = tmp_path / "ps0.npz"
    path.write_bytes(_damaged(_shard().to_bytes()[1], damage))
    with pytest.raises(CorruptCheckpoint) as refused:
        Shard.from_bytes(path.read_bytes(), make_server_rule, name=str(path))
    line = str(refused.value)
    assert line.startswith(f"{path}: a damaged shard file: ") and "\n" not in line
    assert refused.match(why)


def test_an_undamaged_file_and_one_written_before_specs_still_load() -> None:
    shard = _shard()
    again = Shard.from_bytes(shard.to_bytes()[1], make_server_rule)
    assert again.version == shard.version == 2
    np.testing.assert_array_equal(again.values["w"], shard.values["w"])

    def no_specs(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        del header["specs"]

    assert Shard.from_bytes(_damaged(shard.to_bytes()[1], no_specs), make_server_rule).version == 2


def test_recovery_skips_a_damaged_newest_snapshot_for_the_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN in the newest snapshot is not served (it would end as 'the run diverged'): the
    log goes back to the older snapshot and replays its records."""
    live = _shard(0)
    wal.WriteAheadLog.start(tmp_path, live)
    for _ in range(3):
        grads = {k: np.full_like(v, 0.5) for k, v in live.values.items()}
        live.push(grads, PushMeta(worker=0, incarnation=1, base_version=live.version))
    newer = tmp_path / "snapshot-00000001.npz"
    newer.write_bytes(_damaged(live.to_bytes()[1], _nan))
    with caplog.at_level(logging.WARNING):
        recovery = wal.recover(tmp_path, make_server_rule)
    assert recovery is not None and recovery.snapshot == 0 and recovery.shard.version == 3
    np.testing.assert_array_equal(recovery.shard.values["w"], live.values["w"])
    assert f"{newer}: a damaged shard file: piece 'w' holds NaN or Inf" in caplog.text


def test_a_damaged_restore_falls_back_to_the_log_or_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = _shard(0)
    folder = tmp_path / "wal"
    wal.WriteAheadLog.start(folder, live)
    live.push({"b": np.ones(3)}, PushMeta(worker=0, incarnation=1, base_version=0))
    bad = tmp_path / "ps0.npz"
    bad.write_bytes(_damaged(_shard(5).to_bytes()[1], _version_text))
    with caplog.at_level(logging.ERROR):
        service = ParameterService(
            shard_index=0, rule_factory=make_server_rule, restore=bad, wal_dir=folder
        )
    try:
        assert service.shard is not None and service.shard.version == 1  # the log's
    finally:
        service.close()
    assert f"{bad}: a damaged shard file: header field 'version'" in caplog.text
    with pytest.raises(CorruptCheckpoint, match=f"^{bad}: a damaged shard file: header field"):
        ParameterService(shard_index=0, rule_factory=make_server_rule, restore=bad)


def test_a_restarted_server_is_given_the_newest_good_checkpoint(tmp_path: Path) -> None:
    """The launcher (and --restore-latest) picks the newest shard file that passes the checks:
    a NaN in the newest one sends the server to the one before, not to serve NaN."""
    from distsgd.control.checkpoint.store import newest_shard_file

    good, bad = tmp_path / "ckpt-00000010" / "ps0.npz", tmp_path / "ckpt-00000020" / "ps0.npz"
    for path in (good, bad):
        path.parent.mkdir()
    good.write_bytes(_shard(2).to_bytes()[1])
    bad.write_bytes(_damaged(_shard(4).to_bytes()[1], _nan))
    assert newest_shard_file(tmp_path, 0) == good
