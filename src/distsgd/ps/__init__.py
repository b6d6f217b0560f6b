"""Parameter-server layer: placement of parameters on shards, the shard and its update rules,
the gRPC service, and the worker's multi-shard client. Framework-agnostic (numpy).

Names are imported on first use, so that a module of this layer that needs no network
(``ps.compression``, ``ps.wire``, ``ps.rules``: what ``control.config`` and the planner read)
imports without gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distsgd.util.lazy import lazy_exports

__all__ = [
    "ACCEPTED",
    "ParamInfo",
    "ParameterClient",
    "PartitionPlan",
    "Piece",
    "PushMeta",
    "PushOutcome",
    "RuleFactory",
    "ServerOptions",
    "ServerSGD",
    "SgdServerOptions",
    "Shard",
    "UpdateRule",
    "bounded",
    "serve",
    "start_server",
    "stop_server",
]

_RULES = ("ACCEPTED", "PushMeta", "PushOutcome", "RuleFactory", "ServerOptions", "ServerSGD")
_EXPORTS = {
    **{name: "distsgd.ps.rules" for name in (*_RULES, "SgdServerOptions", "UpdateRule")},
    "bounded": "distsgd.ps.rules",
    "ParameterClient": "distsgd.ps.client",
    "ParamInfo": "distsgd.ps.partition",
    "PartitionPlan": "distsgd.ps.partition",
    "Piece": "distsgd.ps.partition",
    "serve": "distsgd.ps.server",
    "start_server": "distsgd.ps.server",
    "stop_server": "distsgd.ps.server",
    "Shard": "distsgd.ps.shard",
}

if TYPE_CHECKING:
    from distsgd.ps.client import ParameterClient
    from distsgd.ps.partition import ParamInfo, PartitionPlan, Piece
    from distsgd.ps.rules import (
        ACCEPTED,
        PushMeta,
        PushOutcome,
        RuleFactory,
        ServerOptions,
        ServerSGD,
        SgdServerOptions,
        UpdateRule,
        bounded,
    )
    from distsgd.ps.server import serve, start_server, stop_server
    from distsgd.ps.shard import Shard


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
