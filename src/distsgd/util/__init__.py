"""Small helpers shared by every layer: the bottom of the stack, importing no distsgd package."""

from distsgd.util.atomic import write_atomic, write_bytes_atomic

__all__ = ["write_atomic", "write_bytes_atomic"]
