from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION: _ClassVar[ProtocolVersion]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ENCODING_RAW: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_FP16: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_BF16: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_INT8: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_INT4: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_INT2: _ClassVar[TensorEncoding]

class PushRejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_REJECT_REASON_UNSPECIFIED: _ClassVar[PushRejectReason]
    PUSH_REJECT_REASON_STALE: _ClassVar[PushRejectReason]
    PUSH_REJECT_REASON_DUPLICATE: _ClassVar[PushRejectReason]
    PUSH_REJECT_REASON_NONFINITE: _ClassVar[PushRejectReason]
    PUSH_REJECT_REASON_MOVED: _ClassVar[PushRejectReason]
    PUSH_REJECT_REASON_LOST: _ClassVar[PushRejectReason]

class ChannelFrame(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANNEL_FRAME_UNSPECIFIED: _ClassVar[ChannelFrame]
    CHANNEL_FRAME_PULL: _ClassVar[ChannelFrame]
    CHANNEL_FRAME_PUSH: _ClassVar[ChannelFrame]
    CHANNEL_FRAME_ERROR: _ClassVar[ChannelFrame]

class ReplicaFrame(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_FRAME_UNSPECIFIED: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_HELLO: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_FILE: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_WRITE: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_FETCH: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_ACK: _ClassVar[ReplicaFrame]
    REPLICA_FRAME_ERROR: _ClassVar[ReplicaFrame]

class ReplicaFileKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_FILE_KIND_UNSPECIFIED: _ClassVar[ReplicaFileKind]
    REPLICA_FILE_KIND_SNAPSHOT: _ClassVar[ReplicaFileKind]
    REPLICA_FILE_KIND_LOG: _ClassVar[ReplicaFileKind]

class RunFileWrite(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_FILE_WRITE_UNSPECIFIED: _ClassVar[RunFileWrite]
    RUN_FILE_WRITE_REPLACE: _ClassVar[RunFileWrite]
    RUN_FILE_WRITE_APPEND: _ClassVar[RunFileWrite]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION: ProtocolVersion
TENSOR_ENCODING_RAW: TensorEncoding
TENSOR_ENCODING_FP16: TensorEncoding
TENSOR_ENCODING_BF16: TensorEncoding
TENSOR_ENCODING_INT8: TensorEncoding
TENSOR_ENCODING_INT4: TensorEncoding
TENSOR_ENCODING_INT2: TensorEncoding
PUSH_REJECT_REASON_UNSPECIFIED: PushRejectReason
PUSH_REJECT_REASON_STALE: PushRejectReason
PUSH_REJECT_REASON_DUPLICATE: PushRejectReason
PUSH_REJECT_REASON_NONFINITE: PushRejectReason
PUSH_REJECT_REASON_MOVED: PushRejectReason
PUSH_REJECT_REASON_LOST: PushRejectReason
CHANNEL_FRAME_UNSPECIFIED: ChannelFrame
CHANNEL_FRAME_PULL: ChannelFrame
CHANNEL_FRAME_PUSH: ChannelFrame
CHANNEL_FRAME_ERROR: ChannelFrame
REPLICA_FRAME_UNSPECIFIED: ReplicaFrame
REPLICA_FRAME_HELLO: ReplicaFrame
REPLICA_FRAME_FILE: ReplicaFrame
REPLICA_FRAME_WRITE: ReplicaFrame
REPLICA_FRAME_FETCH: ReplicaFrame
REPLICA_FRAME_ACK: ReplicaFrame
REPLICA_FRAME_ERROR: ReplicaFrame
REPLICA_FILE_KIND_UNSPECIFIED: ReplicaFileKind
REPLICA_FILE_KIND_SNAPSHOT: ReplicaFileKind
REPLICA_FILE_KIND_LOG: ReplicaFileKind
RUN_FILE_WRITE_UNSPECIFIED: RunFileWrite
RUN_FILE_WRITE_REPLACE: RunFileWrite
RUN_FILE_WRITE_APPEND: RunFileWrite

class RequestHeader(_message.Message):
    __slots__ = ("protocol_version", "run_id", "worker", "incarnation")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    worker: int
    incarnation: int
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., worker: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("key", "dtype", "shape", "encoding", "scale", "nnz")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    key: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: TensorEncoding
    scale: float
    nnz: int
    def __init__(self, key: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., scale: _Optional[float] = ..., nnz: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterHeader(_message.Message):
    __slots__ = ("header", "scheme", "options_json", "num_workers", "tensors", "shard_index", "work")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    scheme: str
    options_json: str
    num_workers: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shard_index: int
    work: WorkSpec
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., scheme: _Optional[str] = ..., options_json: _Optional[str] = ..., num_workers: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., shard_index: _Optional[int] = ..., work: _Optional[_Union[WorkSpec, _Mapping]] = ...) -> None: ...

class WorkSpec(_message.Message):
    __slots__ = ("samples", "unit_size", "epochs", "seed")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    UNIT_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    samples: int
    unit_size: int
    epochs: float
    seed: int
    def __init__(self, samples: _Optional[int] = ..., unit_size: _Optional[int] = ..., epochs: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class WorkUnit(_message.Message):
    __slots__ = ("epoch", "unit")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    unit: int
    def __init__(self, epoch: _Optional[int] = ..., unit: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("header", "done", "want")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    done: _containers.RepeatedCompositeFieldContainer[WorkUnit]
    want: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., done: _Optional[_Iterable[_Union[WorkUnit, _Mapping]]] = ..., want: _Optional[int] = ...) -> None: ...

class WorkStatus(_message.Message):
    __slots__ = ("epochs", "units_per_epoch", "total_units", "units_done", "epoch", "finished", "trained_once", "trained_twice", "never_trained", "unit_size", "samples")
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    UNITS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_UNITS_FIELD_NUMBER: _ClassVar[int]
    UNITS_DONE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_ONCE_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TWICE_FIELD_NUMBER: _ClassVar[int]
    NEVER_TRAINED_FIELD_NUMBER: _ClassVar[int]
    UNIT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    epochs: int
    units_per_epoch: int
    total_units: int
    units_done: int
    epoch: int
    finished: bool
    trained_once: _containers.RepeatedScalarFieldContainer[int]
    trained_twice: _containers.RepeatedScalarFieldContainer[int]
    never_trained: _containers.RepeatedScalarFieldContainer[int]
    unit_size: int
    samples: int
    def __init__(self, epochs: _Optional[int] = ..., units_per_epoch: _Optional[int] = ..., total_units: _Optional[int] = ..., units_done: _Optional[int] = ..., epoch: _Optional[int] = ..., finished: _Optional[bool] = ..., trained_once: _Optional[_Iterable[int]] = ..., trained_twice: _Optional[_Iterable[int]] = ..., never_trained: _Optional[_Iterable[int]] = ..., unit_size: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("units", "ignored", "status")
    UNITS_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    units: _containers.RepeatedCompositeFieldContainer[WorkUnit]
    ignored: _containers.RepeatedCompositeFieldContainer[WorkUnit]
    status: WorkStatus
    def __init__(self, units: _Optional[_Iterable[_Union[WorkUnit, _Mapping]]] = ..., ignored: _Optional[_Iterable[_Union[WorkUnit, _Mapping]]] = ..., status: _Optional[_Union[WorkStatus, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RegisterHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[RegisterHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("created", "version")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    created: bool
    version: int
    def __init__(self, created: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("header", "min_version", "wait_seconds", "server_incarnation", "segment", "encoding", "keys")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    min_version: int
    wait_seconds: float
    server_incarnation: int
    segment: int
    encoding: TensorEncoding
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., min_version: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., server_incarnation: _Optional[int] = ..., segment: _Optional[int] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "tensors", "server_incarnation", "waited_seconds", "in_segment")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SERVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IN_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    server_incarnation: int
    waited_seconds: float
    in_segment: bool
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., server_incarnation: _Optional[int] = ..., waited_seconds: _Optional[float] = ..., in_segment: _Optional[bool] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("header", "base_version", "tensors", "lr_scale", "segment", "sequence")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    base_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    lr_scale: float
    segment: int
    sequence: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., base_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., lr_scale: _Optional[float] = ..., segment: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("accepted", "version", "reason", "reject", "moved", "duplicate")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    reason: str
    reject: PushRejectReason
    moved: _containers.RepeatedCompositeFieldContainer[PieceOwner]
    duplicate: bool
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., reject: _Optional[_Union[PushRejectReason, str]] = ..., moved: _Optional[_Iterable[_Union[PieceOwner, _Mapping]]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "registered", "scheme", "version", "tensors", "num_workers", "active_workers", "finished_workers", "shard_index", "pushes_accepted", "pushes_rejected", "server_incarnation", "restored_version", "nonfinite_rejected", "membership_epoch", "members", "work", "load", "moved", "applied_sequence", "wal")
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
    SERVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WAL_FIELD_NUMBER: _ClassVar[int]
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
    server_incarnation: int
    restored_version: int
    nonfinite_rejected: int
    membership_epoch: int
    members: _containers.RepeatedScalarFieldContainer[int]
    work: WorkStatus
    load: ShardLoad
    moved: _containers.RepeatedCompositeFieldContainer[PieceOwner]
    applied_sequence: int
    wal: WalStatus
    def __init__(self, protocol_version: _Optional[int] = ..., registered: _Optional[bool] = ..., scheme: _Optional[str] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_workers: _Optional[int] = ..., active_workers: _Optional[int] = ..., finished_workers: _Optional[int] = ..., shard_index: _Optional[int] = ..., pushes_accepted: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., server_incarnation: _Optional[int] = ..., restored_version: _Optional[int] = ..., nonfinite_rejected: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., work: _Optional[_Union[WorkStatus, _Mapping]] = ..., load: _Optional[_Union[ShardLoad, _Mapping]] = ..., moved: _Optional[_Iterable[_Union[PieceOwner, _Mapping]]] = ..., applied_sequence: _Optional[int] = ..., wal: _Optional[_Union[WalStatus, _Mapping]] = ...) -> None: ...

class WalStatus(_message.Message):
    __slots__ = ("down", "outages", "down_seconds", "error", "folder", "generation", "refused_pushes", "unlogged", "replica")
    DOWN_FIELD_NUMBER: _ClassVar[int]
    OUTAGES_FIELD_NUMBER: _ClassVar[int]
    DOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    UNLOGGED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    down: bool
    outages: int
    down_seconds: float
    error: str
    folder: str
    generation: int
    refused_pushes: int
    unlogged: int
    replica: bool
    def __init__(self, down: _Optional[bool] = ..., outages: _Optional[int] = ..., down_seconds: _Optional[float] = ..., error: _Optional[str] = ..., folder: _Optional[str] = ..., generation: _Optional[int] = ..., refused_pushes: _Optional[int] = ..., unlogged: _Optional[int] = ..., replica: _Optional[bool] = ...) -> None: ...

class ShardLoad(_message.Message):
    __slots__ = ("pushes", "push_bytes", "pulls", "pull_bytes", "busy_seconds", "pieces", "pull_busy_seconds")
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    PULL_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pushes: int
    push_bytes: int
    pulls: int
    pull_bytes: int
    busy_seconds: float
    pieces: _containers.RepeatedCompositeFieldContainer[PieceLoad]
    pull_busy_seconds: float
    def __init__(self, pushes: _Optional[int] = ..., push_bytes: _Optional[int] = ..., pulls: _Optional[int] = ..., pull_bytes: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., pieces: _Optional[_Iterable[_Union[PieceLoad, _Mapping]]] = ..., pull_busy_seconds: _Optional[float] = ...) -> None: ...

class PieceLoad(_message.Message):
    __slots__ = ("key", "push_bytes", "pull_bytes", "applies")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    APPLIES_FIELD_NUMBER: _ClassVar[int]
    key: str
    push_bytes: int
    pull_bytes: int
    applies: int
    def __init__(self, key: _Optional[str] = ..., push_bytes: _Optional[int] = ..., pull_bytes: _Optional[int] = ..., applies: _Optional[int] = ...) -> None: ...

class PieceOwner(_message.Message):
    __slots__ = ("key", "shard")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    key: str
    shard: int
    def __init__(self, key: _Optional[str] = ..., shard: _Optional[int] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("header", "keys", "peer_shard", "commit", "move_id", "version", "receipt")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PEER_SHARD_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    keys: _containers.RepeatedScalarFieldContainer[str]
    peer_shard: int
    commit: bool
    move_id: str
    version: int
    receipt: bytes
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ..., peer_shard: _Optional[int] = ..., commit: _Optional[bool] = ..., move_id: _Optional[str] = ..., version: _Optional[int] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class ExportHeader(_message.Message):
    __slots__ = ("version", "tensors", "loads", "move_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    loads: _containers.RepeatedCompositeFieldContainer[PieceLoad]
    move_id: str
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[PieceLoad, _Mapping]]] = ..., move_id: _Optional[str] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ExportHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[ExportHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ImportHeader(_message.Message):
    __slots__ = ("header", "from_shard", "tensors", "loads", "move_id", "version")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    from_shard: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    loads: _containers.RepeatedCompositeFieldContainer[PieceLoad]
    move_id: str
    version: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., from_shard: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[PieceLoad, _Mapping]]] = ..., move_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ImportRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ImportHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[ImportHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("version", "pieces", "receipt")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    version: int
    pieces: int
    receipt: bytes
    def __init__(self, version: _Optional[int] = ..., pieces: _Optional[int] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("header", "claim")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    claim: bool
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., claim: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class MembershipResponse(_message.Message):
    __slots__ = ("epoch", "members", "evict_after_seconds", "max_workers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EVICT_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    members: _containers.RepeatedScalarFieldContainer[int]
    evict_after_seconds: float
    max_workers: int
    def __init__(self, epoch: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., evict_after_seconds: _Optional[float] = ..., max_workers: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("header", "name")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    name: str
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("version", "file", "sha256", "bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    file: str
    sha256: str
    bytes: int
    def __init__(self, version: _Optional[int] = ..., file: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("header", "confirm", "nonce", "cancel", "socket")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    confirm: int
    nonce: bytes
    cancel: bool
    socket: bool
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., confirm: _Optional[int] = ..., nonce: _Optional[bytes] = ..., cancel: _Optional[bool] = ..., socket: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("segment", "name", "size", "tensors", "pull_offsets", "push_offsets", "confirmed", "port", "token")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PULL_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PUSH_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    segment: int
    name: str
    size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    pull_offsets: _containers.RepeatedScalarFieldContainer[int]
    push_offsets: _containers.RepeatedScalarFieldContainer[int]
    confirmed: bool
    port: int
    token: bytes
    def __init__(self, segment: _Optional[int] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., pull_offsets: _Optional[_Iterable[int]] = ..., push_offsets: _Optional[_Iterable[int]] = ..., confirmed: _Optional[bool] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class ChannelError(_message.Message):
    __slots__ = ("code", "message", "refusal")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    refusal: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., refusal: _Optional[str] = ...) -> None: ...

class ReplicaHello(_message.Message):
    __slots__ = ("protocol_version", "run_id", "shard", "proof", "challenge")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    shard: int
    proof: bytes
    challenge: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., shard: _Optional[int] = ..., proof: _Optional[bytes] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class ReplicaFile(_message.Message):
    __slots__ = ("kind", "generation", "slot", "length", "fresh")
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    kind: ReplicaFileKind
    generation: int
    slot: int
    length: int
    fresh: bool
    def __init__(self, kind: _Optional[_Union[ReplicaFileKind, str]] = ..., generation: _Optional[int] = ..., slot: _Optional[int] = ..., length: _Optional[int] = ..., fresh: _Optional[bool] = ...) -> None: ...

class ReplicaWrite(_message.Message):
    __slots__ = ("generation", "offset", "length", "head")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    generation: int
    offset: int
    length: int
    head: int
    def __init__(self, generation: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., head: _Optional[int] = ...) -> None: ...

class ReplicaFetch(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("generation", "written", "proof")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    generation: int
    written: int
    proof: bytes
    def __init__(self, generation: _Optional[int] = ..., written: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RunFileChunk(_message.Message):
    __slots__ = ("header", "name", "write", "data", "found", "last")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    name: str
    write: RunFileWrite
    data: bytes
    found: bool
    last: bool
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., name: _Optional[str] = ..., write: _Optional[_Union[RunFileWrite, str]] = ..., data: _Optional[bytes] = ..., found: _Optional[bool] = ..., last: _Optional[bool] = ...) -> None: ...

class RunFileDone(_message.Message):
    __slots__ = ("written",)
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    written: int
    def __init__(self, written: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
