"""What a scheme sees of the worker: the replica, its place in the cluster, and communication.

Every exchange a scheme makes goes through these methods, so retries, deadlines, byte counts
and versions are handled in one place.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch  # used inside methods only: a parameter server imports this module without it

from distsgd.control.config import TrainConfig
from distsgd.control.divergence import Diverged
from distsgd.control.faults import FaultInjector
from distsgd.control.timing import PhaseClock
from distsgd.ps.client import ParameterClient
from distsgd.ps.compression import encoding_for
from distsgd.transport.client import PushResult
from distsgd.transport.errors import PushReject
from distsgd.util.libc import trim_heap

T = TypeVar("T")

if TYPE_CHECKING:
    from torch import nn

    from distsgd.runtime.collective import Collective, PendingMean
    from distsgd.runtime.encoded_mean import EncodedMean


RELEASE_BYTES = 16 << 20
"""Exchanged parameters from which :meth:`WorkerContext.release_grads` and
``pull(release=True)`` give their buffers back; a smaller model keeps them: the heap's trim
costs about 0.25 ms an exchange (about 1% of a round of ten 3 ms steps) for memory that does
not matter at that size."""


class WorkerContext:
    """The replica and the channels of one worker, handed to every scheme hook."""

    def __init__(
        self,
        *,
        model: nn.Module,
        config: TrainConfig,
        rank: int,
        num_workers: int,
        device: torch.device,
        ps: ParameterClient | None = None,
        collective: Collective | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.rank = rank
        self.num_workers = num_workers
        self.device = device
        from distsgd.runtime.modules import exchanged_parameters  # torch: not at import

        self.params: dict[str, nn.Parameter] = exchanged_parameters(model)  # float, trainable
        self.model_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        """The exchanged parameters' bytes."""
        self._ps = ps
        self._collective = collective
        self._codec: EncodedMean | None = None
        self.faults: FaultInjector | None = None
        self.lr_scale = 1.0
        """The learning-rate schedule's factor this step (see ``TrainConfig.lr_schedule``)."""
        self._optimizers: list[torch.optim.Optimizer] = []
        self._adopted: torch.optim.Optimizer | None = None
        self.adopted_optimizer_taken = False
        """Whether the scheme took the user's optimizer (:meth:`adopt_optimizer`)."""
        self.checks_gradients = False
        """(Runtime) the loop scales its loss (``distsgd.Worker(grad_scaler=...)``): the
        gradients are unscaled after backward, and inf or NaN in them skips the update."""
        self.skip_update = False
        """This step's gradients hold inf or NaN after unscaling (only while
        :attr:`checks_gradients`): the scheme neither sends them nor steps with them, and
        :meth:`step_optimizer` does nothing; the step still counts."""
        self.lost_pushes = 0
        """Pushes that never reached the servers (network partition, server down)."""
        self.nonfinite_skipped = 0
        """Pushes the servers refused for NaN or Inf values (policy ``skip``)."""
        self.applied_pushes = 0
        """Shard pushes the servers accepted (one push to M shards counts M)."""
        self._push_numbers = itertools.count(1)
        self.pushes_started = 0
        """Pushes begun (one per :meth:`push`, to all shards); the number of the latest."""
        self.push_outcomes: deque[tuple[int, bool]] = deque(maxlen=4096)
        """(push number, accepted by every shard) of each push as it ends: the update a step
        made before push number n began is on the servers when push n was accepted (work units
        wait for it, :mod:`distsgd.runtime.work`, and take these out)."""
        self.staleness_sum = 0
        """Sum over accepted shard pushes of the updates other pushes made between the
        version the payload was computed on and its own (0 when nothing came between)."""
        self.staleness_counts: Counter[int] = Counter()
        """Accepted shard pushes by their staleness: the histogram of ``staleness_sum``."""
        self.local_step = 0
        """Steps this worker has taken."""
        self.push_step = 0
        """The steps a push made now reflects (set by the session before each scheme hook: the
        local step before a step, one more after its backward): it numbers the push
        (:func:`distsgd.ps.sequence.push_sequence`), so a push trained again after a restart
        goes out under the number the servers know. A :meth:`background` exchange keeps the
        value it had when it began."""
        self._exchange_step = threading.local()
        self.global_step = 0
        """Updates the cluster has applied, as last heard (server version, or local steps)."""
        self.clock = PhaseClock()
        """Where this worker's time goes; every exchange below is timed into it."""

    # -- replica --------------------------------------------------------------------------------
    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def arrays(self) -> dict[str, np.ndarray]:
        """The replica's parameters as numpy arrays (copies)."""
        return {name: p.detach().cpu().numpy().copy() for name, p in self.params.items()}

    def views(self) -> dict[str, np.ndarray]:
        """The replica's parameters as numpy arrays without a copy where they are contiguous on
        the CPU (views: they change as the replica trains; read them between steps), copies
        where they are not."""
        views = self._param_views()
        return self.arrays() if views is None else views

    def grads(self) -> dict[str, np.ndarray]:
        """The replica's gradients as numpy arrays (zeros where a parameter got none)."""
        return {
            name: np.zeros(tuple(p.shape), np.float32)
            if p.grad is None
            else p.grad.detach().cpu().numpy()
            for name, p in self.params.items()
        }

    def load(self, arrays: Mapping[str, np.ndarray], *, partial: bool = False) -> None:
        """Overwrite the replica's parameters (``partial``: those in ``arrays``)."""
        with torch.no_grad():
            for name, p in self.params.items():
                if partial and name not in arrays:
                    continue
                p.copy_(torch.from_numpy(np.asarray(arrays[name])).to(p.device))

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """(Runtime) the user's own optimizer: the first :meth:`make_optimizer` returns it
        instead of making one. It must hold exactly the replica's parameters (those not
        exchanged, such as frozen ones or Keras's BatchNorm statistics, may be there too:
        they get no gradient)."""
        from distsgd.runtime.modules import is_exchanged

        held = {
            id(p) for group in optimizer.param_groups for p in group["params"] if is_exchanged(p)
        }
        if held != {id(p) for p in self.params.values()}:
            raise ValueError(
                "optimizer= must hold exactly the model's parameters (build it with "
                "torch.optim.X(model.parameters()) after the model)"
            )
        self._adopted = optimizer

    def make_optimizer(self, kind: str = "sgd", **overrides: float | bool) -> torch.optim.Optimizer:
        """A local optimizer over the replica with the run's lr and momentum (overridable);
        the user's own (``optimizer=`` of ``distsgd.Worker``), if one was given, instead.

        The runtime applies the learning-rate schedule to every optimizer made here.
        """
        if self._adopted is not None and not self.adopted_optimizer_taken:
            self.adopted_optimizer_taken = True
            for group in self._adopted.param_groups:
                group.setdefault("base_lr", group["lr"])
            self._optimizers.append(self._adopted)
            return self._adopted
        params = list(self.params.values())
        kw: dict[str, float | bool] = {"lr": self.config.lr}
        if kind == "sgd":
            kw["momentum"] = self.config.momentum
        kw.update(overrides)
        classes = {
            "sgd": torch.optim.SGD,
            "adagrad": torch.optim.Adagrad,
            "adamw": torch.optim.AdamW,
        }
        if kind not in classes:
            raise ValueError(f"unknown optimizer {kind!r}; use sgd, adagrad or adamw")
        if kind == "adamw" and _fusable(params):  # 2-4x faster, no whole-model temporaries
            kw.setdefault("fused", True)
        optimizer = classes[kind](params, **kw)  # type: ignore[arg-type]
        for group in optimizer.param_groups:
            group["base_lr"] = group["lr"]
        self._optimizers.append(optimizer)
        return optimizer

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The local optimizers made by :meth:`make_optimizer` (the user's own among them)."""
        return list(self._optimizers)

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step a local optimizer with this step's gradients, unless they are not finite
        (:attr:`skip_update`): every scheme's local update goes through here."""
        if not self.skip_update:
            optimizer.step()

    def gradients_averaged(self) -> None:
        """(A scheme that averaged the gradients itself, after backward) when the loop scales
        its loss, the mean decides the skip: an inf or NaN on any worker skips the update on
        every one of them alike."""
        if self.checks_gradients:
            from distsgd.runtime.amp import all_finite_grads

            self.skip_update = not all_finite_grads(self.params.values())

    def set_lr_scale(self, scale: float) -> None:
        """(Runtime) the schedule's factor for this step: local optimizers and pushes follow it."""
        self.lr_scale = scale
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * scale

    # -- parameter servers ----------------------------------------------------------------------
    @property
    def ps(self) -> ParameterClient:
        if self._ps is None:
            raise RuntimeError(
                "this scheme has no parameter servers (uses_parameter_servers=False)"
            )
        return self._ps

    @property
    def live_workers(self) -> int:
        """The number of workers a scheme counts now: the registered number, or under
        ``--world-size dynamic`` the live members the servers last reported."""
        if self.config.world_size == "dynamic" and self._ps is not None:
            return self._ps.live_workers or self.num_workers
        return self.num_workers

    @property
    def versions(self) -> list[int]:
        """Each shard's version as of the last pull."""
        return list(self.ps.versions)

    def pull_arrays(
        self, *, min_version: int | Sequence[int] = 0, names: Collection[str] | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """The servers' parameters (not loaded into the replica): (version, arrays);
        ``names``: only those parameters, from the shards that hold them."""
        return self._timed_pull(min_version=min_version, names=names)

    def _timed_pull(self, **pull: Any) -> tuple[int, dict[str, np.ndarray]]:
        """``ps.pull(**pull)``, its time split into ``wait`` and ``pull``; the version seen."""
        if self.faults is not None:
            self.faults.wait_partition()  # a partitioned worker's pulls retry until it heals
        began = time.perf_counter()
        with self.clock.within("pull"):
            version, arrays = self.ps.pull(**pull)
        waited = self.ps.last_waited
        self.clock.add("wait", waited)
        self.clock.add("pull", time.perf_counter() - began - waited)
        self.global_step = max(self.global_step, version)
        return version, arrays

    def pull(
        self,
        *,
        min_version: int | Sequence[int] = 0,
        names: Collection[str] | None = None,
        release: bool = False,
    ) -> int:
        """Load the servers' parameters (``names``: those) into the replica; their version.

        ``release``: give back the memory the values came through (a shared-memory pull area
        of the model's size) once they are in the replica, for a scheme that pulls seldom: the
        next pull takes it again. Not for a model under :data:`RELEASE_BYTES`."""
        try:
            views = self._param_views()
            if views is None:
                version, arrays = self.pull_arrays(min_version=min_version, names=names)
                self.load(arrays, partial=names is not None)
                return version
            with torch.no_grad():  # written in place: no autograd graph holds the parameters now
                return self._timed_pull(min_version=min_version, into=views, names=names)[0]
        finally:
            if release and self._ps is not None and self.model_bytes >= RELEASE_BYTES:
                self._ps.release_pulled()

    def _param_views(self) -> dict[str, np.ndarray] | None:
        """Numpy views of the parameters' memory (CPU, contiguous), for pulls that write the
        values straight into the replica; None when any parameter is elsewhere."""
        views = {}
        for name, p in self.params.items():
            if p.device.type != "cpu" or not p.data.is_contiguous():
                return None
            views[name] = p.data.numpy()
        return views

    def push(
        self, arrays: Mapping[str, np.ndarray], *, base_version: int | Sequence[int] | None = None
    ) -> list[PushResult]:
        """Send named arrays to the servers' update rule; one result per shard."""
        number = self.pushes_started = next(self._push_numbers)
        if self.faults is not None and self.faults.partitioned:
            self.lost_pushes += 1
            self.push_outcomes.append((number, False))
            return [
                PushResult(False, v, "lost: partitioned", PushReject.LOST) for v in self.ps.versions
            ]
        bases = list(self.ps.versions) if base_version is None else base_version
        step = getattr(self._exchange_step, "step", self.push_step)
        with self.clock.measure("push"):
            results = self.ps.push(arrays, base_version=bases, lr_scale=self.lr_scale, step=step)
        per_shard = [bases] * len(self.ps.versions) if isinstance(bases, int) else bases
        for base, result in zip(per_shard, results, strict=True):
            if result.accepted and result.sent:  # it made result.version (or joined its step)
                self.applied_pushes += 1
                gap = max(0, result.version - 1 - base)
                self.staleness_sum += gap
                self.staleness_counts[gap] += 1
        self.push_outcomes.append((number, all(r.accepted for r in results)))
        if any(r.reject is PushReject.LOST for r in results):
            self.lost_pushes += 1
        refused = [r.reason for r in results if r.reject is PushReject.NONFINITE]
        if refused:
            self.nonfinite_skipped += 1
            if self.config.nonfinite == "stop":
                raise Diverged(
                    f"worker{self.rank}: the servers refused a non-finite push at step "
                    f"{self.local_step} ({refused[0]}; --nonfinite skip drops such updates)"
                )
        self.global_step = max([self.global_step, *(r.version for r in results)])
        return results

    def background(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` (an exchange) in a background thread while training goes on; wait for it
        with :meth:`wait_for`. Its pulls and pushes are not counted in the time split; the
        loop's wait for it is. The parameter client runs one exchange at a time."""
        future: Future[T] = Future()
        step = self.push_step  # what its push reflects: the steps done as it begins

        def run() -> None:
            self._exchange_step.step = step
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the loop's thread by wait_for
                future.set_exception(exc)

        threading.Thread(target=run, name=f"worker{self.rank}-exchange", daemon=True).start()
        return future

    def wait_for(self, future: Future[T]) -> T:
        """The result of a :meth:`background` exchange (its error, raised here); the time the
        loop waits counts as ``push``."""
        with self.clock.measure("push"):
            return future.result()

    def staleness_histogram(self) -> dict[str, int]:
        """``staleness_counts`` as JSON wants it: staleness (as text) -> pushes, ascending."""
        return {str(k): v for k, v in sorted(self.staleness_counts.items())}

    @property
    def mean_staleness(self) -> float:
        """Mean staleness of this worker's accepted pushes so far (see ``staleness_sum``)."""
        return self.staleness_sum / max(1, self.applied_pushes)

    def release_grads(self) -> None:
        """Free the replica's gradients until the next backward makes them again (a scheme
        that has used them, before an exchange that needs memory of the model's size), and give
        their pages back to the system (C heap blocks stay resident when freed). Nothing for a
        model under :data:`RELEASE_BYTES`."""
        if self.model_bytes < RELEASE_BYTES:
            return
        for p in self.params.values():
            p.grad = None
        trim_heap()

    def push_buffers(self) -> dict[str, np.ndarray] | None:
        """Arrays (one per parameter, of its shape) into which a scheme may write a whole
        push, so that :meth:`push` of them copies nothing: the servers' shared-memory push
        areas, or None (no shared memory, compression, a piece split over servers). Write them
        only between calls, never while a push runs in the background."""
        return None if self._ps is None else self._ps.push_buffers()

    def push_grads(
        self, *, base_version: int | Sequence[int] | None = None, in_place: bool = False
    ) -> list[PushResult]:
        """Send the replica's gradients.

        ``in_place``: from the next step on, backward writes the gradients straight into the
        servers' shared-memory push areas (``param.grad`` become views of them), so a push
        copies nothing. Only for a scheme that pushes ``param.grad`` as they are and does not
        touch them until the next backward (never while a push of its runs in the background).
        Without shared memory (or with compression) it changes nothing."""
        results = self.push(self.grads(), base_version=base_version)
        if in_place:
            self._grads_in_push_area()
        return results

    def _grads_in_push_area(self) -> None:
        """Point every ``param.grad`` at its place in the push areas (again after a new
        segment); leave them where they are when there is no such place."""
        buffers = self.push_buffers()
        if buffers is None:
            return
        for name, p in self.params.items():
            area = buffers[name]
            if p.device.type != "cpu" or str(p.dtype).removeprefix("torch.") != area.dtype.name:
                return
        for name, p in self.params.items():
            area = buffers[name]
            if p.grad is None or p.grad.data_ptr() != area.__array_interface__["data"][0]:
                p.grad = torch.from_numpy(area)

    # -- collectives ----------------------------------------------------------------------------
    def allreduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Average tensors over all workers in place (no-op with one worker)."""
        if self._collective is not None:
            with self.clock.measure("allreduce"):
                self._collective.allreduce_mean(tensors)

    def start_mean(
        self, tensors: list[torch.Tensor], *, key: str = "", compressed: bool = False
    ) -> PendingMean:
        """Start averaging tensors over all workers while training goes on; end it with
        :meth:`wait_mean`, which writes the means in place (nothing to do with one worker).

        ``compressed``: travel as ``--wire-dtype`` and ``--topk`` say (all-gathered encoded
        frames with error feedback under ``key``, :mod:`distsgd.runtime.encoded_mean`), for a
        scheme that averages changes; float32 all-reduce when neither flag is set."""
        from distsgd.runtime.collective import PendingMean  # torch: not at import

        if self._collective is None:
            return PendingMean([], torch.zeros(0), None, 1)
        codec = self._encoded_mean() if compressed else None
        return self._collective.start_mean(tensors, codec=codec, key=key)

    def wait_mean(self, pending: PendingMean) -> None:
        """End a :meth:`start_mean`; the time the loop waits counts as ``allreduce``."""
        with self.clock.measure("allreduce"):
            pending.wait()

    def _encoded_mean(self) -> EncodedMean | None:
        if self.config.wire_dtype == "float32" and not self.config.topk:
            return None
        if self._codec is None:
            from distsgd.runtime.encoded_mean import EncodedMean

            self._codec = EncodedMean(encoding_for(self.config.wire_dtype), self.config.topk)
        return self._codec

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Copy worker ``src``'s tensors to all (no-op with one worker)."""
        if self._collective is not None:
            with self.clock.measure("allreduce"):
                self._collective.broadcast(tensors, src)

    def data_parallel(
        self, model: nn.Module, *, powersgd_start: int = 0, static_graph: bool = True
    ) -> nn.Module:
        """``model`` in PyTorch's DistributedDataParallel with the config's communication hook
        (``wire_dtype``, ``powersgd_rank``; see :mod:`distsgd.runtime.ddp`), its bytes counted
        in :attr:`bytes_sent`; ``model`` itself with one worker (nothing to all-reduce).
        ``powersgd_start``: plain steps before PowerSGD starts (0: ``ddp.POWERSGD_START``);
        ``static_graph``: forward uses the same parameters at every step (False: they change)."""
        if self._collective is None:
            return model
        from distsgd.runtime.ddp import POWERSGD_START, data_parallel

        return data_parallel(
            model,
            self._collective,
            wire_dtype=self.config.wire_dtype,
            powersgd_rank=self.config.powersgd_rank,
            powersgd_start=powersgd_start or POWERSGD_START,
            static_graph=static_graph,
        )

    @property
    def bytes_sent(self) -> int:
        sent = 0 if self._ps is None else self._ps.bytes_sent
        return sent + (0 if self._collective is None else self._collective.bytes_sent)

    @property
    def bytes_received(self) -> int:
        """Tensor bytes this worker's pulls brought from the parameter servers, as they
        travelled (halved by ``--pull-dtype bf16``); 0 under collective schemes."""
        return 0 if self._ps is None else self._ps.bytes_received


def _fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes ``params``: floating point, all on the CPU or all on
    one CUDA device. The foreach kernels it replaces make a temporary as large as the model at
    every step (the denominator); the fused kernel works piece by piece."""
    devices = {p.device.type for p in params}
    return (
        bool(params)
        and all(p.is_floating_point() for p in params)
        and (devices == {"cpu"} or devices == {"cuda"})
    )
