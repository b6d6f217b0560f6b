"""The ``distsgd`` program's entry point (console script and ``python -m distsgd``).

Only workers run PyTorch code. The launcher (``run``, ``demo``, ``compare``), a parameter server
(``server``) and the tools import modules that name torch but never use it, or only late
(``inspect``); importing it costs over a second of CPU at every start, and a restarted server
would spend it before it serves again. So every command but ``worker`` (which runs the user's
script in this process) defers it: ``import torch`` binds a stand-in that imports the real
module when first used (:func:`distsgd.util.lazy.defer_import`).
"""

from __future__ import annotations

import sys

from distsgd.util.lazy import defer_import


def main() -> int:
    if sys.argv[1:2] != ["worker"]:
        defer_import("torch")
    from distsgd.cli.main import main as cli_main

    return cli_main()
