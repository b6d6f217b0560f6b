"""Transport layer: the wire protocol (``proto/distsgd.proto``), tensors as raw bytes in chunks,
a gRPC client for one parameter-server shard with deadlines and retries, the carriers its
tensors travel by (``carriers/``: the gRPC streams, a shared-memory segment, a tensor socket),
and the run secret and mutual TLS that guard it (``security.py``).

Framework-agnostic: tensors are numpy arrays here.
"""

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
