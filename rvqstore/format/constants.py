"""Fixed numbers of the ``.rvq`` container, version 1 (see ``format_spec/rvq-v1.md``).

Every constant here is normative: the spec quotes the same values, and a test checks that the two
agree.
"""

from __future__ import annotations

import struct

# ---- preamble -------------------------------------------------------------------------------------
#: PNG-style signature: a high-bit byte (catches 7-bit transfers), "RVQ", CR LF (catches line-ending
#: conversion either way), Ctrl-Z (stops `type` on DOS), LF (catches LF -> CRLF).
MAGIC = b"\x89RVQ\r\n\x1a\n"

FORMAT_MAJOR = 1
#: The newest minor version this implementation writes.  Readers accept any minor of major 1.  A file
#: is written as the oldest version that holds the data: 1.0 without any later feature, 1.1 with a
#: feature of revision 1.1 only, 1.2 with ``codec-state``.
FORMAT_MINOR = 2
FORMAT_MINOR_BASE = 0
FORMAT_MINOR_1_1 = 1

#: ``<`` little-endian: magic 8s, major H, minor H, flags I, header_offset Q, header_length Q,
#: header_checksum Q, file_length Q, reserved Q, preamble_checksum Q.
PREAMBLE_STRUCT = struct.Struct("<8sHHIQQQQQQ")
PREAMBLE_SIZE = 64
#: The preamble checksum covers bytes [0, PREAMBLE_CHECKED).
PREAMBLE_CHECKED = 56
assert PREAMBLE_STRUCT.size == PREAMBLE_SIZE

#: Flag bits defined by this version of the format (none).  Any other bit set means "this file needs
#: a feature you do not have": readers reject it.
KNOWN_FLAGS = 0x00000000

#: Alignment of every region after the preamble (sections and header).
ALIGNMENT = 64

# ---- header ----------------------------------------------------------------------------------------
#: Names a reader may find in ``required_features`` and still read the file.
FEATURE_ZSTD = "zstd"
FEATURE_PER_SIDE_GEOMETRY = "per-side-geometry"
FEATURE_QUANTIZER_TABLE = "quantizer-table"
FEATURE_LAYER_KINDS = "layer-kinds"
#: Section codec "rans" (entropy-coded code sections, spec 9.3, ``rans.py``).
FEATURE_ENTROPY_CODED = "entropy-coded"
#: The features of revision 1.1: a file listing any of them is written as version [1, 1].
FEATURES_1_1 = (FEATURE_PER_SIDE_GEOMETRY, FEATURE_QUANTIZER_TABLE, FEATURE_LAYER_KINDS, FEATURE_ENTROPY_CODED)
#: Sink tokens kept exact and a per-head key mean (layer keys ``sink_tokens`` / ``center_keys``, section
#: kinds ``keys.sink`` / ``values.sink`` / ``keys.mean``, spec 8.2): a file listing it is version [1, 2].
FEATURE_CODEC_STATE = "codec-state"
FEATURES_1_2 = (FEATURE_CODEC_STATE,)
KNOWN_FEATURES = frozenset({FEATURE_ZSTD, *FEATURES_1_1, *FEATURES_1_2})

CODEC_RAW = "raw"
CODEC_ZSTD = "zstd"
#: Entropy-coded packed codes (feature "entropy-coded"): only on uint32 sections, spec 9.3.
CODEC_RANS = "rans"
CODECS = (CODEC_RAW, CODEC_ZSTD, CODEC_RANS)

#: Element types: name -> (numpy dtype string used to view the bytes, item size).  "bfloat16" is
#: viewed as its raw little-endian uint16 bit patterns (numpy has no bfloat16).
DTYPES: dict[str, tuple[str, int]] = {
    "uint8": ("|u1", 1),
    "int8": ("|i1", 1),
    "uint16": ("<u2", 2),
    "int16": ("<i2", 2),
    "uint32": ("<u4", 4),
    "int32": ("<i4", 4),
    "uint64": ("<u8", 8),
    "int64": ("<i8", 8),
    "float16": ("<f2", 2),
    "bfloat16": ("<u2", 2),
    "float32": ("<f4", 4),
    "float64": ("<f8", 8),
}
#: dtypes a KV layer's original keys/values (and its dense sections) may have.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")

