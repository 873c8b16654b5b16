"""Typed errors of the prefix store (all are :class:`rvqstore.errors.RVQError`)."""

from __future__ import annotations

from ..errors import RVQError


class StoreError(RVQError):
    """Base class of the prefix store's errors."""


class StoreURLError(StoreError, ValueError):
    """A store URL that names no supported backend, or one that is malformed."""


class BackendUnavailableError(StoreError, ImportError):
    """The backend's client library is not installed (the message names the pip extra)."""


class CorruptBlockError(StoreError):
    """A stored block failed a check (checksum, key, parent, tokens, geometry) when read."""


class StoreConfigError(StoreError, ValueError):
    """A bad argument to the store (block size, budget, codec settings, a cache of another store)."""
