"""A certificate under ``--hosts`` that does not name the servers' hosts is refused before
anything starts, in one line naming the missing address and the fix (it used to show only as
servers that never came up, at the start-up deadline)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from conftest import one_cert_for_all

from distsgd.cli.main import main
from distsgd.launcher.config import ClusterSize, Hosting, LaunchConfig
from distsgd.launcher.emulated import host_plan
from distsgd.transport.security import TlsConfig, certificate_names, check_certificate_names

pytest.importorskip("cryptography")

SCRIPT = str(Path(__file__).resolve().parents[1] / "src" / "distsgd" / "demo" / "digits.py")


def _tls(folder: Path, ips: tuple[str, ...]) -> TlsConfig:
    files = one_cert_for_all(folder, ips=ips)
    return TlsConfig(cert=files["cert"], key=files["key"], ca=files["ca"])


def test_the_names_of_a_certificate(tmp_path: Path) -> None:
    tls = _tls(tmp_path, ("198.18.0.1", "::1"))
    assert certificate_names(tls.cert) == ("198.18.0.1", "0:0:0:0:0:0:0:1", "localhost")
    check_certificate_names(tls, ["198.18.0.1", "[::1]", "LOCALHOST"], where="x")
    with pytest.raises(ValueError, match=r"198\.18\.0\.2"):
        check_certificate_names(tls, ["198.18.0.1", "198.18.0.2"], where="x")


def test_not_a_certificate_is_one_line(tmp_path: Path) -> None:
    tls = _tls(tmp_path, ("198.18.0.1",))
    with pytest.raises(ValueError, match="not a PEM certificate") as refused:
        check_certificate_names(TlsConfig(cert=tls.key, key=tls.key, ca=tls.ca), ["a"], where="x")
    assert "\n" not in str(refused.value)


def test_a_certificate_missing_a_servers_host_is_refused_naming_it(tmp_path: Path) -> None:
    tls = _tls(tmp_path, ("198.18.0.1",))
    plan = host_plan(
        LaunchConfig(script=SCRIPT, size=ClusterSize(workers=2, ps=2), hosting=Hosting(hosts=3))
    )
    assert plan.server_addresses() == ("198.18.0.1", "198.18.0.2")  # spread: servers first
    with pytest.raises(ValueError) as refused:
        LaunchConfig(
            script=SCRIPT, size=ClusterSize(workers=2, ps=2), hosting=Hosting(hosts=3, tls=tls)
        )
    message = str(refused.value)
    assert "does not name 198.18.0.2," in message and "198.18.0.1," not in message.split("(")[0]
    assert "subjectAltName=IP:198.18.0.1,IP:198.18.0.2" in message and "\n" not in message
    LaunchConfig(
        script=SCRIPT,
        size=ClusterSize(workers=2, ps=2),
        hosting=Hosting(hosts=3, tls=_tls(tmp_path, ("198.18.0.1", "198.18.0.2"))),
    )


def test_the_launcher_refuses_it_in_one_line(tmp_path: Path) -> None:
    files = one_cert_for_all(tmp_path, ips=("127.0.0.1",))
    tls = [arg for flag in ("cert", "key", "ca") for arg in (f"--tls-{flag}", str(files[flag]))]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(
            [
                "run",
                "--hosts",
                "2",
                "--workers",
                "1",
                *tls,
                "--run-dir",
                str(tmp_path / "run"),
                SCRIPT,
            ]
        )
    lines = err.getvalue().strip().splitlines()
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and "does not name 198.18.0.1" in lines[0], lines
    assert not (tmp_path / "run").exists()
