"""The README's recipe for the emulated hosts' TLS files ("Many machines"), run as it is: it
makes a CA and one certificate, signed by it, for servers and clients, that names every host's
address (what ``distsgd run --hosts`` checks before it starts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

from distsgd.transport.security import TlsConfig, certificate_names, check_certificate_names

ADDRESSES = ("198.18.0.1", "198.18.0.2", "198.18.0.3")


def _recipe() -> str:
    text = (ROOT / "docs" / "guide" / "many-machines.md").read_text()  # once the README's
    return next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "openssl req" in b)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_the_readme_makes_certificates_that_name_every_host(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-eu", "-c", _recipe()], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    tls = TlsConfig(cert=tmp_path / "task.crt", key=tmp_path / "task.key", ca=tmp_path / "ca.crt")
    assert certificate_names(tls.cert) == ADDRESSES
    check_certificate_names(tls, ADDRESSES, where="the README's hosts")
    for purpose in ("sslserver", "sslclient"):  # signed by the CA, for both uses
        verify = ["openssl", "verify", "-purpose", purpose, "-CAfile", "ca.crt", "task.crt"]
        checked = subprocess.run(verify, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0 and "task.crt: OK" in checked.stdout, checked.stderr
    for key in ("ca.key", "task.key"):
        assert (tmp_path / key).stat().st_mode & 0o077 == 0
