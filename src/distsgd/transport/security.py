"""Who may talk to a parameter server: a per-run shared secret, and optional mutual TLS.

The secret. Every task of one run shares one random secret (:func:`new_secret`). Clients send it
as call metadata (:data:`METADATA_KEY`) on every RPC; a server started with a secret refuses any
call without it with ``UNAUTHENTICATED`` before its handler runs (``distsgd.ps.auth``). Tasks
get it from the environment (:data:`SECRET_ENV`) or, better, from a file only its owner can
read (:data:`SECRET_FILE_ENV`, written by :func:`write_secret_file`), never from the command
line, where ``ps`` shows it to every user of the machine. :func:`load_secret` reads either.

TLS. Without TLS the secret and the parameters cross the network in plaintext. With a
:class:`TlsConfig` (the flags ``--tls-cert``, ``--tls-key`` and ``--tls-ca``) the server listens
on a TLS port and demands a client certificate signed by the CA (mutual TLS), and the client
checks the server's certificate against the same CA. See ``docs/security.md``.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import ssl
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from distsgd.util.atomic import write_bytes_atomic

SECRET_ENV = "DISTSGD_SECRET"
"""Environment variable holding the run secret itself."""

SECRET_FILE_ENV = "DISTSGD_SECRET_FILE"
"""Environment variable naming a file (mode 0600) that holds the run secret."""

METADATA_KEY = "x-distsgd-auth"
"""gRPC call-metadata key under which clients send the run secret."""

TRUSTED_NETWORK_ENV = "DISTSGD_TRUSTED_NETWORK"
"""Set to 1 to say the network between the tasks is trusted (a pod network, a VPN): no warning
about plaintext beyond loopback, from the collective's data plane or from a parameter server
that has a run secret (a server without one still warns)."""

MIN_SECRET_CHARS = 32
"""The shortest run secret accepted (:func:`new_secret` makes 64 hex characters)."""


def new_secret() -> str:
    """A fresh random run secret: 64 hex characters (256 bits)."""
    return secrets.token_hex(32)


def check_secret(secret: str, source: str = "the run secret") -> str:
    """``secret`` without surrounding whitespace, or ValueError if it cannot be used.

    It must be printable ASCII (gRPC metadata values are) and at least
    :data:`MIN_SECRET_CHARS` long, so that it cannot be guessed.
    """
    value = secret.strip()
    fix = (
        "make one with distsgd.transport.new_secret() (64 hex characters) or "
        "write_secret_file(PATH)"
    )
    if not value:
        raise ValueError(f"{source} is empty; {fix}")
    if not (value.isascii() and value.isprintable()):
        raise ValueError(f"{source} must be printable ASCII; {fix}")
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{source} has {len(value)} characters, fewer than {MIN_SECRET_CHARS}; {fix}"
        )
    return value


def write_secret_file(path: Path | str) -> str:
    """Create ``path`` holding a new secret, readable by its owner only (0600); returns it.

    The file is created under a temporary name beside ``path`` with ``O_EXCL`` and mode 0600
    from the start (never briefly readable by others), then renamed over ``path``.
    """
    secret = new_secret()
    write_bytes_atomic(Path(path), (secret + "\n").encode())  # mkstemp: O_EXCL, 0600
    return secret


def load_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """The run secret from ``DISTSGD_SECRET``, else from the file ``DISTSGD_SECRET_FILE`` names.

    None when neither is set. ValueError (one line) for an empty secret, a missing file, or a
    file that group or others may access (it must be mode 0600 or stricter).
    """
    env = os.environ if environ is None else environ
    if SECRET_ENV in env:
        return check_secret(env[SECRET_ENV], SECRET_ENV)
    name = env.get(SECRET_FILE_ENV)
    if name is None:
        return None
    if not name.strip():
        raise ValueError(f"{SECRET_FILE_ENV} is set but empty; name the run's secret file")
    path = Path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ValueError(
            f"cannot read secret file {path} ({SECRET_FILE_ENV}): {exc.strerror}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"secret file {path} ({SECRET_FILE_ENV}) is not a regular file")
        if mode & 0o077:
            raise ValueError(
                f"secret file {path} is open to group or others (mode {stat.S_IMODE(mode):04o}); "
                f"run: chmod 600 {path}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"secret file {path} must hold printable ASCII") from None
    return check_secret(text, f"secret file {path}")


# ------------------------------------------------------------------------------------------ TLS


def _tls_path(value: Path | str, flag: str) -> Path:
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    return path


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """Mutual TLS between workers and parameter servers: PEM files, the same CA on every task.

    Every task has its own certificate and key, signed by the run's CA. A server accepts only
    clients with a certificate the CA signed; a client accepts only a server whose certificate
    the CA signed and whose name (subject alternative name) matches the host it dialled.
    """

    cert: Path
    """This task's certificate (chain), PEM. On a server it must name the host clients dial
    (a DNS or IP subject alternative name); on a client it is the client certificate."""
    key: Path
    """The private key of ``cert``, PEM; keep it mode 0600."""
    ca: Path
    """The CA certificate, PEM, that signed every task's certificate; peers are checked
    against it in both directions."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cert", _tls_path(self.cert, "--tls-cert"))
        object.__setattr__(self, "key", _tls_path(self.key, "--tls-key"))
        object.__setattr__(self, "ca", _tls_path(self.ca, "--tls-ca"))

    @classmethod
    def from_flags(
        cls,
        cert: Path | str | None = None,
        key: Path | str | None = None,
        ca: Path | str | None = None,
    ) -> TlsConfig | None:
        """None when no flag is given; all three together; ValueError naming a missing one."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if all(v is None for v in given.values()):
            return None
        missing = [flag for flag, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"--tls-cert, --tls-key and --tls-ca go together; missing {', '.join(missing)}"
            )
        assert cert is not None and key is not None and ca is not None
        return cls(cert=Path(cert), key=Path(key), ca=Path(ca))


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Server side of mutual TLS: present ``cert``, demand a client certificate signed by ``ca``."""
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.ca.read_bytes(),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Client side of mutual TLS: trust servers signed by ``ca``, present ``cert``."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes(),
        certificate_chain=tls.cert.read_bytes(),
    )


