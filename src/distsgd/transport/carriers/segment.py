"""A shared-memory segment (see "Shared memory" in the .proto): the server writes a pull's
values into the segment's pull area, the client writes a push's payload into its push area, and
only the request and its answer travel (by gRPC, or on the data channel)."""

from __future__ import annotations

import socket

import numpy as np

from distsgd.transport import shm
from distsgd.transport.carriers.attached import AttachedCarrier
from distsgd.transport.carriers.base import Payload
from distsgd.transport.link import Link
from distsgd.transport.proto import distsgd_pb2 as pb


class SegmentCarrier(AttachedCarrier):
    """A confirmed segment: ``pull_views`` and ``push_views`` are views of its areas."""

    def __init__(
        self,
        link: Link,
        segment_id: int,
        segment: shm.Segment,
        pull_views: dict[str, np.ndarray],
        push_views: dict[str, np.ndarray],
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(link, segment_id, pull_views, push_views, sock)
        self.segment = segment

    def close(self) -> None:
        self.segment.close()
        super().close()

    def push_area(self) -> dict[str, np.ndarray] | None:
        return self.push_views

    def release_pulled(self) -> None:
        for view in self.pull_views.values():
            self.segment.discard(view)

    def carries(self, payload: Payload) -> bool:
        if not payload.encoded:
            return all(self.fits(key, array) for key, array in payload.items())
        return all(
            key in self.push_views and data.size <= self.push_views[key].nbytes
            for key, data in payload.items()
        )

    def push(self, header: pb.PushHeader, payload: Payload) -> pb.PushResponse:
        for key, data in payload.items():
            area = self.push_views[key]
            if payload.encoded:
                area.reshape(-1).view(np.uint8)[: data.size] = data
            elif not _is_area(data, area):  # a payload written in place needs no copy
                np.copyto(area, data, casting="no")
        return self.send_push(header)


def _is_area(array: np.ndarray, area: np.ndarray) -> bool:
    """Whether ``array`` is ``area`` itself (the same memory, shape and dtype)."""
    array = np.asarray(array)
    return (
        array.__array_interface__["data"][0] == area.__array_interface__["data"][0]
        and array.shape == area.shape
        and array.dtype == area.dtype
        and array.flags.c_contiguous
    )
