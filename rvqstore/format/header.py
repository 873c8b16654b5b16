"""The msgpack header of an ``.rvq`` file: strict decoding, canonical encoding, and schema validation.

Decoding refuses what msgpack-python lets through by default: duplicate map keys (it keeps the last),
ext types (it passes them through; the timestamp ext even bypasses ``ext_hook``), non-string map
keys, invalid UTF-8, nesting deeper than :data:`MAX_DEPTH`, and trailing bytes.

Validation turns the decoded map into typed, frozen records (:class:`Header`, :class:`SectionInfo`,
:class:`LayerInfo`) in the order the spec gives (section "Validation"), so a file with one fault
always raises the same error class.  No value read from a file is ever used to look up a class or
function.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from . import constants as C
from .errors import (
    FormatError,
    LayoutError,
    LimitExceededError,
    MalformedHeaderError,
    UnknownFeatureError,
)

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,256}\Z")


# ---- records --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SectionInfo:
    """One row of the section table, validated."""

    name: str
    layer: int
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int  # stored bytes in the file
    codec: str  # "raw", "zstd" or "rans"
    raw_length: int  # bytes after decoding = prod(shape) * itemsize
    checksum: int  # XXH3-64 of the stored bytes

    @property
    def known(self) -> bool:
        """True when this reader understands the section's kind (others are skipped).  The 1.1 kinds
        (``state.<k>``, ``c<j>.<kind>``) are interpreted only in files that list 'layer-kinds', the 1.2
        kinds (``keys.sink``, ``values.sink``, ``keys.mean``) only in files that list 'codec-state'."""
        return _kind_known(self.kind, True, True)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype the decoded bytes are viewed as (uint16 bit patterns for bfloat16)."""
        return np.dtype(C.DTYPES[self.dtype][0])

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "layer": self.layer, "kind": self.kind, "dtype": self.dtype,
            "shape": list(self.shape), "offset": self.offset, "length": self.length,
            "codec": self.codec, "raw_length": self.raw_length, "checksum": self.checksum,
        }