def certificate_names(cert: Path) -> tuple[str, ...] | None:
    """The names ``cert`` (PEM; the first of a chain) answers to, as a TLS client checks them:
    its DNS and IP subject alternative names, else its common name; None where this Python
    cannot decode a certificate (then nothing is checked). ValueError, in one line, where the
    file is no PEM certificate."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:  # CPython's own decoder (what its ssl tests use); absent elsewhere
        return None
    try:
        info = decode(str(cert))
    except (ssl.SSLError, OSError) as e:
        raise ValueError(
            f"--tls-cert {cert}: not a PEM certificate ({e}); give the task's certificate"
        ) from None
    alt = tuple(value for kind, value in info.get("subjectAltName", ()) if kind in _SAN_KINDS)
    if alt:
        return alt
    subject = info.get("subject", ())
    return tuple(value for rdn in subject for key, value in rdn if key == "commonName")


_SAN_KINDS = ("DNS", "IP Address")


def _names(names: tuple[str, ...], host: str) -> bool:
    """Whether a certificate with ``names`` is valid for a client that dials ``host``."""
    wanted = _canonical(host)
    return any(_canonical(name) == wanted for name in names)


def check_certificate_names(tls: TlsConfig, hosts: Sequence[str], *, where: str) -> None:
    """ValueError, in one line, naming each of ``hosts`` (addresses or names that clients dial)
    that ``tls.cert`` does not name and the fix: a client would refuse the server's certificate,
    which gRPC reports only as a server that never comes up."""
    names = certificate_names(tls.cert)
    if names is None:
        return
    missing = [host for host in dict.fromkeys(hosts) if not _names(names, host)]
    if not missing:
        return
    alt = ",".join(f"IP:{h}" if _ip(h) is not None else f"DNS:{h}" for h in dict.fromkeys(hosts))
    raise ValueError(
        f"--tls-cert {tls.cert} does not name {', '.join(missing)}, where clients dial {where} "
        f"(it names {', '.join(names) or 'nothing'}): clients would refuse it; make a "
        f"certificate with subjectAltName={alt} (docs/guide/many-machines.md; docs/security.md, 3)"
    )


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` (brackets allowed) as an IP address; None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _canonical(host: str) -> str:
    """An address in one spelling (``::1`` for ``0:0:0:0:0:0:0:1``), a name in lower case."""
    ip = _ip(host)
    return host.lower() if ip is None else str(ip)


# ----------------------------------------------------------------------------------- exposure


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP, brackets allowed) is this machine's loopback only."""
    host = host.strip().strip("[]")
    ip = _ip(host)
    return host.lower() == "localhost" or (ip is not None and ip.is_loopback)


def trusted_network(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`TRUSTED_NETWORK_ENV` is 1 (the user says the network is trusted)."""
    env = os.environ if environ is None else environ
    return env.get(TRUSTED_NETWORK_ENV, "") == "1"


def exposure_warning(address: str, *, secret: str | None, tls: TlsConfig | None) -> str | None:
    """A one-line warning for a server on ``address`` ("host:port") that others can use: any
    address without a run secret (on loopback every local user and process can connect), or
    a non-loopback one without TLS. None with a secret on loopback, or with a secret and TLS."""
    host = address.rpartition(":")[0]
    if is_loopback(host):
        if secret:
            return None
        return (
            f"listening on {address} without a run secret: every user and process on this "
            f"machine can read and change the parameters; set {SECRET_FILE_ENV} "
            "(distsgd run does)"
        )
    if tls is not None:
        if secret:
            return None
        return (
            f"listening on {address} with TLS but without a run secret: any holder of a "
            f"certificate the CA signed can change the parameters; set {SECRET_FILE_ENV}"
        )
    if secret:
        return (
            f"listening on non-loopback {address} without TLS: the run secret and the "
            "parameters cross the network in plaintext; pass --tls-cert, --tls-key and --tls-ca"
        )
    return (
        f"listening on non-loopback {address} without authentication or TLS: anyone who can "
        f"reach it can read and change the parameters; set {SECRET_FILE_ENV} and pass "
        "--tls-cert, --tls-key and --tls-ca"
    )
