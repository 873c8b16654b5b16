"""rvqstore: LLM KV caches kept compressed with TurboQuant-RVQ codes, in memory and on disk.

Main entry points::

    RVQCodec(dim, bits=(4, 2))                 # encode/decode vectors of one head (DEFAULT_BITS)
    make_prompt_cache(model, bits=(4, 2))       # mlx-lm compatible caches holding packed codes
    save_prompt_cache(path, cache, tokens=..., model=...)
    load_prompt_cache(path, model=...)          # bit-exact reload, refuses another model's file
    resume(path, prompt_tokens, model)          # reuse the longest cached prefix
    open(path)                                  # lazy reader of a .rvq file (header only until asked)
    PrefixStore(url, model=...)                 # shared prefix store: put(tokens, cache), longest_prefix(tokens)
"""

from .cache import RVQKVCache
from .rotating_cache import RVQRotatingKVCache
from .codec import DEFAULT_BITS, EncodedVectors, RVQCodec
from .compat import UnsupportedCacheError
from .errors import (
    CodecConfigError,
    InputShapeError,
    InvalidArgumentError,
    InvalidScaleError,
    NonFiniteInputError,
    RVQError,
    UnsupportedModelError,
)
from .format import FormatError
from .format import open_rvq as open  # noqa: A001 - rvqstore.open(path) mirrors the builtin's role
from .packing import pack_codes, unpack_codes
from .prompt_cache import (
    ModelMismatchError,
    NoTokensError,
    ResumeResult,
    convert_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    resume,
    save_prompt_cache,
)
from .store import PrefixStore  # a shared store of cached prefixes (local directory or S3)

__version__ = "0.1.0"

__all__ = [
    "RVQCodec", "EncodedVectors", "DEFAULT_BITS", "pack_codes", "unpack_codes",
    "RVQKVCache", "RVQRotatingKVCache", "make_prompt_cache", "convert_prompt_cache",
    "save_prompt_cache", "load_prompt_cache", "resume", "ResumeResult", "open",
    "RVQError", "CodecConfigError", "InputShapeError", "NonFiniteInputError", "FormatError",
    "ModelMismatchError", "NoTokensError", "UnsupportedCacheError", "PrefixStore",
    "InvalidArgumentError", "InvalidScaleError", "UnsupportedModelError",
]