LAYER_KINDS_1_0 = ("rvq", "dense")
#: Kinds added by feature "layer-kinds": a sliding-window ring, recurrent state arrays, a list of caches.
LAYER_RVQ_ROTATING = "rvq-rotating"
LAYER_ARRAYS = "arrays"
LAYER_LIST = "list"
LAYER_KINDS = LAYER_KINDS_1_0 + (LAYER_RVQ_ROTATING, LAYER_ARRAYS, LAYER_LIST)
#: Kinds whose layer map carries batch / n_kv_heads / head_dim / dtypes and keys/values sections.
ATTENTION_KINDS = ("rvq", "dense", LAYER_RVQ_ROTATING)
#: Kinds whose keys and values are rvq-coded (codes + scales sections, a quantizer per side).
CODED_KINDS = ("rvq", LAYER_RVQ_ROTATING)

KIND_TOKENS = "tokens"
CODE_KINDS = ("keys.codes1", "keys.codes2", "values.codes1", "values.codes2")
SCALE_KINDS = ("keys.scales", "values.scales")
DENSE_KINDS = ("keys.dense", "values.dense")
#: Section kinds this version understands.  Sections of any other kind are skipped by readers (they
#: still obey every container rule: layout, limits, checksum).
KNOWN_KINDS = (KIND_TOKENS,) + CODE_KINDS + SCALE_KINDS + DENSE_KINDS
#: With feature "codec-state", on ``rvq`` layers: the first ``S`` positions in full precision and the
#: per-(batch, head) key mean added back to every coded key (spec 8.2).
SINK_KINDS = ("keys.sink", "values.sink")
MEAN_KIND = "keys.mean"
CODEC_STATE_KINDS = SINK_KINDS + (MEAN_KIND,)
#: dtypes of the codec-state sections (each array its own: 16-bit, or float32 where 16 bits overflow).
STATE_DTYPES = FLOAT_DTYPES
#: With feature "layer-kinds": ``state.<k>`` (slot k of an arrays layer) and ``c<j>.<kind>`` (a kind of
#: child j of a list layer).  Decimal, no leading zeros.
STATE_KIND_PREFIX = "state."

# ---- limits ----------------------------------------------------------------------------------------
MAX_HEADER_LENGTH = 16 * 1024 * 1024
MAX_SECTIONS = 65536
MAX_LAYERS = 4096
MAX_FEATURES = 64
MAX_NAME_LENGTH = 256  # bytes of UTF-8, for section names, feature names, metadata/model keys
MAX_NDIM = 8
MAX_DIM_SIZE = 1 << 40  # any one entry of a shape
MAX_ELEMENTS = 1 << 40  # product of a shape
MAX_BATCH = 1 << 16
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_TOKENS = (1 << 31) - 1
MAX_DEPTH = 32  # nesting of maps/lists in the header
#: msgpack objects in the header: every array element and every map key and value counts (the
#: header map itself does not).  65536 sections with 8-dim shapes and 4096 layers need ~2.0M.
MAX_HEADER_OBJECTS = 1 << 21
#: Longest array / map (entries) anywhere in the header: the section table is the longest there is.
MAX_CONTAINER_LENGTH = MAX_SECTIONS
MAX_ARRAYS_SLOTS = 64  # n_arrays of an arrays layer
MAX_CHILDREN = 64  # children of a list layer
MAX_QUANTIZERS = MAX_LAYERS * 2  # entries of the quantizers table
MAX_OFFSET = (1 << 63) - 1  # a rotating layer's absolute token count
#: A zstd (or rans) section's raw_length may be at most this many times its stored length.  Bounds
#: what a reader allocates to MAX_ZSTD_RATIO x the file size.
MAX_ZSTD_RATIO = 32
#: Decoding rvq codes amplifies at most this much per stored byte of codes + scales (1-bit codes
#: decoded to float32: 32 bits out per bit in).  With zstd on top, a load allocates at most
#: MAX_ZSTD_RATIO * MAX_DECODE_RATIO = 1024x the file size; loaders bound it with a limit instead.
MAX_DECODE_RATIO = 32
#: Default limit on the bytes a load decodes (keys + values + state + tokens); raise it per call or
#: with the environment variable RVQSTORE_MAX_DECODED_BYTES.
DEFAULT_MAX_DECODED_BYTES = 16 << 30
MAX_U64 = (1 << 64) - 1
MAX_FILE_LENGTH = (1 << 63) - 1

#: zstd frame magic number (RFC 8878), little-endian on disk.
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def align_up(n: int, a: int = ALIGNMENT) -> int:
    return -(-n // a) * a
