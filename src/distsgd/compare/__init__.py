"""``distsgd compare``: several schemes run in turn on the same script, data and seed, then one
report of them all.

``entries.py`` parses ``--schemes`` (names and variants such as ``downpour(server_lr=1)``);
``config.py`` holds :class:`~distsgd.compare.config.CompareConfig`; ``run.py`` runs each entry
through the launcher; ``summary.py`` reads each run folder into a ``SchemeRun``; ``report.py``
writes ``compare.md`` and ``compare.json``; ``figure.py`` draws ``compare.png`` with matplotlib,
the optional ``compare`` extra (``pip install 'distsgd[compare]'``).
"""
