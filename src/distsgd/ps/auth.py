"""The server half of the run secret: a gRPC interceptor that refuses calls without it.

Every call must carry the run secret as metadata under ``METADATA_KEY``
(``distsgd.transport.security``). A call without it, or with a wrong one, is answered
``UNAUTHENTICATED`` by a stand-in handler: the service's own handler never runs, so a refused call
changes nothing and its request is not even parsed. The comparison is constant-time (it compares
SHA-256 digests with :func:`hmac.compare_digest`, so neither the content nor the length of the
secret leaks through timing).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from distsgd.transport.security import METADATA_KEY, check_secret

log = logging.getLogger(__name__)

UNAUTHENTICATED_MESSAGE = (
    "missing or wrong run secret; tasks of one run share DISTSGD_SECRET or DISTSGD_SECRET_FILE"
)

MAKE_HANDLER: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""What makes the handler of a kind of method: (requests streamed, responses streamed)."""


def _digest(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(raw).digest()


class SecretInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if its metadata holds the run secret under ``METADATA_KEY``.

    A missing key, a wrong value, or the key sent more than once is refused with
    UNAUTHENTICATED, for every kind of method (unary or streaming in either direction).
    """

    def __init__(self, secret: str) -> None:
        self._expected = _digest(check_secret(secret))
        self._lock = threading.Lock()
        self.refused = 0
        """Calls refused so far (for tests and logs)."""

    def authenticated(self, metadata: Sequence[Any] | None) -> bool:
        """Whether call ``metadata`` (key, value pairs) carries the secret, exactly once."""
        values = [item[1] for item in (metadata or ()) if item[0] == METADATA_KEY]
        if len(values) != 1:
            return False
        return hmac.compare_digest(_digest(values[0]), self._expected)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if self.authenticated(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        # Looking up the handler only tells which kind of stand-in to return; it runs nothing.
        handler = continuation(handler_call_details)
        return self._refusal(handler, handler_call_details.method)

    def _refuse(self, method: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.refused += 1
            count = self.refused
        if count == 1 or count % 1000 == 0:  # a flood must not flood the log too
            log.warning(
                "refused %s from %s: missing or wrong run secret (%d refused so far)",
                method,
                context.peer(),
                count,
            )
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def _refusal(self, handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind as ``handler`` that aborts without reading the request.

        Requests are left as raw bytes (no deserializer), so nothing a stranger sends is parsed.
        An unknown method is refused too, so strangers cannot probe which methods exist.
        """

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            self._refuse(method, context)

        streams = handler is not None and (handler.request_streaming, handler.response_streaming)
        return MAKE_HANDLER[streams or (False, False)](refuse)
