"""How the parameter-server service answers a refused or failed call: ``abort`` with a status
code (and a ``Refusal`` as trailing metadata), INTERNAL for an exception no check foresaw
(``guarded``), and ``clip`` for a peer's strings in status messages."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar, cast

import grpc

from distsgd.ps.channel import Aborted as _Aborted
from distsgd.ps.wal import NotLogged
from distsgd.transport.errors import ERROR_KEY, Refusal

# the service's logger: its INTERNAL reports read as the service's
log = logging.getLogger("distsgd.ps.service")

F = TypeVar("F", bound=Callable[..., Any])


def clip(text: str, limit: int = 80) -> str:
    """``text`` for a status message: a peer's string may be megabytes long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    refusal: Refusal | None = None,
) -> NoReturn:
    """Answer the call with ``code`` and ``message`` (and ``refusal`` as trailing metadata)."""
    if refusal is not None:
        context.set_trailing_metadata(((ERROR_KEY, refusal.value),))
    with contextlib.suppress(Exception):  # abort sets the status, then raises a bare Exception
        context.abort(code, message)
    raise _Aborted(code.name)


def internal(method: str, exc: Exception, context: grpc.ServicerContext) -> NoReturn:
    log.error("%s failed with an unexpected error (a bug)", method, exc_info=exc)
    abort(
        context,
        grpc.StatusCode.INTERNAL,
        f"{method}: internal error in the parameter server ({type(exc).__name__}); "
        "see the server's log",
    )


def not_logged(exc: NotLogged, context: grpc.ServicerContext) -> NoReturn:
    """A push the write-ahead log could not take in time: UNAVAILABLE ``not-logged`` (nothing
    of it was applied; the client sends it again)."""
    abort(context, grpc.StatusCode.UNAVAILABLE, str(exc), Refusal.NOT_LOGGED)


def guarded(method: F) -> F:
    """The RPC ``method``, answering INTERNAL (and logging the traceback) for any exception
    that is not an abort of its own (or a push the write-ahead log could not take:
    :func:`not_logged`); a call the client already gave up is left alone."""
    name = method.__name__

    @contextlib.contextmanager
    def answering(context: grpc.ServicerContext) -> Iterator[None]:
        try:
            yield
        except _Aborted:
            raise
        except NotLogged as exc:
            not_logged(exc, context)
        except Exception as exc:
            if not context.is_active():  # the client went away: nothing to answer
                raise
            internal(name, exc, context)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with answering(context):
                yield from method(self, request, context)

        return cast(F, stream)

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with answering(context):
            return method(self, request, context)

    return cast(F, unary)
