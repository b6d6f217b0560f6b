"""``python -m distsgd`` is the ``distsgd`` command."""

import sys

from distsgd.cli.entry import main

sys.exit(main())
