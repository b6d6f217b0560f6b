"""`distsgd run` end to end with its security on: the 0600 secret never on a command line,
and a whole run over mutual TLS. Fault injection of delays and partitions."""

from __future__ import annotations

import datetime
import ipaddress
import json
import stat
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, metrics, run_distsgd, wait_for

pytestmark = pytest.mark.slow
BLOBS = str(SCRIPTS / "blobs.py")


def _one_cert_for_all(folder: Path) -> dict[str, Path]:
    """A CA and one certificate (SAN 127.0.0.1, server and client use) that every task shares."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("distsgd test CA"))
        .issuer_name(name("distsgd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("distsgd task"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {"ca": folder / "ca.crt", "cert": folder / "task.crt", "key": folder / "task.key"}
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    files["key"].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


def test_run_over_mutual_tls(tmp_path: Path) -> None:
    pki = _one_cert_for_all(tmp_path)
    run_dir = tmp_path / "run"
    args = ["run", "--scheme", "sync", "--quiet", "--run-dir", str(run_dir)]
    args += [
        "--tls-cert",
        str(pki["cert"]),
        "--tls-key",
        str(pki["key"]),
        "--tls-ca",
        str(pki["ca"]),
    ]
    done = run_distsgd([*args, BLOBS, "--steps", "20"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mutual TLS" in (run_dir / "logs" / "ps0.log").read_text()


def test_secret_is_0600_and_never_on_a_command_line(spawn, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = spawn(
        [
            "run",
            "--scheme",
            "hogwild",
            "--run-dir",
            str(run_dir),
            BLOBS,
            "--steps",
            "300",
            "--slow",
            "0.02",
        ]
    )
    assert wait_for(lambda: any("loss" in r for r in metrics(run_dir)), 90)
    secret_file = run_dir / "secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = secret_file.read_text().strip()
    tasks = psutil.Process(proc.pid).children(recursive=True)
    assert len(tasks) >= 3
    for task in tasks:
        assert not any(secret in arg for arg in task.cmdline())
        assert "DISTSGD_SECRET" not in task.environ()  # the file's path travels, not the secret
    assert secret not in (run_dir / "config.json").read_text()


def test_delay_and_partition_faults(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # downpour: local steps need no server, so pushes made while cut off are lost (a worker
    # whose next call is a pull just waits for the partition to heal).
    args = ["run", "--scheme", "downpour", "--window", "2", "--quiet", "--run-dir", str(run_dir)]
    args += ["--inject-fault", "delay:worker:1=30ms"]
    args += ["--inject-fault", "partition:worker:0@step=10+2s"]
    done = run_distsgd([*args, BLOBS, "--steps", "60"])
    assert done.returncode == 0, done.stdout[-3000:]
    records = metrics(run_dir)
    last = {r["task"]: r for r in records if "lost_pushes" in r}
    assert last["worker0"]["lost_pushes"] > 0 and last["worker1"]["lost_pushes"] == 0
    span = {
        w: max(r["time"] for r in records if r.get("task") == w and "loss" in r)
        - min(r["time"] for r in records if r.get("task") == w and "loss" in r)
        for w in ("worker0", "worker1")
    }
    assert span["worker1"] >= 60 * 0.03 * 0.9  # every step of worker 1 took 30 ms longer
    assert json.loads((run_dir / "result.json").read_text())["test_accuracy"] > 0.9
