"""rvqstore: LLM KV caches kept compressed with TurboQuant-RVQ codes, in memory and on disk."""

from .codec import EncodedVectors, RVQCodec
from .errors import CodecConfigError, InputShapeError, NonFiniteInputError, RVQError
from .packing import pack_codes, unpack_codes

__version__ = "0.1.0"

__all__ = [
    "RVQCodec",
    "EncodedVectors",
    "pack_codes",
    "unpack_codes",
    "RVQError",
    "CodecConfigError",
    "InputShapeError",
    "NonFiniteInputError",
]
