"""The run secret and mutual TLS: strangers are refused before anything changes."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from distsgd.ps import start_server
from distsgd.ps.auth import UNAUTHENTICATED_MESSAGE
from distsgd.schemes import make_server_rule
from distsgd.transport import (
    METADATA_KEY,
    PROTOCOL_VERSION,
    SECRET_ENV,
    SECRET_FILE_ENV,
    RemoteError,
    ShardClient,
    TlsConfig,
    exposure_warning,
    is_loopback,
    load_secret,
    new_secret,
    write_secret_file,
)
from distsgd.transport.codec import iter_chunks, specs_of
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.transport.security import MIN_SECRET_CHARS, check_secret

SECRET = "s3cret-" + "ab" * 20
OTHER_SECRET = "wrong-" + "cd" * 20
"""A secret of valid length that is not the server's."""
ENV_SECRET = "e" * 40
HOGWILD = {"lr": 0.5, "momentum": 0.0}


def _arrays() -> dict[str, np.ndarray]:
    return {
        "w#0": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b#0": np.array([1.0, -2.0], dtype=np.float32),
    }


@pytest.fixture
def secured() -> Iterator[tuple[str, object]]:
    """One in-process server that requires SECRET; yields (address, service)."""
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, secret=SECRET
    )
    try:
        yield address, service
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def _client(address: str, **kw) -> ShardClient:  # type: ignore[no-untyped-def]
    kw.setdefault("timeout", 5.0)
    kw.setdefault("retry_seconds", 0.0)
    return ShardClient(address, **kw)


def _register(client: ShardClient) -> pb.RegisterResponse:
    return client.register(
        shard_index=0,
        scheme="hogwild",
        options_json=json.dumps(HOGWILD),
        num_workers=2,
        tensors=_arrays(),
    )


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ------------------------------------------------------------------------- raw calls, every RPC

HEADER = pb.RequestHeader(protocol_version=PROTOCOL_VERSION, worker=0)


def _raw_calls(stub: pb_grpc.ParameterServerStub) -> dict[str, Callable[..., object]]:
    """Each RPC with a well-formed request that the right secret would get through."""
    grad = np.ones(2, np.float32)
    push = [
        pb.PushRequest(
            header=pb.PushHeader(header=HEADER, base_version=0, tensors=specs_of({"b#0": grad}))
        ),
        *(pb.PushRequest(chunk=c) for c in iter_chunks([grad])),
    ]
    arrays = _arrays()
    register = [
        pb.RegisterRequest(
            header=pb.RegisterHeader(
                header=HEADER,
                scheme="hogwild",
                options_json=json.dumps(HOGWILD),
                num_workers=2,
                tensors=specs_of(arrays),
                shard_index=0,
            )
        ),
        *(pb.RegisterRequest(chunk=c) for c in iter_chunks(list(arrays.values()))),
    ]
    return {
        "Info": lambda **kw: stub.Info(pb.InfoRequest(header=HEADER), timeout=5, **kw),
        "Register": lambda **kw: stub.Register(iter(register), timeout=5, **kw),
        "Pull": lambda **kw: list(
            stub.Pull(pb.PullRequest(header=HEADER, wait_seconds=0.1), timeout=5, **kw)
        ),
        "Push": lambda **kw: stub.Push(iter(push), timeout=5, **kw),
        "Leave": lambda **kw: stub.Leave(pb.LeaveRequest(header=HEADER), timeout=5, **kw),
        "Checkpoint": lambda **kw: stub.Checkpoint(
            pb.CheckpointRequest(header=HEADER, name="c1"), timeout=5, **kw
        ),
    }


WRONG = {
    "missing": None,
    "wrong": ((METADATA_KEY, "not-" + SECRET),),
    "prefix": ((METADATA_KEY, SECRET[:-1]),),
    "empty": ((METADATA_KEY, ""),),
    "other-key": (("x-distsgd-other", SECRET),),
    "twice": ((METADATA_KEY, SECRET), (METADATA_KEY, "wrong")),
}


