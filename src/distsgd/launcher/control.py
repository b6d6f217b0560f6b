"""The launcher's run control: the run folder's files, written and read by tasks over the
network, so that a task needs no file another host wrote ("Run control" in the ``.proto``).

:class:`ControlServer` serves ``RunControl`` with the run secret on an address the tasks can
reach (loopback for tasks on this machine, the management address for emulated hosts, the
driver's node address on Ray) and writes into the run folder where the launcher runs: every
name is checked against the one table of what tasks write (``control.folder.TASK_FILES``), a
replaced file lands atomically (a temporary file renamed once its stream ended), an append is
one ``write`` (lines of two tasks never interleave), and nothing is written for a stream cut
short, a name the table refuses or a file over its size. The metrics lines it receives become
the tasks' TensorBoard events here, as a task on this disk writes them itself.

Torch-free; the tasks' side is :mod:`distsgd.control.remote_files`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, NoReturn

import grpc

from distsgd.control.board import BoardWriter, open_board
from distsgd.control.folder import METRICS_FILE, LocalFiles, TaskFile, task_file
from distsgd.control.remote_files import CHUNK
from distsgd.ps.auth import SecretInterceptor
from distsgd.transport.errors import PROTOCOL_VERSION
from distsgd.transport.proto import distsgd_pb2 as pb
from distsgd.transport.proto import distsgd_pb2_grpc as pb_grpc
from distsgd.util import private_dir

__all__ = ["ControlServer", "RunControl"]

log = logging.getLogger(__name__)

TASK_NAME = re.compile(r"(ps|worker|replica)[0-9]{1,6}")
"""The task names whose metrics lines become TensorBoard runs here."""
MAX_BOARDS = 4096
"""Most TensorBoard runs one run control keeps open (a run's tasks are far fewer)."""


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message[:300])
    raise AssertionError("unreachable")  # abort raises


def _whole(
    first: pb.RunFileChunk, rest: Iterator[pb.RunFileChunk], context: grpc.ServicerContext
) -> Iterator[pb.RunFileChunk]:
    """The chunks after ``first`` up to the one marked ``last``; a stream that ends before it
    was cut short (a cancelled call can end the reading here as a whole stream would), and
    is refused, so that nothing of it is written."""
    if first.last:
        return
    for chunk in rest:
        yield chunk
        if chunk.last:
            return
    _abort(context, grpc.StatusCode.CANCELLED, f"{first.name}: the stream was cut short")


