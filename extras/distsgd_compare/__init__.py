"""``distsgd compare``, out of the library's core: several schemes run in turn on the same
script, data and seed, then one report of them all.

The entries of ``--schemes`` (names and variants such as ``downpour(server_lr=1)``) are parsed
by the catalogue (:mod:`distsgd.schemes.entries`); ``command.py`` turns the flags into a
:class:`~distsgd_compare.config.CompareConfig` (``config.py``); ``folders.py`` names each
entry's run folder; ``run.py`` runs each entry through the launcher; ``summary.py`` reads each
run folder into a ``SchemeRun``; ``report.py`` writes ``compare.md`` and ``compare.json``;
``figure.py`` draws ``compare.png`` with matplotlib, the optional ``compare`` extra
(``pip install 'distsgd[compare]'``). distsgd reaches this package only through
:mod:`distsgd.cli.main`, inside the function of ``distsgd compare`` (tests/test_import_graph.py).
"""