@pytest.mark.parametrize("how", list(WRONG))
def test_every_rpc_refuses_missing_or_wrong_secret_and_changes_nothing(secured, how) -> None:
    address, service = secured
    with _client(address, worker=0, secret=SECRET) as good:
        _register(good)
        version0, values0 = good.pull()
        info0 = good.info()
    with grpc.insecure_channel(address) as channel:
        calls = _raw_calls(pb_grpc.ParameterServerStub(channel))
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call(metadata=WRONG[how])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert err.value.details() == UNAUTHENTICATED_MESSAGE, name
    with _client(address, worker=1, secret=SECRET) as good:
        version, values = good.pull()
        info = good.info()
    assert version == version0 == 0
    _assert_same(values, values0)
    assert (info.finished_workers, info.pushes_accepted, info.pushes_rejected) == (
        info0.finished_workers,
        info0.pushes_accepted,
        info0.pushes_rejected,
    )
    assert service.shard is not None and 0 not in service.shard.finished  # Leave never ran


def test_unknown_method_is_refused_without_secret(secured) -> None:
    address, _ = secured
    with grpc.insecure_channel(address) as channel:
        probe = channel.unary_unary("/distsgd.v1.ParameterServer/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            probe(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            probe(b"", timeout=5, metadata=((METADATA_KEY, SECRET),))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_shard_client_with_wrong_secret_gets_unauthenticated(secured) -> None:
    address, service = secured
    with _client(address, worker=0, secret=OTHER_SECRET) as bad:
        with pytest.raises(RemoteError) as err:
            _register(bad)  # on an unregistered server
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert not err.value.retryable
        for call in (
            bad.info,
            bad.pull,
            bad.leave,
            lambda: bad.push(base_version=0, tensors={"b#0": np.ones(2, np.float32)}),
            lambda: bad.checkpoint("c1"),
        ):
            with pytest.raises(RemoteError) as err:
                call()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert service.shard is None
    with _client(address, secret=SECRET) as good:
        assert not good.info().registered


def test_right_secret_works_for_every_rpc(secured) -> None:
    address, _ = secured
    with _client(address, worker=0, secret=SECRET) as client:
        assert not client.info().registered
        assert _register(client).created
        result = client.push(base_version=0, tensors={"b#0": np.ones(2, np.float32)})
        assert result.accepted and result.version == 1
        version, values = client.pull(min_version=1)
        assert version == 1
        np.testing.assert_allclose(values["b#0"], _arrays()["b#0"] - 0.5)
        assert client.leave() == 1
        assert client.info().finished_workers == 1
        try:  # Checkpoint may be refused for other reasons (no checkpoint directory) but not 401
            client.checkpoint("c1")
        except RemoteError as exc:
            assert exc.code != grpc.StatusCode.UNAUTHENTICATED


def test_server_without_secret_ignores_client_secret() -> None:
    srv, address, service = start_server(
        address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule
    )
    try:
        with _client(address, secret=SECRET) as client:
            assert not client.info().registered
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def test_empty_server_secret_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="empty"):
        start_server(address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, secret="")


@pytest.mark.parametrize("short", ["x", "s3cret", "a" * (MIN_SECRET_CHARS - 1)])
def test_short_secret_is_refused_everywhere(short: str) -> None:
    """Fewer than 32 characters can be guessed: refused by the server, the client and
    load_secret, with a one-line message naming the fix."""
    for make in (
        lambda: start_server(
            address="127.0.0.1:0", shard_index=0, rule_factory=make_server_rule, secret=short
        ),
        lambda: ShardClient("127.0.0.1:1", secret=short),
        lambda: load_secret({SECRET_ENV: short}),
        lambda: check_secret(f"  {short}  "),
    ):
        with pytest.raises(ValueError, match="new_secret") as err:
            make()
        assert "\n" not in str(err.value) and str(MIN_SECRET_CHARS) in str(err.value)
    assert check_secret("a" * MIN_SECRET_CHARS) == "a" * MIN_SECRET_CHARS
    assert len(check_secret(new_secret())) == 64


# ------------------------------------------------------------------------- loading the secret


def test_new_secret_is_random_hex() -> None:
    a, b = new_secret(), new_secret()
    assert a != b and len(a) == 64 and int(a, 16) >= 0


