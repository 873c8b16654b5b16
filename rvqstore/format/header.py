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
    codec: str  # "raw" or "zstd"
    raw_length: int  # bytes after decoding = prod(shape) * itemsize
    checksum: int  # XXH3-64 of the stored bytes

    @property
    def known(self) -> bool:
        """True when this reader understands the section's kind (others are skipped)."""
        return self.kind in C.KNOWN_KINDS

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
    """One entry of the ``layers`` list, validated, with the names of its sections by kind."""

    index: int
    kind: str  # "rvq" or "dense"
    batch: int
    n_kv_heads: int
    head_dim: int
    n_tokens: int
    n_dense_tokens: int
    key_dtype: str
    value_dtype: str
    sections: Mapping[str, str] = field(default_factory=dict)  # kind -> section name

    @property
    def n_quantized_tokens(self) -> int:
        return self.n_tokens - self.n_dense_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "kind": self.kind, "batch": self.batch, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "n_tokens": self.n_tokens, "n_dense_tokens": self.n_dense_tokens,
            "key_dtype": self.key_dtype, "value_dtype": self.value_dtype,
        }


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


#: Signature of a content validator for the ``quantizer`` map: (quantizer, layers, sections, path).
QuantizerCheck = Callable[[dict, "tuple[LayerInfo, ...]", "tuple[SectionInfo, ...]", str | None], None]


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


def decode_header(data: bytes, path: str | None = None) -> dict:
    """Decode header bytes strictly; anything off raises :class:`MalformedHeaderError`."""
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=False,
            object_pairs_hook=_pairs_hook, ext_hook=_ext_hook,
        )
        _check_tree(obj, 1)
    except _Refused as e:
        raise MalformedHeaderError(path, f"header: {e}") from None
    except MemoryError:  # pragma: no cover - lengths are capped by the buffer size
        raise LimitExceededError(path, "header: msgpack declares more data than it holds") from None
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
        _map(path, "header.quantizer", quantizer)
        _str(path, "header.quantizer.name", _need(path, "header.quantizer", quantizer, "name"))
        _int(path, "header.quantizer.version", _need(path, "header.quantizer", quantizer, "version"), 0,
             C.MAX_U64, limit_hi=False)

    # H6: layers and their sections
    layers = _parse_layers(path, layer_rows, sections, n_tokens, quantizer)

    # H7: container-wide rules that join several keys
    if any(s.codec == C.CODEC_ZSTD for s in sections) and "zstd" not in feats:
        raise MalformedHeaderError(path, "a section uses codec 'zstd' but required_features lacks 'zstd'")

    # H8: the quantizer's own rules
    if quantizer is not None and quantizer_check is not None:
        try:
            quantizer_check(quantizer, layers, sections, path)
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - a content validator rejecting the map
            raise MalformedHeaderError(path, f"header.quantizer: {e}") from None

    return Header(
        major=major, minor=minor, flags=flags, required_features=tuple(feats), sections=sections,
        layers=layers, n_tokens=n_tokens, quantizer=quantizer, model=model, metadata=metadata, raw=obj,
        header_offset=header_offset, header_length=header_length, file_length=file_length,
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
        raise MalformedHeaderError(path, f"{w}: unknown codec {codec!r} (known: raw, zstd)")
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
        if length == 0:
            raise MalformedHeaderError(path, f"{w}: a zstd section cannot be empty")
        if raw_length > C.MAX_ZSTD_RATIO * length:
            raise LimitExceededError(
                path, f"{w}: zstd section claims {raw_length} bytes from {length} stored bytes "
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


def _parse_layers(path, rows: list, sections, n_tokens: int, quantizer) -> tuple[LayerInfo, ...]:
    n_layers = len(rows)
    by_layer: dict[int, dict[str, SectionInfo]] = {}
    tokens_sec = None
    for s in sections:
        if s.layer >= n_layers:
            raise MalformedHeaderError(path, f"section {s.name!r}: layer {s.layer} but the file has {n_layers} layers")
        if not s.known:
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

    layers = []
    for i, row in enumerate(rows):
        w = f"header.layers[{i}]"
        row = _map(path, w, row)
        idx = _int(path, f"{w}.index", _need(path, w, row, "index"), 0)
        if idx != i:
            raise MalformedHeaderError(path, f"{w}.index is {idx}, must equal its position {i}")
        kind = _str(path, f"{w}.kind", _need(path, w, row, "kind"))
        if kind not in C.LAYER_KINDS:
            raise MalformedHeaderError(path, f"{w}.kind {kind!r} is not one of {', '.join(C.LAYER_KINDS)}")
        batch = _int(path, f"{w}.batch", _need(path, w, row, "batch"), 1, C.MAX_BATCH)
        heads = _int(path, f"{w}.n_kv_heads", _need(path, w, row, "n_kv_heads"), 1, C.MAX_HEADS)
        dim = _int(path, f"{w}.head_dim", _need(path, w, row, "head_dim"), 1, C.MAX_HEAD_DIM)
        nt = _int(path, f"{w}.n_tokens", _need(path, w, row, "n_tokens"), 0, C.MAX_TOKENS)
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
        if kind == "rvq" and quantizer is None:
            raise MalformedHeaderError(path, f"{w} is an rvq layer but header.quantizer is nil")

        have = by_layer.get(i, {})
        nq = nt - nd
        expect: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {}
        if kind == "rvq":
            for side in ("keys", "values"):
                expect[f"{side}.codes1"] = (("uint32",), None)
                expect[f"{side}.scales"] = (("bfloat16",), (batch, heads, nq))
        optional = {"keys.codes2", "values.codes2"} if kind == "rvq" else set()
        if nd > 0 or kind == "dense":
            expect["keys.dense"] = ((kd,), (batch, heads, nd, dim))
            expect["values.dense"] = ((vd,), (batch, heads, nd, dim))
        for k in expect:
            if k not in have:
                raise MalformedHeaderError(path, f"layer {i} ({kind}) lacks its {k!r} section")
        for k, s in have.items():
            if k in optional:
                allowed: tuple[tuple[str, ...], tuple[int, ...] | None] = (("uint32",), None)
            elif k in expect:
                allowed = expect[k]
            else:
                raise MalformedHeaderError(path, f"section {s.name!r}: kind {k!r} does not belong to {kind} layer {i}"
                                           + (" (it has no dense tokens)" if k in C.DENSE_KINDS else ""))
            dtypes, shape = allowed
            if s.dtype not in dtypes:
                raise MalformedHeaderError(path, f"section {s.name!r}: dtype {s.dtype} should be {' or '.join(dtypes)}")
            if shape is None:  # codes: (B, H, Tq, words), words >= 1
                if len(s.shape) != 4 or s.shape[:3] != (batch, heads, nq) or s.shape[3] < 1:
                    raise MalformedHeaderError(
                        path, f"section {s.name!r}: shape {list(s.shape)} should be [{batch}, {heads}, {nq}, words>=1]")
            elif s.shape != shape:
                raise MalformedHeaderError(path, f"section {s.name!r}: shape {list(s.shape)} should be {list(shape)}")
        if ("keys.codes2" in have) != ("values.codes2" in have):
            raise MalformedHeaderError(path, f"layer {i}: keys and values must both have codes2 or neither")
        layers.append(LayerInfo(i, kind, batch, heads, dim, nt, nd, kd, vd,
                                sections={k: s.name for k, s in have.items()}))
    return tuple(layers)
