"""Transport layer: the wire protocol (``proto/distsgd.proto``), tensors as raw bytes in chunks,
a gRPC client for one parameter-server shard with deadlines and retries, the carriers its
tensors travel by (``carriers/``: the gRPC streams, a shared-memory segment, a tensor socket),
and the run secret and mutual TLS that guard it (``security.py``).

Framework-agnostic: tensors are numpy arrays here. Names are imported on first use, so that a
module that needs the codec alone (``transport.codec``: what the flags' checks read) imports
without gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.util.lazy import lazy_exports

__all__ = [
    "CHUNK_BYTES",
    "METADATA_KEY",
    "PROTOCOL_VERSION",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "ChunkAssembler",
    "PushReject",
    "Refusal",
    "RemoteError",
    "ShardClient",
    "TlsConfig",
    "TooLarge",
    "WireError",
    "channel_credentials",
    "exposure_warning",
    "is_loopback",
    "iter_chunks",
    "load_secret",
    "new_secret",
    "server_credentials",
    "spec_of",
    "specs_of",
    "write_secret_file",
]

_CODEC = ("CHUNK_BYTES", "ChunkAssembler", "TooLarge", "WireError", "iter_chunks", "spec_of")
_SECURITY = (
    *("METADATA_KEY", "SECRET_ENV", "SECRET_FILE_ENV", "TlsConfig", "channel_credentials"),
    *("exposure_warning", "is_loopback", "load_secret", "new_secret", "server_credentials"),
    "write_secret_file",
)
_EXPORTS = {
    **{name: "distsgd.transport.codec" for name in (*_CODEC, "specs_of")},
    **{name: "distsgd.transport.errors" for name in ("PROTOCOL_VERSION", "PushReject")},
    **{name: "distsgd.transport.errors" for name in ("Refusal", "RemoteError")},
    **{name: "distsgd.transport.security" for name in _SECURITY},
    "ShardClient": "distsgd.transport.client",
}

if TYPE_CHECKING:
    from distsgd.transport.client import ShardClient
    from distsgd.transport.codec import (
        CHUNK_BYTES,
        ChunkAssembler,
        TooLarge,
        WireError,
        iter_chunks,
        spec_of,
        specs_of,
    )
    from distsgd.transport.errors import PROTOCOL_VERSION, PushReject, Refusal, RemoteError
    from distsgd.transport.security import (
        METADATA_KEY,
        SECRET_ENV,
        SECRET_FILE_ENV,
        TlsConfig,
        channel_credentials,
        exposure_warning,
        is_loopback,
        load_secret,
        new_secret,
        server_credentials,
        write_secret_file,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
