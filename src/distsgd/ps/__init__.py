"""Parameter-server layer: placement of parameters on shards, the shard and its update rules,
the gRPC service, and the worker's multi-shard client. Framework-agnostic (numpy)."""

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