@dataclass(frozen=True)
class LayerInfo:
    """One entry of the ``layers`` list (or one child of a ``list`` layer), validated.

    ``sections`` maps a section kind to its section's name; for a child of a ``list`` layer the kinds
    are given without their ``c<j>.`` prefix.  Attention kinds (``rvq``, ``dense``, ``rvq-rotating``)
    fill ``batch`` .. ``value_dtype``; ``arrays`` and ``list`` layers leave them None.
    """

    index: int
    kind: str  # one of constants.LAYER_KINDS
    batch: int | None
    n_kv_heads: int | None
    head_dim: int | None
    n_tokens: int
    n_dense_tokens: int
    key_dtype: str | None
    value_dtype: str | None
    sections: Mapping[str, str] = field(default_factory=dict)  # kind -> section name
    value_head_dim: int | None = None  # == head_dim unless feature per-side-geometry says otherwise
    key_quantizer: int | None = None  # index into header.quantizers (feature quantizer-table)
    value_quantizer: int | None = None
    max_size: int | None = None  # rvq-rotating: capacity including the `keep` sink tokens
    keep: int | None = None  # rvq-rotating: sink tokens
    offset: int | None = None  # rvq-rotating: tokens the layer has seen (>= n_tokens)
    n_arrays: int | None = None  # arrays: slots
    children: tuple["LayerInfo", ...] = ()  # list: child layers
    parent: int | None = None  # a list child: index of its list layer (its sections carry that index)
    sink_tokens: int = 0  # rvq, feature codec-state: the first positions are kept in full precision
    center_keys: bool = False  # rvq, feature codec-state: coded keys carry a per-(batch, head) mean

    @property
    def n_sink(self) -> int:
        """Positions held by the ``keys.sink`` / ``values.sink`` sections: ``min(n_tokens, sink_tokens)``."""
        return min(self.n_tokens, self.sink_tokens)

    @property
    def n_quantized_tokens(self) -> int:
        """Coded positions ``Tq = n_tokens - n_dense_tokens - n_sink`` (spec 8.2: sink, coded, dense)."""
        return self.n_tokens - self.n_dense_tokens - self.n_sink

    @property
    def has_key_mean(self) -> bool:
        """A ``keys.mean`` section is present: ``center_keys`` and at least one coded position."""
        return self.center_keys and self.n_quantized_tokens > 0

    @property
    def is_attention(self) -> bool:
        return self.kind in C.ATTENTION_KINDS

    @property
    def is_coded(self) -> bool:
        """Keys and values are rvq codes (kinds ``rvq`` and ``rvq-rotating``)."""
        return self.kind in C.CODED_KINDS

    def side_head_dim(self, side: str) -> int | None:
        """Head dim of ``"keys"`` or ``"values"``."""
        return self.head_dim if side == "keys" else self.value_head_dim

    def side_dtype(self, side: str) -> str | None:
        return self.key_dtype if side == "keys" else self.value_dtype

    def state_sections(self) -> dict[int, str]:
        """arrays layers: slot -> section name (empty slots are absent)."""
        return {int(k[len(C.STATE_KIND_PREFIX):]): v for k, v in self.sections.items()
                if k.startswith(C.STATE_KIND_PREFIX)}

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "kind": self.kind, "n_tokens": self.n_tokens}
        if self.is_attention:
            d.update({"batch": self.batch, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                      "n_dense_tokens": self.n_dense_tokens, "key_dtype": self.key_dtype,
                      "value_dtype": self.value_dtype})
            if self.value_head_dim != self.head_dim:
                d["value_head_dim"] = self.value_head_dim
        for k in ("key_quantizer", "value_quantizer", "max_size", "keep", "offset", "n_arrays"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.sink_tokens:
            d["sink_tokens"] = self.sink_tokens
        if self.center_keys:
            d["center_keys"] = True
        if self.kind == C.LAYER_LIST:
            d["children"] = [c.to_dict() for c in self.children]
        return d


@dataclass(frozen=True)
class Header:
    """The validated header plus the preamble fields it was read with."""

    major: int
    minor: int
    flags: int
    required_features: tuple[str, ...]
    sections: tuple[SectionInfo, ...]
    layers: tuple[LayerInfo, ...]
    n_tokens: int
    quantizer: dict | None
    model: dict | None
    metadata: dict
    raw: dict  # the whole decoded map, unknown keys included
    header_offset: int
    header_length: int
    file_length: int
    quantizers: tuple[dict, ...] | None = None  # feature quantizer-table (then `quantizer` is None)

    def has_feature(self, name: str) -> bool:
        return name in self.required_features

    def quantizer_for(self, layer: "LayerInfo", side: str) -> dict | None:
        """The quantizer map that codes ``side`` ("keys"/"values") of a coded layer (None otherwise).

        Version 1.0 files (and 1.1 files without ``quantizer-table``) have one map for every layer;
        with ``quantizer-table`` each side names its entry of ``quantizers``.
        """
        if side not in ("keys", "values"):
            raise ValueError(f"side must be 'keys' or 'values', got {side!r}")
        if not layer.is_coded:
            return None
        if self.quantizers is None:
            return self.quantizer
        idx = layer.key_quantizer if side == "keys" else layer.value_quantizer
        return self.quantizers[idx]

    def all_layers(self):
        """Every layer map, list children included (after their list layer)."""
        for layer in self.layers:
            yield layer
            yield from layer.children


#: Signature of a content validator for the quantizer map(s): (quantizer, layers, sections, path), where
#: ``quantizer`` is the ``quantizer`` map, or with feature quantizer-table the tuple of ``quantizers``.
QuantizerCheck = Callable[["dict | tuple[dict, ...]", "tuple[LayerInfo, ...]", "tuple[SectionInfo, ...]",
                           str | None], None]


# ---- strict msgpack ---------------------------------------------------------------------------------
class _Refused(ValueError):
    pass


def _pairs_hook(pairs):
    out: dict = {}
    for k, v in pairs:
        if type(k) is not str:
            raise _Refused(f"map key {k!r} is not a string")
        if k in out:
            raise _Refused(f"duplicate map key {k!r}")
        out[k] = v
    return out


def _ext_hook(code, data):
    raise _Refused(f"msgpack ext type {code} is not allowed")


_ALLOWED = (type(None), bool, int, float, str, bytes)


def _check_tree(obj: Any, depth: int) -> None:
    """Only the allowed types, and maps/arrays nested at most MAX_DEPTH levels (the header is level 1)."""
    t = type(obj)
    if t is dict or t is list:
        if depth > C.MAX_DEPTH:
            raise _Refused(f"nesting deeper than {C.MAX_DEPTH} levels")
        for v in (obj.values() if t is dict else obj):
            _check_tree(v, depth + 1)
    elif t not in _ALLOWED:
        raise _Refused(f"value of msgpack type {t.__name__} is not allowed")


class _Budget:
    """Counts decoded msgpack objects through the unpacker's hooks and stops past MAX_HEADER_OBJECTS.

    The hooks run as each array / map is completed, so an oversized header is refused after at most
    MAX_HEADER_OBJECTS objects were built (bounded time and memory), not after all of them.
    """

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> None:
        self.n += k
        if self.n > C.MAX_HEADER_OBJECTS:
            raise _TooMany(f"header holds more than {C.MAX_HEADER_OBJECTS} msgpack objects")

    def pairs(self, pairs):
        self.add(2 * len(pairs))
        return _pairs_hook(pairs)

    def array(self, items):
        self.add(len(items))
        return items


class _TooMany(ValueError):
    pass


def decode_header(data: bytes, path: str | None = None) -> dict:
    """Decode header bytes strictly; anything off raises :class:`MalformedHeaderError`.

    Bounded while decoding (spec section 12): no array or map longer than MAX_CONTAINER_LENGTH, no
    string or binary longer than the header, at most MAX_HEADER_OBJECTS objects in all
    (:class:`LimitExceededError`).
    """
    budget = _Budget()
    n = len(data)
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=False,
            object_pairs_hook=budget.pairs, list_hook=budget.array, ext_hook=_ext_hook,
            max_str_len=n, max_bin_len=n, max_ext_len=n,
            max_array_len=C.MAX_CONTAINER_LENGTH, max_map_len=C.MAX_CONTAINER_LENGTH,
        )
        _check_tree(obj, 1)
    except _TooMany as e:
        raise LimitExceededError(path, f"header: {e}") from None
    except _Refused as e:
        raise MalformedHeaderError(path, f"header: {e}") from None
    except MemoryError:  # pragma: no cover - lengths are capped by the buffer size
        raise LimitExceededError(path, "header: msgpack declares more data than it holds") from None
    except ValueError as e:
        msg = str(e) or type(e).__name__
        if " exceeds max_" in msg:  # msgpack's own length limits
            raise LimitExceededError(path, f"header: an array or map is longer than "
                                           f"{C.MAX_CONTAINER_LENGTH} entries ({msg})") from None
        raise MalformedHeaderError(path, f"header is not valid msgpack ({type(e).__name__}: {msg})") from None
    except Exception as e:  # noqa: BLE001 - any failure to decode untrusted bytes is "malformed"
        msg = str(e) or type(e).__name__
        raise MalformedHeaderError(path, f"header is not valid msgpack ({type(e).__name__}: {msg})") from None
    if type(obj) is not dict:
        raise MalformedHeaderError(path, f"header is a msgpack {type(obj).__name__}, not a map")
    return obj


