"""Small helpers shared by every layer: the bottom of the stack, importing no distsgd package."""

from distsgd.util.atomic import open_private, private_dir, write_atomic, write_bytes_atomic

__all__ = ["open_private", "private_dir", "write_atomic", "write_bytes_atomic"]
