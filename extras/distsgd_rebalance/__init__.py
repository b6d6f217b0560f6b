"""``--rebalance auto``, out of the library's core: when and what to move between a local run's
parameter servers (:mod:`distsgd_rebalance.policy`, pure), and the launcher's mover that
carries a move out over the servers' move RPCs (:mod:`distsgd_rebalance.mover`).

The servers' side of a move (export, import, commit: :mod:`distsgd.ps.moves`) is part of the
wire protocol and stays in the core; this package is the policy above it. distsgd reaches it
only through :mod:`distsgd.launcher.server_watch`, inside a function, when a run asks for
``--rebalance auto``; a run without it never loads this package (tests/test_import_graph.py).
"""

from distsgd_rebalance.mover import Rebalancer
from distsgd_rebalance.policy import Decision, Move, decide, piece_rates, summary

__all__ = ["Decision", "Move", "Rebalancer", "decide", "piece_rates", "summary"]
