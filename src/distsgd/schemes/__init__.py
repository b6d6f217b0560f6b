"""The training schemes. Each is one module: its math in the docstring, a worker half, and
(for parameter-server schemes) a server half. ``registry`` maps names to them."""

from distsgd.schemes import (
    agn,
    allreduce,
    asyncdiloco,
    diloco,
    downpour,
    dynsgd,
    eamsgd,
    easgd,
    hogwild,
    localsgd,
    sagn,
    sync,
)
from distsgd.schemes.registry import SchemeSpec, get, make_server_rule, names, register

for _module in (
    sync,
    hogwild,
    downpour,
    agn,
    sagn,
    easgd,
    eamsgd,
    allreduce,
    dynsgd,
    localsgd,
    diloco,
    asyncdiloco,
):
    register(_module.SPEC)

__all__ = ["SchemeSpec", "get", "make_server_rule", "names", "register"]
