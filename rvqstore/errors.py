"""The exception hierarchy of rvqstore: every error the library raises on bad input derives from
:class:`RVQError`, so callers can catch one class."""

from __future__ import annotations


class RVQError(Exception):
    """Base class of every error rvqstore raises on purpose."""


class CodecConfigError(RVQError, ValueError):
    """An RVQCodec was asked for an unsupported configuration (head dim, bits, options)."""


class InputShapeError(RVQError, ValueError):
    """An array passed to the codec or cache has the wrong shape, dtype or size."""


class NonFiniteInputError(RVQError, ValueError):
    """The input contains NaN or Inf and the caller asked for a check."""


class ModelNotFoundError(RVQError, FileNotFoundError):
    """The bundled default model (or a model path given by the caller) is not installed."""


class UnsupportedModelError(RVQError, ValueError):
    """A model file uses an architecture or feature the loader does not handle."""


class InvalidScaleError(RVQError, ValueError):
    """A stored per-vector scale is not NaN and not in ``[0, RVQCodec.max_scale(dtype)]``: +Inf,
    negative, or so large that its vector could decode to values beyond the output dtype's range."""


class InvalidArgumentError(RVQError, ValueError, TypeError):
    """A public function got an argument of the wrong type or out of range (token ids, metadata, ...).
    Also a ValueError and a TypeError, the builtins such checks raised before."""


class ModelMismatchError(RVQError, ValueError):
    """A snapshot was made with a different model (architecture, geometry, weights or vocabulary), or
    nothing in it shows which model it was made with."""