def canonicalize(obj: Any, where: str = "header") -> Any:
    """Return ``obj`` with map keys sorted (by code point = by UTF-8 bytes) and tuples as lists.

    numpy scalars become Python numbers and numpy arrays nested lists, so callers may pass them.
    Anything else that msgpack cannot carry, or a non-string map key, raises ``TypeError``.
    """
    if isinstance(obj, Mapping):
        out = {}
        for k in sorted(obj):
            if type(k) is not str:
                raise TypeError(f"{where}: map key {k!r} is not a str")
            out[k] = canonicalize(obj[k], f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [canonicalize(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return canonicalize(obj.tolist(), where)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return obj
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"{where}: a value of type {type(obj).__name__} cannot be stored in the header")


def encode_header(obj: Mapping) -> bytes:
    """Canonical msgpack bytes: sorted keys, str as str, bytes as bin, floats as float64, ints minimal."""
    return msgpack.packb(canonicalize(obj), use_bin_type=True, use_single_float=False, strict_types=False)


# ---- schema helpers -------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return type(v) is int


def _int(path, where: str, v: Any, lo: int, hi: int | None = None, *, limit_hi: bool = True) -> int:
    if not _is_int(v):
        raise MalformedHeaderError(path, f"{where} must be an integer, got {_tname(v)}")
    if v < lo:
        raise MalformedHeaderError(path, f"{where} = {v} is below {lo}")
    if hi is not None and v > hi:
        cls = LimitExceededError if limit_hi else MalformedHeaderError
        raise cls(path, f"{where} = {v} exceeds the limit {hi}")
    return v


def _str(path, where: str, v: Any, *, name: bool = False, max_len: int | None = C.MAX_NAME_LENGTH) -> str:
    if type(v) is not str:
        raise MalformedHeaderError(path, f"{where} must be a string, got {_tname(v)}")
    if max_len is not None and len(v.encode("utf-8")) > max_len:
        raise LimitExceededError(path, f"{where} is longer than {max_len} bytes")
    if name and not _NAME_RE.match(v):
        raise MalformedHeaderError(path, f"{where} = {v!r} is not a valid name ([A-Za-z0-9_.-], 1..256 bytes)")
    return v


def _tname(v: Any) -> str:
    return {dict: "map", list: "array", str: "string", bytes: "binary", type(None): "nil", bool: "boolean",
            int: "integer", float: "float"}.get(type(v), type(v).__name__)


def _map(path, where: str, v: Any) -> dict:
    if type(v) is not dict:
        raise MalformedHeaderError(path, f"{where} must be a map, got {_tname(v)}")
    return v


def _list(path, where: str, v: Any, max_len: int) -> list:
    if type(v) is not list:
        raise MalformedHeaderError(path, f"{where} must be an array, got {_tname(v)}")
    if len(v) > max_len:
        raise LimitExceededError(path, f"{where} has {len(v)} entries, the limit is {max_len}")
    return v


def _need(path, where: str, m: dict, key: str) -> Any:
    if key not in m:
        raise MalformedHeaderError(path, f"{where} lacks the required key {key!r}")
    return m[key]


def checked_product(dims, limit: int) -> int | None:
    """Product of non-negative ints, or None as soon as a partial product exceeds ``limit``.

    (A zero anywhere makes the product 0; the check still runs left to right like the spec says, so an
    implementation with fixed-width integers never overflows.)
    """
    if any(d == 0 for d in dims):
        return 0
    p = 1
    for d in dims:
        p *= d
        if p > limit:
            return None
    return p


# ---- validation ---------------------------------------------------------------------------------------------
def parse_header(
    obj: dict,
    *,
    path: str | None,
    major: int,
    minor: int,
    flags: int,
    header_offset: int,
    header_length: int,
    file_length: int,
    quantizer_check: QuantizerCheck | None = None,
) -> Header:
    """Validate a decoded header (steps H1..H8 of the spec, section 13) and return its typed form."""
    # H1: version echo
    fv = _need(path, "header", obj, "format_version")
    if type(fv) is not list or len(fv) != 2 or not all(_is_int(x) for x in fv):
        raise MalformedHeaderError(path, "header.format_version must be an array of two integers")
    if fv != [major, minor]:
        raise MalformedHeaderError(
            path, f"header.format_version {fv[0]}.{fv[1]} differs from the preamble's {major}.{minor}")

    # H2: required features (before anything whose meaning a feature could change)
    feats = _list(path, "header.required_features", _need(path, "header", obj, "required_features"),
                  C.MAX_FEATURES)
    seen: set[str] = set()
    for i, f in enumerate(feats):
        _str(path, f"header.required_features[{i}]", f, name=True)
        if f in seen:
            raise MalformedHeaderError(path, f"header.required_features lists {f!r} twice")
        seen.add(f)
    unknown = [f for f in feats if f not in C.KNOWN_FEATURES]
    if unknown:
        raise UnknownFeatureError(
            path, f"file requires feature(s) {', '.join(map(repr, unknown))} that this reader does not "
                  f"implement (known: {', '.join(sorted(C.KNOWN_FEATURES))})")

    # H3: section table entries
    rows = _list(path, "header.sections", _need(path, "header", obj, "sections"), C.MAX_SECTIONS)
    sections = tuple(_parse_section(path, i, r) for i, r in enumerate(rows))
    names: set[str] = set()
    for s in sections:
        if s.name in names:
            raise MalformedHeaderError(path, f"two sections are named {s.name!r}")
        names.add(s.name)

    # H4: layout
    check_layout(sections, header_offset, path)

    # H5: content keys
    n_tokens = _int(path, "header.n_tokens", _need(path, "header", obj, "n_tokens"), 0, C.MAX_TOKENS)
    layer_rows = _list(path, "header.layers", _need(path, "header", obj, "layers"), C.MAX_LAYERS)
    model = _need(path, "header", obj, "model")
    if model is not None:
        _map(path, "header.model", model)
        for k, v in model.items():
            _str(path, "header.model key", k)
            if type(v) is not str and not _is_int(v):
                raise MalformedHeaderError(path, f"header.model[{k!r}] must be a string or integer, got {_tname(v)}")
    metadata = _map(path, "header.metadata", _need(path, "header", obj, "metadata"))
    for k, v in metadata.items():
        _str(path, "header.metadata key", k)
        _str(path, f"header.metadata[{k!r}]", v, max_len=None)
    quantizer = _need(path, "header", obj, "quantizer")
    if quantizer is not None:
        _check_quantizer_head(path, "header.quantizer", quantizer)
    quantizers = _parse_quantizer_table(path, obj, feats, quantizer)

    # H6: layers and their sections
    layers = _parse_layers(path, layer_rows, sections, n_tokens, quantizer, quantizers, frozenset(feats))

    # H7: container-wide rules that join several keys
    if any(s.codec == C.CODEC_ZSTD for s in sections) and C.FEATURE_ZSTD not in feats:
        raise MalformedHeaderError(path, "a section uses codec 'zstd' but required_features lacks 'zstd'")
    if any(s.codec == C.CODEC_RANS for s in sections) and C.FEATURE_ENTROPY_CODED not in feats:
        raise MalformedHeaderError(path, "a section uses codec 'rans' but required_features lacks 'entropy-coded'")

    # H8: the quantizers' own rules
    table: "dict | tuple[dict, ...] | None" = quantizer if quantizers is None else quantizers
    if table and quantizer_check is not None:
        try:
            quantizer_check(table, layers, sections, path)
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - a content validator rejecting the map
            where = "header.quantizer" if quantizers is None else "header.quantizers"
            raise MalformedHeaderError(path, f"{where}: {e}") from None

    return Header(
        major=major, minor=minor, flags=flags, required_features=tuple(feats), sections=sections,
        layers=layers, n_tokens=n_tokens, quantizer=quantizer, model=model, metadata=metadata, raw=obj,
        header_offset=header_offset, header_length=header_length, file_length=file_length,
        quantizers=quantizers,
    )


def _parse_section(path, i: int, row: Any) -> SectionInfo:
    w = f"header.sections[{i}]"
    row = _map(path, w, row)
    name = _str(path, f"{w}.name", _need(path, w, row, "name"), name=True)
    w = f"section {name!r}"
    layer = _int(path, f"{w}: layer", _need(path, w, row, "layer"), -1, C.MAX_LAYERS - 1)
    kind = _str(path, f"{w}: kind", _need(path, w, row, "kind"), name=True)
    dtype = _str(path, f"{w}: dtype", _need(path, w, row, "dtype"))
    if dtype not in C.DTYPES:
        raise MalformedHeaderError(path, f"{w}: unknown dtype {dtype!r}")
    shape_v = _list(path, f"{w}: shape", _need(path, w, row, "shape"), C.MAX_NDIM)
    shape = tuple(_int(path, f"{w}: shape[{j}]", d, 0, C.MAX_DIM_SIZE) for j, d in enumerate(shape_v))
    offset = _int(path, f"{w}: offset", _need(path, w, row, "offset"), 0, C.MAX_FILE_LENGTH)
    length = _int(path, f"{w}: length", _need(path, w, row, "length"), 0, C.MAX_FILE_LENGTH)
    codec = _str(path, f"{w}: codec", _need(path, w, row, "codec"))
    if codec not in C.CODECS:
        raise MalformedHeaderError(path, f"{w}: unknown codec {codec!r} (known: raw, zstd, rans)")
    raw_length = _int(path, f"{w}: raw_length", _need(path, w, row, "raw_length"), 0, C.MAX_FILE_LENGTH)
    cks = _int(path, f"{w}: checksum", _need(path, w, row, "checksum"), 0, C.MAX_U64, limit_hi=False)

    n = checked_product(shape, C.MAX_ELEMENTS)
    if n is None:
        raise LimitExceededError(path, f"{w}: shape {list(shape)} has more than {C.MAX_ELEMENTS} elements")
    expect = n * C.DTYPES[dtype][1]
    if raw_length != expect:
        raise MalformedHeaderError(
            path, f"{w}: raw_length {raw_length} does not match shape {list(shape)} of {dtype} ({expect} bytes)")
    if codec == C.CODEC_RAW:
        if length != raw_length:
            raise MalformedHeaderError(path, f"{w}: raw section stores {length} bytes but declares {raw_length}")
    else:
        if codec == C.CODEC_RANS and dtype != "uint32":
            raise MalformedHeaderError(path, f"{w}: a rans section must have dtype uint32 (packed codes), not {dtype}")
        if length == 0:
            raise MalformedHeaderError(path, f"{w}: a {codec} section cannot be empty")
        if raw_length > C.MAX_ZSTD_RATIO * length:
            raise LimitExceededError(
                path, f"{w}: {codec} section claims {raw_length} bytes from {length} stored bytes "
                      f"(more than {C.MAX_ZSTD_RATIO}x)")
    return SectionInfo(name, layer, kind, dtype, shape, offset, length, codec, raw_length, cks)


def check_layout(sections, header_offset: int, path=None) -> None:
    """Sections in table order must tile [64, header_offset) with only alignment padding between."""
    prev_end = C.PREAMBLE_SIZE
    prev_off = C.PREAMBLE_SIZE
    prev_name = "the preamble"
    for s in sections:
        w = f"section {s.name!r} at offset {s.offset}"
        if s.offset < prev_off:
            raise LayoutError(path, f"{w}: sections are not sorted by offset (comes after {prev_name} at {prev_off})")
        if s.offset < prev_end:
            raise LayoutError(path, f"{w}: overlaps {prev_name} (which ends at {prev_end})")
        if s.offset % C.ALIGNMENT:
            raise LayoutError(path, f"{w}: not aligned to {C.ALIGNMENT} bytes")
        want = C.align_up(prev_end)
        if s.offset != want:
            raise LayoutError(path, f"{w}: hole of {s.offset - want} bytes after {prev_name} (expected offset {want})")
        end = s.offset + s.length
        if end > header_offset:
            raise LayoutError(path, f"{w}: its {s.length} bytes run into the header at {header_offset}")
        prev_end, prev_off, prev_name = end, s.offset, f"section {s.name!r}"
    want = C.align_up(prev_end)
    if header_offset != want:
        raise LayoutError(
            path, f"header at offset {header_offset}: hole of {header_offset - want} bytes after {prev_name} "
                  f"(expected offset {want})")


def _check_quantizer_head(path, where: str, q: Any) -> None:
    _map(path, where, q)
    _str(path, f"{where}.name", _need(path, where, q, "name"))
    _int(path, f"{where}.version", _need(path, where, q, "version"), 0, C.MAX_U64, limit_hi=False)


def _parse_quantizer_table(path, obj: dict, feats, quantizer) -> tuple[dict, ...] | None:
    """Feature quantizer-table: ``quantizers`` is an array of quantizer maps and ``quantizer`` is nil."""
    if C.FEATURE_QUANTIZER_TABLE not in feats:
        if "quantizers" in obj:
            raise MalformedHeaderError(path, "header.quantizers needs the required feature 'quantizer-table'")
        return None
    if quantizer is not None:
        raise MalformedHeaderError(path, "header.quantizer must be nil when the file uses 'quantizer-table'")
    rows = _list(path, "header.quantizers", _need(path, "header", obj, "quantizers"), C.MAX_QUANTIZERS)
    for i, q in enumerate(rows):
        _check_quantizer_head(path, f"header.quantizers[{i}]", q)
    return tuple(rows)


_STATE_RE = re.compile(r"state\.(0|[1-9][0-9]{0,5})\Z")
_CHILD_RE = re.compile(r"c(0|[1-9][0-9]{0,5})\.(.+)\Z")


def _base_kind_known(kind: str, layer_kinds: bool, codec_state: bool = False) -> bool:
    return (kind in C.KNOWN_KINDS or (layer_kinds and _STATE_RE.match(kind) is not None)
            or (codec_state and kind in C.CODEC_STATE_KINDS))


def _kind_known(kind: str, layer_kinds: bool, codec_state: bool = False) -> bool:
    """Known section kinds; ``state.<k>`` and ``c<j>.<kind>`` only with feature layer-kinds, the sink and
    mean kinds only with feature codec-state (without it they are unknown kinds, skipped)."""
    if _base_kind_known(kind, layer_kinds, codec_state):
        return True
    m = _CHILD_RE.match(kind) if layer_kinds else None
    return m is not None and _base_kind_known(m.group(2), True, codec_state)


def _parse_layers(path, rows: list, sections, n_tokens: int, quantizer, quantizers,
                  feats: frozenset) -> tuple[LayerInfo, ...]:
    n_layers = len(rows)
    layer_kinds = C.FEATURE_LAYER_KINDS in feats
    codec_state = C.FEATURE_CODEC_STATE in feats
    by_layer: dict[int, dict[str, SectionInfo]] = {}
    tokens_sec = None
    for s in sections:
        if s.layer >= n_layers:
            raise MalformedHeaderError(path, f"section {s.name!r}: layer {s.layer} but the file has {n_layers} layers")
        if not _kind_known(s.kind, layer_kinds, codec_state):
            continue  # unknown kinds are skipped (they obey the container rules only)
        if s.kind == C.KIND_TOKENS:
            if s.layer != -1:
                raise MalformedHeaderError(path, f"section {s.name!r}: a tokens section must have layer -1")
            if tokens_sec is not None:
                raise MalformedHeaderError(path, f"sections {tokens_sec.name!r} and {s.name!r} are both tokens")
            if s.dtype != "int32" or s.shape != (n_tokens,):
                raise MalformedHeaderError(
                    path, f"section {s.name!r}: tokens must be int32 of shape [{n_tokens}] (n_tokens), "
                          f"got {s.dtype} {list(s.shape)}")
            tokens_sec = s
            continue
        if s.layer == -1:
            raise MalformedHeaderError(path, f"section {s.name!r}: kind {s.kind!r} needs a layer index >= 0")
        d = by_layer.setdefault(s.layer, {})
        if s.kind in d:
            raise MalformedHeaderError(path, f"layer {s.layer} has two {s.kind!r} sections ({d[s.kind].name!r}, {s.name!r})")
        d[s.kind] = s

    ctx = _LayerContext(path, feats, quantizer, quantizers)
    layers = []
    for i, row in enumerate(rows):
        w = f"header.layers[{i}]"
        layer = ctx.layer_map(w, row, i, allow_list=True)
        have = by_layer.get(i, {})
        if layer.kind == C.LAYER_LIST:
            children = []
            per_child: dict[int, dict[str, SectionInfo]] = {}
            for k, s in have.items():
                m = _CHILD_RE.match(k)
                if m is None:
                    raise MalformedHeaderError(path, f"section {s.name!r}: kind {k!r} does not belong to list layer {i} "
                                                     f"(its sections are c<j>.<kind>)")
                j = int(m.group(1))
                if j >= len(layer.children):
                    raise MalformedHeaderError(path, f"section {s.name!r}: layer {i} has {len(layer.children)} children, "
                                                     f"no child {j}")
                per_child.setdefault(j, {})[m.group(2)] = s
            for j, child in enumerate(layer.children):
                children.append(ctx.with_sections(f"{w}.children[{j}]", child, per_child.get(j, {}), i))
            layer = _replace(layer, children=tuple(children),
                             sections={k: s.name for k, s in have.items()})
        else:
            layer = ctx.with_sections(w, layer, have, None)
        layers.append(layer)
    return tuple(layers)


#: Layer map keys of feature codec-state (spec 7.3), on rvq layers only.
_STATE_KEYS = ("sink_tokens", "center_keys")


def _why_not(kind: str, layer: LayerInfo) -> str:
    """Why a known section kind is not allowed on this layer, for the error message."""
    if kind in C.DENSE_KINDS:
        return " (it has no dense tokens)"
    if kind in C.SINK_KINDS and layer.kind == "rvq":
        return f" (it holds no sink positions: sink_tokens {layer.sink_tokens}, n_tokens {layer.n_tokens})"
    if kind == C.MEAN_KIND and layer.kind == "rvq":
        return (" (center_keys is false)" if not layer.center_keys else " (it holds no coded positions)")
    return ""


def _replace(layer: LayerInfo, **kw) -> LayerInfo:
    import dataclasses

    return dataclasses.replace(layer, **kw)


class _LayerContext:
    """Validation of one layer map and of its sections (spec sections 7.3 and 8)."""

    def __init__(self, path, feats: frozenset, quantizer, quantizers):
        self.path, self.feats, self.quantizer, self.quantizers = path, feats, quantizer, quantizers

    def _needs(self, w: str, row: dict, key: str, feature: str) -> None:
        if key in row and feature not in self.feats:
            raise MalformedHeaderError(self.path, f"{w}.{key} needs the required feature {feature!r}")

    def layer_map(self, w: str, row: Any, position: int, *, allow_list: bool) -> LayerInfo:
        path = self.path
        row = _map(path, w, row)
        idx = _int(path, f"{w}.index", _need(path, w, row, "index"), 0)
        if idx != position:
            raise MalformedHeaderError(path, f"{w}.index is {idx}, must equal its position {position}")
        kind = _str(path, f"{w}.kind", _need(path, w, row, "kind"))
        if kind not in C.LAYER_KINDS or (kind == C.LAYER_LIST and not allow_list):
            allowed = [k for k in C.LAYER_KINDS if allow_list or k != C.LAYER_LIST]
            raise MalformedHeaderError(path, f"{w}.kind {kind!r} is not one of {', '.join(allowed)}")
        if kind not in C.LAYER_KINDS_1_0 and C.FEATURE_LAYER_KINDS not in self.feats:
            raise MalformedHeaderError(path, f"{w}.kind {kind!r} needs the required feature 'layer-kinds'")
        for key in ("value_head_dim",):
            self._needs(w, row, key, C.FEATURE_PER_SIDE_GEOMETRY)
        for key in ("key_quantizer", "value_quantizer"):
            self._needs(w, row, key, C.FEATURE_QUANTIZER_TABLE)
        for key in _STATE_KEYS:
            self._needs(w, row, key, C.FEATURE_CODEC_STATE)
            if key in row and kind != "rvq":  # a rotating window keeps its own `keep` sinks, uncentered
                raise MalformedHeaderError(path, f"{w}.{key}: codec state is defined for rvq layers only, "
                                                 f"not {kind!r}")
        if kind == C.LAYER_ARRAYS:
            nt = _int(path, f"{w}.n_tokens", _need(path, w, row, "n_tokens"), 0, C.MAX_TOKENS)
            n_arrays = _int(path, f"{w}.n_arrays", _need(path, w, row, "n_arrays"), 1, C.MAX_ARRAYS_SLOTS)
            return LayerInfo(position, kind, None, None, None, nt, 0, None, None, n_arrays=n_arrays)
        if kind == C.LAYER_LIST:
            nt = _int(path, f"{w}.n_tokens", _need(path, w, row, "n_tokens"), 0, C.MAX_TOKENS)
            rows = _list(path, f"{w}.children", _need(path, w, row, "children"), C.MAX_CHILDREN)
            children = tuple(self.layer_map(f"{w}.children[{j}]", r, j, allow_list=False) for j, r in enumerate(rows))
            return LayerInfo(position, kind, None, None, None, nt, 0, None, None, children=children)

        batch = _int(path, f"{w}.batch", _need(path, w, row, "batch"), 1, C.MAX_BATCH)
        heads = _int(path, f"{w}.n_kv_heads", _need(path, w, row, "n_kv_heads"), 1, C.MAX_HEADS)
        dim = _int(path, f"{w}.head_dim", _need(path, w, row, "head_dim"), 1, C.MAX_HEAD_DIM)
        nt = _int(path, f"{w}.n_tokens", _need(path, w, row, "n_tokens"), 0, C.MAX_TOKENS)
        vdim = dim
        if "value_head_dim" in row:
            vdim = _int(path, f"{w}.value_head_dim", row["value_head_dim"], 1, C.MAX_HEAD_DIM)
        nd = _int(path, f"{w}.n_dense_tokens", _need(path, w, row, "n_dense_tokens"), 0, C.MAX_TOKENS)
        kd = _str(path, f"{w}.key_dtype", _need(path, w, row, "key_dtype"))
        vd = _str(path, f"{w}.value_dtype", _need(path, w, row, "value_dtype"))
        for nm, dt in (("key_dtype", kd), ("value_dtype", vd)):
            if dt not in C.FLOAT_DTYPES:
                raise MalformedHeaderError(path, f"{w}.{nm} {dt!r} is not one of {', '.join(C.FLOAT_DTYPES)}")
        if nd > nt:
            raise MalformedHeaderError(path, f"{w}: n_dense_tokens {nd} exceeds n_tokens {nt}")
        if kind == "dense" and nd != nt:
            raise MalformedHeaderError(path, f"{w}: a dense layer keeps all its tokens dense (n_dense_tokens must be {nt})")
        extra: dict[str, Any] = {}
        if kind == C.LAYER_RVQ_ROTATING:
            ms = _int(path, f"{w}.max_size", _need(path, w, row, "max_size"), 1, C.MAX_TOKENS)
            keep = _int(path, f"{w}.keep", _need(path, w, row, "keep"), 0, ms, limit_hi=False)
            off = _int(path, f"{w}.offset", _need(path, w, row, "offset"), nt, C.MAX_OFFSET)
            if nt > ms:
                raise MalformedHeaderError(path, f"{w}: n_tokens {nt} exceeds max_size {ms}")
            extra.update(max_size=ms, keep=keep, offset=off)
        if kind in C.CODED_KINDS:
            if self.quantizers is None:
                if self.quantizer is None:
                    raise MalformedHeaderError(path, f"{w} is an {kind} layer but header.quantizer is nil")
            else:
                for key in ("key_quantizer", "value_quantizer"):
                    extra[key] = _int(path, f"{w}.{key}", _need(path, w, row, key), 0,
                                      len(self.quantizers) - 1, limit_hi=False)
        if kind == "rvq":
            extra.update(self._codec_state(w, row, nt, nd))
        return LayerInfo(position, kind, batch, heads, dim, nt, nd, kd, vd, value_head_dim=vdim, **extra)

    def _codec_state(self, w: str, row: dict, nt: int, nd: int) -> dict[str, Any]:
        """``sink_tokens`` and ``center_keys`` of an rvq layer (feature codec-state; defaults 0, false)."""
        path = self.path
        sink = _int(path, f"{w}.sink_tokens", row.get("sink_tokens", 0), 0, C.MAX_TOKENS)
        center = row.get("center_keys", False)
        if type(center) is not bool:
            raise MalformedHeaderError(path, f"{w}.center_keys must be a boolean, got {_tname(center)}")
        n_sink = min(nt, sink)
        if nd > nt - n_sink:
            raise MalformedHeaderError(path, f"{w}: n_dense_tokens {nd} and {n_sink} sink positions exceed "
                                             f"n_tokens {nt}")
        return {"sink_tokens": sink, "center_keys": center}

    def with_sections(self, w: str, layer: LayerInfo, have: dict[str, SectionInfo], parent: int | None) -> LayerInfo:
        """Check a (non-list) layer's sections against its kind; return it with its section names."""
        path = self.path
        label = f"layer {layer.index}" if parent is None else f"layer {parent} child {layer.index}"
        if layer.kind == C.LAYER_ARRAYS:
            for k, s in have.items():
                m = _STATE_RE.match(k)
                if m is None:
                    raise MalformedHeaderError(path, f"section {s.name!r}: kind {k!r} does not belong to arrays {label}")
                if int(m.group(1)) >= layer.n_arrays:
                    raise MalformedHeaderError(path, f"section {s.name!r}: slot {m.group(1)} but {label} has "
                                                     f"{layer.n_arrays} slots")
            return _replace(layer, sections={k: s.name for k, s in have.items()}, parent=parent)

        batch, heads, kd, vd = layer.batch, layer.n_kv_heads, layer.key_dtype, layer.value_dtype
        nd, nq = layer.n_dense_tokens, layer.n_quantized_tokens
        coded = layer.is_coded
        expect: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {}
        if coded:
            for side in ("keys", "values"):
                expect[f"{side}.codes1"] = (("uint32",), None)
                expect[f"{side}.scales"] = (("bfloat16",), (batch, heads, nq))
        optional = {"keys.codes2", "values.codes2"} if coded else set()
        if nd > 0 or layer.kind == "dense":
            expect["keys.dense"] = ((kd,), (batch, heads, nd, layer.head_dim))
            expect["values.dense"] = ((vd,), (batch, heads, nd, layer.value_head_dim))
        if layer.n_sink:  # codec-state (spec 8.2): both sink sections iff S > 0, the mean iff centering codes
            expect["keys.sink"] = (C.STATE_DTYPES, (batch, heads, layer.n_sink, layer.head_dim))
            expect["values.sink"] = (C.STATE_DTYPES, (batch, heads, layer.n_sink, layer.value_head_dim))
        if layer.has_key_mean:
            expect[C.MEAN_KIND] = (C.STATE_DTYPES, (batch, heads, layer.head_dim))
        for k in expect:
            if k not in have:
                raise MalformedHeaderError(path, f"{label} ({layer.kind}) lacks its {k!r} section")
        for k, s in have.items():
            if k in optional:
                allowed: tuple[tuple[str, ...], tuple[int, ...] | None] = (("uint32",), None)
            elif k in expect:
                allowed = expect[k]
            else:
                raise MalformedHeaderError(path, f"section {s.name!r}: kind {k!r} does not belong to {layer.kind} {label}"
                                           + _why_not(k, layer))
            dtypes, shape = allowed
            if s.dtype not in dtypes:
                raise MalformedHeaderError(path, f"section {s.name!r}: dtype {s.dtype} should be {' or '.join(dtypes)}")
            if shape is None:  # codes: (B, H, Tq, words), words >= 1
                if len(s.shape) != 4 or s.shape[:3] != (batch, heads, nq) or s.shape[3] < 1:
                    raise MalformedHeaderError(
                        path, f"section {s.name!r}: shape {list(s.shape)} should be [{batch}, {heads}, {nq}, words>=1]")
            elif s.shape != shape:
                raise MalformedHeaderError(path, f"section {s.name!r}: shape {list(s.shape)} should be {list(shape)}")
        # one quantizer for both sides: both have stage 2 or neither (a table entry per side decides in H8)
        if self.quantizers is None and ("keys.codes2" in have) != ("values.codes2" in have):
            raise MalformedHeaderError(path, f"{label}: keys and values must both have codes2 or neither")
        return _replace(layer, sections={k: s.name for k, s in have.items()}, parent=parent)