def test_write_secret_file_is_0600_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    old = os.umask(0)  # even with a permissive umask
    try:
        secret = write_secret_file(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temporary left behind
    assert load_secret({SECRET_FILE_ENV: str(path)}) == secret
    again = write_secret_file(path)  # replaces the old one
    assert again != secret and load_secret({SECRET_FILE_ENV: str(path)}) == again


def test_load_secret_from_env_first(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    write_secret_file(path)
    assert load_secret({SECRET_ENV: f"  {ENV_SECRET} \n", SECRET_FILE_ENV: str(path)}) == ENV_SECRET
    assert load_secret({}) is None
    with pytest.raises(ValueError, match=SECRET_ENV):
        load_secret({SECRET_ENV: "   "})
    with pytest.raises(ValueError, match="ASCII"):
        load_secret({SECRET_ENV: "caf\u00e9"})


def test_load_secret_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, ENV_SECRET)
    assert load_secret() == ENV_SECRET


def test_load_secret_refuses_a_file_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(ENV_SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError) as err:
        load_secret({SECRET_FILE_ENV: str(path)})
    message = str(err.value)
    assert "\n" not in message and str(path) in message and f"chmod 600 {path}" in message
    path.chmod(0o600)
    assert load_secret({SECRET_FILE_ENV: str(path)}) == ENV_SECRET


def test_load_secret_file_errors_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope") as err:
        load_secret({SECRET_FILE_ENV: str(missing)})
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty"
    fd = os.open(empty, os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    with pytest.raises(ValueError, match="empty"):
        load_secret({SECRET_FILE_ENV: str(empty)})


def test_exposure_warning() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")
    assert is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("[::]") and not is_loopback("10.0.0.1")
    assert exposure_warning("127.0.0.1:5000", secret=SECRET, tls=None) is None
    assert exposure_warning("[::1]:5000", secret=SECRET, tls=None) is None
    # No secret warns on every address, loopback included: every local user can connect.
    for loopback in ("127.0.0.1:5000", "localhost:5000", "[::1]:5000"):
        assert "without a run secret" in str(exposure_warning(loopback, secret=None, tls=None))
    assert "without authentication or TLS" in str(
        exposure_warning("0.0.0.0:5000", secret=None, tls=None)
    )
    assert "plaintext" in str(exposure_warning("[::]:5000", secret=SECRET, tls=None))


def test_serve_warns_on_non_loopback_without_tls(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from distsgd.ps import serve
    from distsgd.transport import security

    # Pretend 127.0.0.1 is a public address rather than opening a port to the network.
    monkeypatch.setattr(security, "is_loopback", lambda host: False)
    stop = threading.Event()
    stop.set()  # bind, log, stop at once
    kw = {"address": "127.0.0.1:0", "shard_index": 0, "rule_factory": make_server_rule}
    with caplog.at_level(logging.WARNING, logger="distsgd"):
        # In a thread: on the main thread serve would take over SIGINT for the whole session.
        thread = threading.Thread(target=serve, kwargs={**kw, "stop": stop, "secret": SECRET})
        thread.start()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert any("without TLS" in r.getMessage() for r in caplog.records)


def test_serve_without_secret_warns_on_loopback(caplog: pytest.LogCaptureFixture) -> None:
    """Every local user can reach a loopback port: no secret warns there too."""
    import threading

    from distsgd.ps import serve

    stop = threading.Event()
    stop.set()  # bind, log, stop at once
    kw = {"address": "127.0.0.1:0", "shard_index": 0, "rule_factory": make_server_rule}
    for secret, warns in ((None, True), (SECRET, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distsgd"):
            thread = threading.Thread(target=serve, kwargs={**kw, "stop": stop, "secret": secret})
            thread.start()
            thread.join(timeout=10)
        assert not thread.is_alive()
        warned = [r for r in caplog.records if "without a run secret" in r.getMessage()]
        assert bool(warned) == warns, [r.getMessage() for r in caplog.records]
        if warns:
            assert warned[0].levelno == logging.WARNING and "127.0.0.1:" in warned[0].getMessage()


# ------------------------------------------------------------------------- mutual TLS


def _make_pki(folder: Path, server_names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict:
    """A throwaway CA, a server certificate (SAN 127.0.0.1, localhost) and a client one."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, Path] = {}

    def save(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        files[f"{name}.key"] = folder / f"{name}.key"
        files[f"{name}.crt"] = folder / f"{name}.crt"
        files[f"{name}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        files[f"{name}.key"].chmod(0o600)
        files[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(subject: str, issuer: str, public_key: object) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        builder("distsgd test CA", "distsgd test CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    save("ca", ca_key, ca_cert)
    for name, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        b = builder(f"distsgd test {name}", "distsgd test CA", key.public_key())
        b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if name == "server":
            names: list[x509.GeneralName] = []
            for n in server_names:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(n)))
                except ValueError:
                    names.append(x509.DNSName(n))
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        save(name, key, b.sign(ca_key, hashes.SHA256()))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki: dict[str, Path]) -> Iterator[str]:
    tls = TlsConfig(cert=pki["server.crt"], key=pki["server.key"], ca=pki["ca.crt"])
    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        secret=SECRET,
        tls=tls,
    )
    try:
        yield address
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def test_tls_client_with_certificate_works(pki, tls_server) -> None:
    tls = TlsConfig(cert=pki["client.crt"], key=pki["client.key"], ca=pki["ca.crt"])
    with _client(tls_server, worker=0, secret=SECRET, tls=tls) as client:
        assert _register(client).created
        _, values = client.pull()
        _assert_same(values, _arrays())
    port = tls_server.rpartition(":")[2]
    with _client(f"localhost:{port}", secret=SECRET, tls=tls) as client:  # the DNS name too
        assert client.info().registered


def test_tls_still_needs_the_secret(pki, tls_server) -> None:
    tls = TlsConfig(cert=pki["client.crt"], key=pki["client.key"], ca=pki["ca.crt"])
    with _client(tls_server, tls=tls) as client, pytest.raises(RemoteError) as err:
        client.info()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_fails_on_tls_server(tls_server) -> None:
    with (
        _client(tls_server, secret=SECRET, timeout=2.0) as client,
        pytest.raises(RemoteError) as err,
    ):
        client.info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_client_without_certificate_fails(pki, tls_server) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca.crt"].read_bytes())
    with grpc.secure_channel(tls_server, creds) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Info(pb.InfoRequest(header=HEADER), timeout=2, metadata=((METADATA_KEY, SECRET),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_with_a_foreign_ca_fails(pki, tls_server, tmp_path: Path) -> None:
    """A client certificate from another CA is refused; so is a server the client's CA
    did not sign."""
    other = _make_pki(tmp_path)
    foreign = TlsConfig(cert=other["client.crt"], key=other["client.key"], ca=pki["ca.crt"])
    with (
        _client(tls_server, secret=SECRET, tls=foreign, timeout=2.0) as client,
        pytest.raises(RemoteError) as err,
    ):
        client.info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    distrusting = TlsConfig(cert=pki["client.crt"], key=pki["client.key"], ca=other["ca.crt"])
    with (
        _client(tls_server, secret=SECRET, tls=distrusting, timeout=2.0) as client,
        pytest.raises(RemoteError) as err,
    ):
        client.info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_server_certificate_must_name_the_dialled_host(tmp_path: Path) -> None:
    pki = _make_pki(tmp_path, server_names=("elsewhere.invalid",))
    srv, address, service = start_server(
        address="127.0.0.1:0",
        shard_index=0,
        rule_factory=make_server_rule,
        tls=TlsConfig(cert=pki["server.crt"], key=pki["server.key"], ca=pki["ca.crt"]),
    )
    try:
        tls = TlsConfig(cert=pki["client.crt"], key=pki["client.key"], ca=pki["ca.crt"])
        with _client(address, tls=tls, timeout=2.0) as client, pytest.raises(RemoteError) as err:
            client.info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace=None).wait(timeout=5)
        service.close()


def test_tls_config_checks_files(pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    for flag, kw in (
        ("--tls-cert", {"cert": missing, "key": pki["client.key"], "ca": pki["ca.crt"]}),
        ("--tls-key", {"cert": pki["client.crt"], "key": missing, "ca": pki["ca.crt"]}),
        ("--tls-ca", {"cert": pki["client.crt"], "key": pki["client.key"], "ca": missing}),
    ):
        with pytest.raises(ValueError, match=flag) as err:
            TlsConfig(**kw)
        assert "\n" not in str(err.value)
    assert TlsConfig.from_flags() is None
    with pytest.raises(ValueError, match="--tls-key"):
        TlsConfig.from_flags(cert=pki["client.crt"], ca=pki["ca.crt"])
    tls = TlsConfig.from_flags(str(pki["client.crt"]), str(pki["client.key"]), str(pki["ca.crt"]))
    assert tls is not None and tls.cert == pki["client.crt"]
