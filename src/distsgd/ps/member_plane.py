"""The membership calls of the parameter-server service (Join, Heartbeat, Leave) and its work
queue's (LeaseWork), to which :class:`~distsgd.ps.service.ParameterService` routes them; the
decisions are :mod:`distsgd.ps.membership`'s and :mod:`distsgd.ps.work`'s."""

from __future__ import annotations

import logging

import grpc

from distsgd.ps.service_errors import abort, clip, guarded
from distsgd.ps.shard import Shard
from distsgd.ps.shard_holder import ShardHolder
from distsgd.ps.work import MAX_DONE, MAX_LEASE, Unit, WorkQueue, WorkSpec
from distsgd.transport.errors import Refusal
from distsgd.transport.proto import distsgd_pb2 as pb

log = logging.getLogger(__name__)


def work_status(queue: WorkQueue) -> pb.WorkStatus:
    """The queue's state as the wire's WorkStatus (call under the shard's lock)."""
    spec = queue.spec
    return pb.WorkStatus(
        epochs=spec.num_epochs,
        units_per_epoch=spec.units_per_epoch,
        total_units=spec.total_units,
        units_done=queue.units_done,
        epoch=queue.epoch,
        finished=queue.finished,
        unit_size=spec.unit_size,
        samples=spec.samples,
        **queue.tally(),
    )


def work_spec(spec: pb.WorkSpec, context: grpc.ServicerContext) -> WorkSpec | None:
    """``RegisterHeader.work`` checked: None for samples 0 (no work units)."""
    if spec.samples == 0:
        return None
    try:
        return WorkSpec(
            samples=spec.samples, unit_size=spec.unit_size, epochs=spec.epochs, seed=spec.seed
        )
    except ValueError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc), 400))


def _membership_reply(shard: Shard, epoch: int, members: list[int]) -> pb.MembershipResponse:
    return pb.MembershipResponse(
        epoch=epoch,
        members=members,
        evict_after_seconds=shard.membership.evict_after,
        max_workers=shard.membership.max_workers,
    )


class MembershipPlane:
    """Join, Heartbeat and Leave of ``holder``'s shard."""

    def __init__(self, holder: ShardHolder) -> None:
        self.holder = holder

    @guarded
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self.holder.check(request.header, context)
        shard = self.holder.registered(context)
        version = shard.leave(request.header.worker)
        log.info("shard %d: worker %d finished", self.holder.index, request.header.worker)
        return pb.LeaveResponse(version=version)

    @guarded
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.MembershipResponse:
        shard = self.holder.check_member(request.header, context, joining=True)
        self.holder.unless_closing(context)
        joined = shard.join(request.header.worker, request.header.incarnation, claim=request.claim)
        if joined is None:
            abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker {request.header.worker} is or was in use in this run; a joining worker "
                "takes an index never used (leave out --task to be given one)",
                Refusal.TAKEN,
            )
        return _membership_reply(shard, *joined)

    @guarded
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.MembershipResponse:
        shard = self.holder.check_member(request.header, context, joining=False)
        seen = shard.heartbeat(request.header.worker, request.header.incarnation)
        if seen is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {request.header.worker} is not a member of ps{self.holder.index} (never "
                "joined, left, or evicted); call Join again",
                Refusal.NOT_MEMBER,
            )
        return _membership_reply(shard, *seen)


class WorkPlane:
    """LeaseWork: the work units ``holder``'s shard hands out (ps0 of a dynamic run)."""

    def __init__(self, holder: ShardHolder) -> None:
        self.holder = holder

    @guarded
    def LeaseWork(
        self, request: pb.LeaseRequest, context: grpc.ServicerContext
    ) -> pb.LeaseResponse:
        # a lease makes the worker a member (as a pull does): the index checks of a Join
        shard = self.holder.check_member(request.header, context, joining=True)
        self.holder.unless_closing(context)
        queue = shard.work
        if queue is None:
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ps{self.holder.index} hands out no work units; ask ps0 of a run registered "
                "with them (--world-size dynamic)",
                Refusal.NO_WORK,
            )
        if request.want > MAX_LEASE:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"want {request.want} is more than {MAX_LEASE} units; lease fewer ahead",
            )
        if len(request.done) > MAX_DONE:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.done)} done units in one call; report at most {MAX_DONE}",
            )
        done: list[Unit] = []
        for item in request.done:
            unit = (item.epoch, item.unit)
            why = queue.spec.check_unit(unit)
            if why is not None:
                abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"done unit {why}; report only units this run leased",
                )
            done.append(unit)
        worker, incarnation = request.header.worker, request.header.incarnation
        held, ignored, queue = shard.lease_work(worker, incarnation, done, request.want)
        with shard.cond:
            status = work_status(queue)
        return pb.LeaseResponse(
            units=[pb.WorkUnit(epoch=e, unit=u) for e, u in held],
            ignored=[pb.WorkUnit(epoch=e, unit=u) for e, u in ignored],
            status=status,
        )
