"""The ``distsgd`` program's entry point (console script and ``python -m distsgd``).

Only workers run PyTorch code, and only they import it: the launcher (``run``, ``demo``,
``compare``), a parameter server (``server``) and the tools read the torch-free scheme catalogue
(``distsgd.schemes``); a worker loads its scheme's torch half (``distsgd.workers``) by name.
"""

from __future__ import annotations


def main() -> int:
    from distsgd.cli.main import main as cli_main

    return cli_main()
