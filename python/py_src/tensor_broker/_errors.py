"""The exceptions tensor_broker raises.

Every error of a cluster call is a :class:`TensorBrokerError`; the subclasses are what a caller
can act on. Bad input that never reaches the cluster (a non-contiguous array, an unsupported
dtype) raises the built-in ``ValueError`` or ``TypeError`` instead.
"""

from __future__ import annotations


class TensorBrokerError(Exception):
    """Base class of every error a tensor_broker call raises about the cluster."""


class NotFound(TensorBrokerError, LookupError):
    """No such tensor, or no node keeps that version any more."""


class Unauthorized(TensorBrokerError, PermissionError):
    """The cluster refused this node: wrong secret, or a read-only credential asked to write."""


class Timeout(TensorBrokerError, TimeoutError):
    """A call did not finish within its time limit (``timeout=`` or the node's own)."""


class Unavailable(TensorBrokerError, ConnectionError):
    """No broker or holder could be reached, or the client (or cluster) is closed. Retry later."""


class InvalidArgument(TensorBrokerError, ValueError):
    """A name, ticket, secret or tensor the cluster cannot take (also a ``ValueError``)."""


__all__ = [
    "TensorBrokerError",
    "NotFound",
    "Unauthorized",
    "Timeout",
    "Unavailable",
    "InvalidArgument",
]


class Overloaded(TensorBrokerError):
    """Every server of a function was over its concurrency and queue limits: retry later, or
    serve it on more nodes. Nothing was sent to a server beyond the call's head."""


class ServerLost(TensorBrokerError, ConnectionError):
    """The server of a call was lost mid-call (killed, link gone). ``maybe_ran`` says whether
    it had accepted the call (it may have run): calls that never started, and calls of
    functions declared idempotent, are retried on another server before this is raised."""

    def __init__(self, message: str, maybe_ran: bool = True) -> None:
        super().__init__(message)
        self.maybe_ran = maybe_ran


class RemoteError(TensorBrokerError):
    """A function's handler raised on its server. ``remote_type`` is the exception's type
    (``ValueError``, ``mymodule.MyError``), ``remote_traceback`` its formatted traceback and
    ``server`` the node that ran it. When the remote type is a builtin exception, the raised
    error is also an instance of that builtin: ``except ValueError`` catches it."""

    remote_type: str
    remote_traceback: str
    server: str
    function: str

    def __str__(self) -> str:
        return f"{self.function} on {self.server} raised {self.remote_type}: {self.args[0]}"


_REMOTE_CLASSES: dict[type, type] = {}


def _remote_error(
    function: str, server: str, remote_type: str, message: str, traceback: str
) -> RemoteError:
    """The RemoteError a handler's exception comes back as (used by the native module)."""
    import builtins

    base = getattr(builtins, remote_type, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(
        base, TensorBrokerError
    ):
        base = None
    cls: type = RemoteError
    if base is not None:
        cls = _REMOTE_CLASSES.get(base) or _REMOTE_CLASSES.setdefault(
            base, type(f"RemoteError[{remote_type}]", (RemoteError, base), {"__module__": __name__})
        )
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.function = function
    err.server = server
    err.remote_type = remote_type
    err.remote_traceback = traceback
    return err


__all__ += ["Overloaded", "ServerLost", "RemoteError"]
