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
