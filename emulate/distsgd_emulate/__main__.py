"""``python -m distsgd_emulate``: the ``distsgd-emulate`` command."""

import sys

from distsgd_emulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
