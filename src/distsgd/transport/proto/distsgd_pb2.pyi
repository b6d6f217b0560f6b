from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION: _ClassVar[ProtocolVersion]

PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION: ProtocolVersion

class RequestHeader(_message.Message):
    __slots__ = ("incarnation", "protocol_version", "run_id", "worker")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    worker: int
    incarnation: int
    def __init__(
        self,
        protocol_version: int | None = ...,
        run_id: str | None = ...,
        worker: int | None = ...,
        incarnation: int | None = ...,
    ) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "key", "shape")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self, key: str | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ...
    ) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("data", "index", "offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(
        self, index: int | None = ..., offset: int | None = ..., data: bytes | None = ...
    ) -> None: ...

class RegisterHeader(_message.Message):
    __slots__ = ("header", "num_workers", "options_json", "scheme", "shard_index", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    scheme: str
    options_json: str
    num_workers: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shard_index: int
    def __init__(
        self,
        header: RequestHeader | _Mapping | None = ...,
        scheme: str | None = ...,
        options_json: str | None = ...,
        num_workers: int | None = ...,
        tensors: _Iterable[TensorSpec | _Mapping] | None = ...,
        shard_index: int | None = ...,
    ) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("chunk", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RegisterHeader
    chunk: TensorChunk
    def __init__(
        self,
        header: RegisterHeader | _Mapping | None = ...,
        chunk: TensorChunk | _Mapping | None = ...,
    ) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("created", "version")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    created: bool
    version: int
    def __init__(self, created: bool | None = ..., version: int | None = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("header", "min_version", "wait_seconds")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    min_version: int
    wait_seconds: float
    def __init__(
        self,
        header: RequestHeader | _Mapping | None = ...,
        min_version: int | None = ...,
        wait_seconds: float | None = ...,
    ) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("tensors", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(
        self, version: int | None = ..., tensors: _Iterable[TensorSpec | _Mapping] | None = ...
    ) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("chunk", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: TensorChunk
    def __init__(
        self, header: PullHeader | _Mapping | None = ..., chunk: TensorChunk | _Mapping | None = ...
    ) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("base_version", "header", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    base_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(
        self,
        header: RequestHeader | _Mapping | None = ...,
        base_version: int | None = ...,
        tensors: _Iterable[TensorSpec | _Mapping] | None = ...,
    ) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("chunk", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(
        self, header: PushHeader | _Mapping | None = ..., chunk: TensorChunk | _Mapping | None = ...
    ) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("accepted", "reason", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    reason: str
    def __init__(
        self, accepted: bool | None = ..., version: int | None = ..., reason: str | None = ...
    ) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: RequestHeader | _Mapping | None = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = (
        "active_workers",
        "finished_workers",
        "num_workers",
        "protocol_version",
        "pushes_accepted",
        "pushes_rejected",
        "registered",
        "scheme",
        "shard_index",
        "tensors",
        "version",
    )
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    registered: bool
    scheme: str
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_workers: int
    active_workers: int
    finished_workers: int
    shard_index: int
    pushes_accepted: int
    pushes_rejected: int
    def __init__(
        self,
        protocol_version: int | None = ...,
        registered: bool | None = ...,
        scheme: str | None = ...,
        version: int | None = ...,
        tensors: _Iterable[TensorSpec | _Mapping] | None = ...,
        num_workers: int | None = ...,
        active_workers: int | None = ...,
        finished_workers: int | None = ...,
        shard_index: int | None = ...,
        pushes_accepted: int | None = ...,
        pushes_rejected: int | None = ...,
    ) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: RequestHeader | _Mapping | None = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: int | None = ...) -> None: ...
