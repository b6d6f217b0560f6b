"""The launcher's two calls to a parameter server: its Info (the version it has applied), and
telling it that workers have finished."""

from __future__ import annotations

from distsgd.transport.client import ShardClient
from distsgd.transport.errors import RemoteError
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.security import TlsConfig


def read_info(
    address: str,
    *,
    run_id: str,
    secret: str | None,
    tls: TlsConfig | None,
    worker: int = -1,
) -> pb.InfoResponse | None:
    """The server's Info, or None if it does not answer at once (2 s, no retry); asked for
    ``worker`` (its ``applied_sequence`` is that worker's), else for no worker."""
    try:
        with ShardClient(
            address,
            worker=worker,
            run_id=run_id,
            timeout=2.0,
            retry_seconds=0.0,
            secret=secret,
            tls=tls,
        ) as client:
            return client.info(retry=False)
    except RemoteError:
        return None


def tell_finished(
    address: str,
    workers: list[int],
    *,
    run_id: str,
    secret: str | None,
    tls: TlsConfig | None,
) -> list[tuple[int, RemoteError]]:
    """Tell the server at ``address`` that each of ``workers`` has left (on its behalf: its
    process is gone); (worker, error) for each the server could not be told of."""
    failed = []
    for worker in workers:
        try:
            with ShardClient(
                address,
                worker=worker,
                run_id=run_id,
                timeout=10.0,
                retry_seconds=10.0,
                secret=secret,
                tls=tls,
            ) as client:
                client.leave()
        except RemoteError as exc:
            failed.append((worker, exc))
    return failed
