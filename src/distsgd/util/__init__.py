"""Small helpers shared by every layer: the bottom of the stack, importing no distsgd package."""

from distsgd.util.atomic import (
    file_digest,
    open_private,
    private_dir,
    write_atomic,
    write_bytes_atomic,
    write_stream_atomic,
)

__all__ = [
    "file_digest",
    "open_private",
    "private_dir",
    "write_atomic",
    "write_bytes_atomic",
    "write_stream_atomic",
]
