"""PyTorch's DistributedDataParallel for the all-reduce family, with its communication hooks.

:func:`data_parallel` wraps a replica in ``torch.nn.parallel.DistributedDataParallel`` on the
default process group (the one :class:`~distsgd.runtime.collective.Collective` joined). DDP
groups the gradients into buckets (the first about 1 MB, then up to 25 MB, in the reverse order
of the parameters) and starts each bucket's all-reduce as soon as backward has produced all of
its gradients, so communication overlaps the rest of backward; when ``backward()`` returns
every ``param.grad`` holds the mean over the workers.

What travels is chosen by a communication hook, one of PyTorch's own
(``torch.distributed.algorithms.ddp_comm_hooks``):

- ``float32``: ``default_hooks.allreduce_hook``: divide by the number of workers, all-reduce
  (the sum), as DDP does without a hook;
- ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: the
  bucket is cast to 16 bits (and divided), all-reduced, and cast back;
- PowerSGD (``powersgd_rank`` R > 0): ``powerSGD_hook.powerSGD_hook`` with error feedback and
  warm start. The first ``start_iter`` steps all-reduce the whole bucket in float32; after
  them each gradient matrix M (n x m, a conv kernel flattened to n x (in * kh * kw)) travels as
  P = M Q (n x R) and Q = M^T P (m x R), when (n + m) R * 2 < n m; vectors (biases) and
  matrices too small to gain are all-reduced as they are.

Bytes: each hook is wrapped so that every call adds what it all-reduces to
``Collective.bytes_sent``, counted as :meth:`Collective.allreduce_mean` counts: the size of each
all-reduced tensor, once per call (not the 2 (N - 1) / N of it a ring moves per worker). For
float32 and the 16-bit hooks that is the bucket's length times 4 or 2 bytes. For PowerSGD it is
the bucket in float32 during the first ``start_iter`` steps, then the elements PowerSGD itself
counts as sent for the bucket (``PowerSGDState.total_numel_after_compression``, grown by the
call: the uncompressed tensors plus P and Q, the three buffers it all-reduces) times 4.

This module deliberately has no ``from __future__ import annotations``: DDP checks a hook's
``bucket`` annotation against ``dist.GradBucket`` itself, not a string.
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distsgd.ps import wire
from distsgd.runtime.collective import Collective

log = logging.getLogger(__name__)

POWERSGD_START = 10
"""Steps of plain float32 all-reduce before PowerSGD starts (``start_powerSGD_iter``): the
value of the example in PyTorch's ``powerSGD_hook`` docstring; torch requires at least 2 with
error feedback (DDP rebuilds its buckets after the first step)."""

HOOKS = wire.hooks()
"""``TrainConfig.wire_dtype`` -> the name of the ``default_hooks`` hook (``<name>_hook``), from
the wire vocabulary (:mod:`distsgd.ps.wire`)."""

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def data_parallel(
    model: nn.Module,
    collective: Collective,
    *,
    wire_dtype: str = "float32",
    powersgd_rank: int = 0,
    powersgd_start: int = POWERSGD_START,
    static_graph: bool = True,
) -> DistributedDataParallel:
    """``model`` in DistributedDataParallel on the default process group, with the hook that
    ``wire_dtype`` or ``powersgd_rank`` chooses, counting its bytes into ``collective``.

    DDP broadcasts worker 0's parameters and buffers as it is built, so the replicas start
    equal. Buffers are not broadcast again before each forward (``forward_sync_buffers=False``):
    as with the hand-written all-reduce, each worker keeps its own (BatchNorm statistics; the
    chief evaluates its own). Unused parameters: by default ``static_graph=True``, DDP finds
    the parameters forward does not use at the first step and expects the same ones at every
    step (a parameter never used keeps ``grad`` None); a model whose set then changes fails at
    the next step with torch's error (the scheme adds the hint). ``static_graph=False`` (the
    scheme's ``--dynamic-graph``) is ``find_unused_parameters=True``: the search at every step,
    a walk of the autograd graph and one small all-reduce (the map of used parameters) more,
    and torch warns once when it found none unused (expected: the log says so first).
    """
    # TrainConfig checked the value (ps.compression.encoding_for), the scheme that it is one
    # DDP all-reduces (AllreduceWorker.check_config refuses int8, int4, int2)
    assert wire_dtype in HOOKS, f"wire_dtype {wire_dtype!r} has no DDP hook"
    if not static_graph:
        log.info(
            "DDP looks for unused parameters at each step (--dynamic-graph); "
            "torch may warn once that it found none: expected"
        )
    ddp = DistributedDataParallel(
        model,
        device_ids=None,  # the runtime puts each batch on the model's device itself
        find_unused_parameters=not static_graph,
        static_graph=static_graph,
        forward_sync_buffers=False,
        gradient_as_bucket_view=True,  # param.grad are views of the buckets: no copy back
    )
    if powersgd_rank:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, _counted_powersgd(collective))
        log.info("DDP with PowerSGD of rank %d after %d plain steps", powersgd_rank, powersgd_start)
    else:
        hook = getattr(default_hooks, f"{HOOKS[wire_dtype]}_hook")
        ddp.register_comm_hook(None, _counted(hook, collective))
        log.info("DDP with the %s hook", hook.__name__)
    return ddp


def _counted(hook: Hook, collective: Collective) -> Hook:
    """``hook`` (allreduce_hook or a 16-bit compress hook), adding the bytes of the tensor it
    all-reduces (the bucket, cast to the hook's dtype) to ``collective.bytes_sent``."""
    wire = {"fp16_compress_hook": 2, "bf16_compress_hook": 2}.get(hook.__name__)

    def counted_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        collective.bytes_sent += buffer.numel() * (wire or buffer.element_size())
        return hook(state, bucket)

    return counted_hook


def _counted_powersgd(collective: Collective) -> Hook:
    """``powerSGD_hook``, adding what it all-reduces to ``collective.bytes_sent``."""

    def counted_powersgd_hook(
        state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        plain = state.iter < state.start_powerSGD_iter  # then the whole bucket, as it is
        before = state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        numel = buffer.numel() if plain else state.total_numel_after_compression - before
        collective.bytes_sent += numel * buffer.element_size()
        if not plain:
            # The hook all-reduces P and then Q from callbacks of the all-reduce before, in
            # whichever thread finishes it: another bucket's all-reduce, or DDP's own of the
            # used-parameter map, can be issued between them in a different order on each
            # worker, and gloo matches collectives by order ("Received data size doesn't match
            # expected size": 2 runs in 5 of the test). Waiting here keeps one order.
            future.wait()
        return future

    return counted_powersgd_hook
