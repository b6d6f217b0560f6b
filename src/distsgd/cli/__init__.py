"""The ``distsgd`` command-line tool (the top layer)."""
