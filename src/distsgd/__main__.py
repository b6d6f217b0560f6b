"""``python -m distsgd`` is the ``distsgd`` command."""

import sys

from distsgd.cli.main import main

sys.exit(main())
