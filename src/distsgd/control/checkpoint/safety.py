"""Whether a worker state file (a ``torch.save`` zip) names Python objects beyond tensors and
plain containers, found by reading its pickle's opcodes; nothing is unpickled and no torch is
imported.

This is the launcher's cheap check; a worker loads a state with ``torch.load(weights_only=True)``
(the runtime's ``checkpoint`` module), which refuses the same files.
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from pathlib import Path

from distsgd.control.checkpoint.errors import CheckpointError, first_line

_PLAIN_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "torch.Size",
        "torch.device",
        "torch._tensor._rebuild_from_type_v2",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
    }
)
_STORAGE = re.compile(r"torch\.(cuda\.)?[A-Z][A-Za-z0-9]*Storage")
_DTYPE = re.compile(
    r"torch\.(bool|bfloat16|u?int\d+|float\d+(_[a-z0-9]+)*|complex\d+|q?u?int\d+(x\d+)?)"
)
_REBUILD = re.compile(r"torch\._utils\._rebuild_[a-z0-9_]+")


def plain_global(name: str) -> bool:
    """Whether ``module.name`` is one a tensor-and-containers state file may name."""
    return name in _PLAIN_GLOBALS or any(
        pattern.fullmatch(name) for pattern in (_STORAGE, _DTYPE, _REBUILD)
    )


def pickle_globals(data: bytes) -> list[str]:
    """The ``module.name`` of every global a pickle refers to, read from its opcodes; ``?`` for
    one named from the stack (``STACK_GLOBAL``, protocol 4 and later) or an extension code,
    which ``torch.save`` (protocol 2) never writes and this reader does not follow."""
    found: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            found.append(str(arg).replace(" ", ".", 1))
        elif op.name == "STACK_GLOBAL" or op.name.startswith("EXT"):
            found.append("?")
    return found


def unsafe_globals(path: Path) -> list[str]:
    """The Python objects (``module.name``) in the worker state file ``path`` that a safe load
    refuses; :class:`CheckpointError` for a file that is no readable ``torch.save`` zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pickles) != 1:
                raise CheckpointError(f"{path}: not a readable worker state (no data.pkl)")
            data = archive.read(pickles[0])
        names = pickle_globals(data)
    except CheckpointError:
        raise
    except Exception as exc:  # not a zip, a damaged member, a pickle that ends early
        raise CheckpointError(f"{path}: not a readable worker state ({first_line(exc)})") from None
    return sorted({n for n in names if not plain_global(n)})
