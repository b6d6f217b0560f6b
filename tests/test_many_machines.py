"""The "Many machines" guide's commands, run on emulated hosts (``distsgd-emulate hosts up``
/ ``distsgd-emulate hosts exec``): a parameter server and two workers started by hand, each in a
network namespace of its own, with a cluster file, a shared secret and mutual TLS between the
hosts."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import loadclock
import psutil
import pytest
from conftest import ROOT, distsgd_cmd, one_cert_for_all, wait_for

from distsgd_emulate.netns import check_capable

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hosts")]

ADDRESSES = ("198.18.0.1", "198.18.0.2", "198.18.0.3")


def _readme_lines() -> list[str]:
    """The block that rehearses "Many machines" on emulated hosts, command by command (in
    docs/guide/many-machines.md, once the README's)."""
    text = (ROOT / "docs" / "guide" / "many-machines.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "hosts up" in b)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _argv(line: str, tls: str, script: Path) -> list[str]:
    """One README command as an argv: ``$TLS`` and ``train.py`` made this test's, ``distsgd``
    this checkout's, and so ``distsgd-emulate`` (each command the README shows, run by its
    module)."""
    words = shlex.split(line.rstrip("&").replace("$TLS", tls).replace("train.py", str(script)))
    out: list[str] = []
    for word in words:
        if word == "distsgd-emulate":
            out += distsgd_cmd(word)
        else:
            out += distsgd_cmd() if word == "distsgd" else [word]
    return out


def _links_with(prefix: str) -> list[str]:
    done = loadclock.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return [line for line in done.stdout.splitlines() if prefix in line]


@pytest.fixture
def rooted() -> None:
    try:
        privilege = check_capable()
    except (ValueError, OSError) as e:
        pytest.skip(f"no network namespaces here: {e}")
    if str(privilege) != "root":
        pytest.skip("distsgd-emulate hosts up needs root (a link to this machine's namespace)")


def test_readme_many_machines_on_emulated_hosts(rooted: None, tmp_path: Path) -> None:
    lines = _readme_lines()
    up_line, secret_line, tls_line, *tasks = (line for line in lines if not line.startswith("#"))
    assert up_line.startswith("distsgd-emulate hosts up 3") and len(tasks) == 3, lines
    assert secret_line.startswith("export DISTSGD_SECRET_FILE")
    # the cluster file of the README's comment
    toml = "\n".join(line.lstrip("# ").strip() for line in lines if line.startswith("#"))
    (tmp_path / "cluster.toml").write_text(toml[toml.index("[cluster]") :] + "\n")
    assert all(a in (tmp_path / "cluster.toml").read_text() for a in ADDRESSES)
    pki = one_cert_for_all(tmp_path, ips=ADDRESSES)
    (tmp_path / "secret").write_text(os.urandom(16).hex())
    (tmp_path / "secret").chmod(0o600)
    tls = f"--tls-cert {pki['cert']} --tls-key {pki['key']} --tls-ca {pki['ca']}"
    assert tls_line == 'TLS="--tls-cert task.crt --tls-key task.key --tls-ca ca.crt"'
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DISTSGD_SECRET_FILE": "secret",
        "DISTSGD_RUNS": str(runs),
    }
    script = tmp_path / "train.py"  # the README's own training script
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    script.write_text(next(b for b in blocks if "distsgd.train(" in b))

    def start(line: str) -> psutil.Popen:
        return psutil.Popen(
            _argv(line, tls, script),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    started: list[psutil.Popen] = []
    try:
        up = start(up_line)
        started.append(up)
        state = tmp_path / "distsgd-hosts" / "hosts.json"
        assert wait_for(state.exists, 30), up.stdout.read() if up.poll() is not None else ""
        record = json.loads(state.read_text())
        assert [h["address"] for h in record["hosts"]] == list(ADDRESSES)
        assert oct(state.stat().st_mode & 0o777) == "0o600"
        server = start(tasks[0])
        started.append(server)
        workers = [start(line) for line in tasks[1:]]
        started += workers
        outs = []
        for worker in workers:
            out, _ = loadclock.communicate(worker, 120)
            assert worker.returncode == 0, out[-3000:]
            outs.append(out)
        assert float(outs[0].strip().splitlines()[-1]) > 0.9  # the chief's accuracy
        server.send_signal(signal.SIGTERM)
        out, _ = loadclock.communicate(server, 30)
        assert server.returncode == 0, out[-3000:]
        assert "mutual TLS" in out and "198.18.0.1:2222" in out, out[-3000:]
        up.send_signal(signal.SIGINT)
        out, _ = loadclock.communicate(up, 30)
        assert up.returncode == 0, out
        assert not state.exists() and not _links_with(record["prefix"])
        assert not any(psutil.pid_exists(h["keeper"]) for h in record["hosts"])
    finally:
        for proc in reversed(started):
            for p in [*proc.children(recursive=True), proc] if proc.is_running() else []:
                p.kill()
            proc.wait(timeout=10)