class RunControl(pb_grpc.RunControlServicer):
    """The servicer: files of ``run_dir`` by the table's rules."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._files = LocalFiles(self.run_dir)
        self._boards: dict[str, BoardWriter | None] = {}
        self._board_lock = threading.Lock()
        self.written = 0
        """Bytes written for tasks so far."""

    def _entry(self, request: pb.RunFileChunk, context: grpc.ServicerContext) -> TaskFile:
        version = request.header.protocol_version
        if version != PROTOCOL_VERSION:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {version}, this launcher speaks {PROTOCOL_VERSION}; run "
                "the same distsgd on every host",
            )
        try:
            return task_file(request.name)
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def PutFile(
        self, request_iterator: Iterator[pb.RunFileChunk], context: grpc.ServicerContext
    ) -> pb.RunFileDone:
        first = next(request_iterator, None)
        if first is None:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "an empty PutFile stream")
        entry = self._entry(first, context)
        want = pb.RUN_FILE_WRITE_APPEND if entry.append else pb.RUN_FILE_WRITE_REPLACE
        if first.write != want:
            how = "appended to" if entry.append else "replaced"
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{first.name} is only {how}")
        path = self.run_dir / first.name
        private_dir(path.parent)
        if entry.append:
            data = self._gather(first, request_iterator, entry, context)
            if first.name == METRICS_FILE:
                self._check_lines(data, context)
            self._files.append(first.name, data)
            if first.name == METRICS_FILE:
                self._board(data)
            size = len(data)
        else:
            size = self._replace(path, first, request_iterator, entry, context)
        self.written += size
        return pb.RunFileDone(written=size)

    def _gather(
        self,
        first: pb.RunFileChunk,
        rest: Iterator[pb.RunFileChunk],
        entry: TaskFile,
        context: grpc.ServicerContext,
    ) -> bytes:
        parts, size = [first.data], len(first.data)
        for chunk in _whole(first, rest, context):
            size += len(chunk.data)
            if size > entry.limit:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"over {entry.limit} bytes")
            parts.append(chunk.data)
        return b"".join(parts)

    @staticmethod
    def _check_lines(data: bytes, context: grpc.ServicerContext) -> None:
        """Whole lines, each a JSON object: what every reader of the metrics expects."""
        try:
            lines = data.decode().split("\n")
            if lines[-1] != "":
                raise ValueError("the last line is not ended")
            for line in lines[:-1]:
                if not isinstance(json.loads(line), dict):
                    raise ValueError("a line is not a JSON object")
        except ValueError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{METRICS_FILE}: {exc}")

    def _replace(
        self,
        path: Path,
        first: pb.RunFileChunk,
        rest: Iterator[pb.RunFileChunk],
        entry: TaskFile,
        context: grpc.ServicerContext,
    ) -> int:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            size = 0
            with os.fdopen(fd, "wb") as out:
                for piece in itertools.chain((first,), _whole(first, rest, context)):
                    size += len(piece.data)
                    if size > entry.limit:
                        _abort(
                            context,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{first.name}: over {entry.limit} bytes",
                        )
                    out.write(piece.data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return size

    def _board(self, data: bytes) -> None:
        """Each line's TensorBoard points, in its task's run (as its own writer would)."""
        for line in data.decode().splitlines():
            record: dict[str, Any] = json.loads(line)
            task = record.get("task")
            if not isinstance(task, str) or not TASK_NAME.fullmatch(task):
                continue
            with self._board_lock:
                if task not in self._boards and len(self._boards) < MAX_BOARDS:
                    self._boards[task] = open_board(self.run_dir, task)
                board = self._boards.get(task)
            if board is None:
                continue
            stamp = record.get("time")
            try:
                board.write(record, stamp if isinstance(stamp, (int, float)) else time.time())
            except Exception as exc:  # a view of the metrics: it never refuses the lines
                log.warning("%s: no more TensorBoard events (%s)", task, exc)
                with self._board_lock:
                    self._boards[task] = None
                board.close()

    def GetFile(
        self, request: pb.RunFileChunk, context: grpc.ServicerContext
    ) -> Iterator[pb.RunFileChunk]:
        entry = self._entry(request, context)
        if not entry.readable:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{request.name} is not readable")
        try:
            with open(self.run_dir / request.name, "rb") as f:
                data = f.read(entry.limit + 1)
        except FileNotFoundError:
            yield pb.RunFileChunk(found=False)
            return
        for start in range(0, max(1, len(data)), CHUNK):
            yield pb.RunFileChunk(found=True, data=data[start : start + CHUNK])

    def RemoveFile(self, request: pb.RunFileChunk, context: grpc.ServicerContext) -> pb.RunFileDone:
        self._entry(request, context)
        existed = (self.run_dir / request.name).is_file()
        self._files.remove(request.name)
        return pb.RunFileDone(written=int(existed))

    def close(self) -> None:
        with self._board_lock:
            for board in self._boards.values():
                if board is not None:
                    board.close()
            self._boards.clear()


class ControlServer:
    """``RunControl`` for ``run_dir`` on ``host`` (``port``, 0: a free one), requiring
    ``secret``; its address in :attr:`address` once made. :meth:`close` stops it (calls in
    flight get 1 s)."""

    def __init__(
        self, run_dir: Path, *, host: str, secret: str | None, threads: int = 8, port: int = 0
    ) -> None:
        self.service = RunControl(run_dir)
        interceptors: list[grpc.ServerInterceptor[Any, Any]] = (
            [SecretInterceptor(secret)] if secret else []
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="control"),
            interceptors=interceptors,
            options=[("grpc.so_reuseport", 0)],  # a given port is this server's alone
        )
        pb_grpc.add_RunControlServicer_to_server(self.service, self.server)
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(
                f"the run control cannot listen on {host}:{port}; is {host} an address here "
                "(and the port free)?"
            )
        self.server.start()
        self.address = f"{host}:{bound}"
        """Where tasks reach it (``host:port``)."""
        log.debug("run control on %s for %s", self.address, run_dir)

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(timeout=2.0)
        self.service.close()
