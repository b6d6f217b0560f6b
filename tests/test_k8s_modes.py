"""``distsgd k8s render``'s file modes: what holds no secret is readable by every user (an
image that runs as non-root reads its /app as copied), the run secret by its owner only."""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

import pytest

from distsgd.cli.main import main

pytest.importorskip("yaml")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("own_script", [True, False], ids=["script", "demo"])
def test_rendered_files_are_world_readable_but_the_secret(tmp_path: Path, own_script: bool) -> None:
    script = tmp_path / "train_me.py"
    script.write_text("#!/usr/bin/env python3\nimport distsgd\n")
    os.chmod(script, 0o700)
    out, said = tmp_path / "out", io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(io.StringIO()):
        assert main(["k8s", "render", str(out), *([str(script)] if own_script else [])]) == 0
    # the next steps it prints name commands that exist (the rehearsal is distsgd-emulate's)
    assert f"rehearse here: distsgd-emulate k8s {out}" in said.getvalue()
    secret = out / "secret.yaml"
    assert _mode(secret) == 0o600
    value = next(line for line in secret.read_text().splitlines() if "secret:" in line)
    value = value.split(":", 1)[1].strip()
    assert len(value) >= 32
    if own_script:
        assert _mode(out / "train" / script.name) == 0o755  # executable stays executable
    seen = 0
    for path in out.rglob("*"):
        if path == secret or path.name == script.name:
            continue
        seen += 1
        if path.is_dir():
            assert _mode(path) == 0o755, path
        else:
            assert _mode(path) == 0o644, path
            assert value.encode() not in path.read_bytes(), f"{path} holds the secret"
    assert seen >= 8
    assert _mode(out) == 0o755
