"""``distsgd-emulate k8s`` ends with the project's one set of exit codes and errors
(``control.outcome``'s ``EXIT_*``, ``launcher.errors``' ``Interrupted`` and ``RunFailed``),
checked without starting a pod."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from distsgd.control.outcome import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from distsgd.launcher.errors import Interrupted, RunFailed
from distsgd.launcher.progress import Console
from distsgd_emulate import k8s_local


class _Cluster:
    """Stands in for LocalCluster: its run ends as the test says."""

    ending: BaseException | None = None

    def __init__(self, out_dir: Path, local_dir: Path, console: Console) -> None:
        self.name = "digits"
        self.jobs: list[object] = []
        self.supervisor = type("S", (), {"tasks": {}})()
        self.stop = None
        self.closed = False

    def run(self) -> int:
        if self.ending is not None:
            raise self.ending
        return EXIT_OK

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("ending", "code", "said"),
    [
        (None, EXIT_OK, ""),
        (Interrupted(), EXIT_INTERRUPTED, "distsgd: interrupted"),
        (RunFailed("pod digits-worker-0-1 failed (exit code 1)"), EXIT_FAILED, "pod digits"),
        (ValueError("pod x: k8s local cannot mount volume 'v'"), EXIT_FAILED, "cannot mount"),
    ],
)
def test_k8s_local_ends_with_the_projects_exit_codes(
    ending: BaseException | None,
    code: int,
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_Cluster, "ending", ending)
    monkeypatch.setattr(k8s_local, "LocalCluster", _Cluster)
    out = io.StringIO()
    assert (
        k8s_local.run_local(tmp_path, local_dir=tmp_path / "l", console=Console(stream=out)) == code
    )
    assert said in out.getvalue()
    if isinstance(ending, RunFailed | ValueError):
        assert f"distsgd: error: {ending}" in out.getvalue()
