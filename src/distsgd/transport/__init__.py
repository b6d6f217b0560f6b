"""Transport layer: the wire protocol (``proto/distsgd.proto``), tensors as raw bytes in chunks,
and a gRPC client for one parameter-server shard with deadlines and retries.

Framework-agnostic: tensors are numpy arrays here.
"""

from distsgd.transport.client import ShardClient
from distsgd.transport.codec import (
    CHUNK_BYTES,
    ChunkAssembler,
    WireError,
    iter_chunks,
    spec_of,
    specs_of,
)
from distsgd.transport.errors import PROTOCOL_VERSION, RemoteError

__all__ = [
    "CHUNK_BYTES",
    "PROTOCOL_VERSION",
    "ChunkAssembler",
    "RemoteError",
    "ShardClient",
    "WireError",
    "iter_chunks",
    "spec_of",
    "specs_of",
]
