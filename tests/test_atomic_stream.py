"""util.write_stream_atomic and util.file_digest, which a server's snapshots and checkpoints
are written with (a shard is never whole in memory a second time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def test_a_streamed_atomic_write_leaves_the_old_file_on_failure(tmp_path: Path) -> None:
    """What a server's snapshots and checkpoints are written with: the data goes into the file
    as it is made, and a failure halfway leaves the previous file and no temporary one."""
    import hashlib

    from distsgd.util import file_digest, write_stream_atomic

    path = tmp_path / "shard.npz"
    write_stream_atomic(path, lambda f: f.write(b"old"))
    data = bytes(range(256)) * 10_000

    def fails(f: Any) -> None:
        f.write(data[:1000])
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_stream_atomic(path, fails)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == [path.name]
    write_stream_atomic(path, lambda f: f.write(data))
    assert file_digest(path) == (hashlib.sha256(data).hexdigest(), len(data))
