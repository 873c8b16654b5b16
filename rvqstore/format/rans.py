"""Section codec ``rans`` (feature ``entropy-coded``, spec section 9.3): packed code words, entropy-coded.

A ``rans`` section stores the codes of a ``uint32`` code section (``dim`` codes of ``bits`` bits per
vector, packed as in spec section 10) as an interleaved rANS stream and decodes to exactly the raw
bytes the ``raw`` codec would store.  Layout (little-endian)::

    0   4  magic  b"rANS"
    4   1  version (1)
    5   1  bits        symbol width b, 1..4
    6   1  prob_bits   P, 12..15 (frequencies sum to 2^P)
    7   1  contexts    0: one table; 1: one table per coordinate (dim tables)
    8   4  dim         codes per vector, 1..65536
    12  4  lanes       interleaved coders, 1..65536 (a multiple of dim when contexts = 1)
    16  8  n_symbols   codes in the section (vectors * dim)
    24  8  n_words     16-bit words in the stream
    32     freq        T * 2^b u16 (T = 1 or dim), each table summing to 2^P
    ..     states      lanes u32: the final encoder state of each lane, in [2^16, 2^32)
    ..     words       n_words u16

Symbol ``i`` (code ``i mod dim`` of vector ``i // dim``) is coded by lane ``i mod lanes`` at step
``i // lanes``; the decoder runs the steps in order, each one a few numpy operations over all lanes
(the shape a GPU decoder takes, one thread per lane).  State x in [2^16, 2^32), 16-bit renormalization
words: with P <= 16 one renormalization per symbol always suffices, so a step is branch-free.  At
step t the lanes that renormalize read consecutive words of the stream in ascending lane order.

Why 16-bit words rather than bytes: one renormalization per symbol (not a loop of up to two), half as
many read positions, and the stream stays aligned for 16-bit loads on a GPU.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import MalformedSectionError

MAGIC = b"rANS"
VERSION = 1
FIXED = struct.Struct("<4sBBBBIIQQ")
assert FIXED.size == 32
STATE_LOW = 1 << 16  # L: lower end of a lane's state; every lane starts (encoder) and ends (decoder) there
WORD_BITS = 16
PROB_BITS_RANGE = (12, 15)
MAX_LANES = 1 << 16
MAX_DIM = 1 << 16
#: Writer defaults (informative): precision and the number of decode steps a section aims for.
WRITER_PROB_BITS = 12
#: The numpy decoder pays ~10 us per step whatever the lane count, a lane ~2-4 bytes of state. Sections
#: of at least LARGE_SECTION symbols aim at 1024 steps (SmolLM2 files of 1024 tokens, `best`: load
#: 2.4-3.4x faster than at 2048 steps for 0.17-0.39 % more bytes, tools/results/ecsq-files.md); smaller
#: ones decode in milliseconds anyway, and there the extra lanes' states cost more than they save.
TARGET_STEPS = 1024
SMALL_SECTION_STEPS = 2048
LARGE_SECTION = 1 << 17
#: The decoder's slot -> symbol table has T * 2^P entries (8 bytes each); it is built only up to this
#: many (8 MiB; real sections: dim 64 x 2^12 = 2 MiB), else the decoder searches the cumulative tables,
#: so a hostile header cannot make it large.
LUT_MAX_ENTRIES = 1 << 20
#: Decoded symbols held before they are packed into the output (bounds the decoder's working memory).
SYMBOL_BLOCK = 1 << 20


def codes_per_word(bits: int) -> int:
    return 32 // bits


def words_per_vector(dim: int, bits: int) -> int:
    return -(-dim // codes_per_word(bits))


# ---- packing (spec section 10) -------------------------------------------------------------------
def unpack(words: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """uint32 words ``(n * W,)`` -> codes ``(n, dim)`` uint8."""
    p, w = codes_per_word(bits), words_per_vector(dim, bits)
    v = words.reshape(-1, w, 1) >> (np.arange(p, dtype=np.uint32) * bits)
    return (v & ((1 << bits) - 1)).astype(np.uint8).reshape(-1, w * p)[:, :dim]


def pack(codes: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """codes ``(n, dim)`` -> uint32 words ``(n * W,)``; unused bits zero."""
    p, w = codes_per_word(bits), words_per_vector(dim, bits)
    full = np.zeros((codes.shape[0], w * p), dtype=np.uint32)
    full[:, :dim] = codes
    shifted = full.reshape(-1, w, p) << (np.arange(p, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(shifted, axis=2).reshape(-1)


# ---- frequency tables ----------------------------------------------------------------------------
def quantize_frequencies(counts: np.ndarray, prob_bits: int) -> np.ndarray:
    """Counts of one context -> integer frequencies summing to 2^P (the spec's deterministic rule).

    ``f[s] = 0`` where the count is 0, else ``max(1, floor(count * 2^P / N))``; the remainder
    ``r = 2^P - sum(f)`` goes to the symbol of the largest count (lowest symbol on ties) when ``r > 0``;
    when ``r < 0`` the symbol of the largest ``f`` (lowest on ties) gives back ``min(-r, f - 1)``, repeated.
    A context that codes nothing (N = 0) gets all of 2^P on symbol 0.
    """
    m = 1 << prob_bits
    counts = [int(c) for c in counts]
    n = sum(counts)
    f = [0] * len(counts)
    if n == 0:
        f[0] = m
        return np.array(f, dtype=np.int64)
    for s, c in enumerate(counts):
        if c:
            f[s] = max(1, c * m // n)
    r = m - sum(f)
    if r > 0:
        f[counts.index(max(counts))] += r
    while r < 0:
        s = f.index(max(f))
        d = min(-r, f[s] - 1)
        f[s] -= d
        r += d
    return np.array(f, dtype=np.int64)


def choose_lanes(n_symbols: int, dim: int, contexts: int) -> int:
    """Writer rule (informative): about TARGET_STEPS steps (SMALL_SECTION_STEPS below LARGE_SECTION
    symbols), a multiple of dim when contexts = 1."""
    unit = dim if contexts else 1
    steps = TARGET_STEPS if n_symbols >= LARGE_SECTION else SMALL_SECTION_STEPS
    lanes = max(1, n_symbols // steps // unit) * unit
    return min(lanes, (MAX_LANES // unit) * unit)


# ---- encoder ----------------------------------------------------------------------------------
def _codes(raw: bytes | memoryview, bits: int, dim: int) -> np.ndarray | None:
    """Codes ``(vectors, dim)`` of a code section's raw bytes, or None if they are not canonical packed
    codes of this geometry (unused bits set, or a length that is not whole vectors)."""
    if len(raw) % 4:
        return None
    words = np.frombuffer(raw, dtype="<u4")
    w = words_per_vector(dim, bits)
    if words.size == 0 or words.size % w:
        return None
    codes = unpack(words, bits, dim)
    if not np.array_equal(pack(codes, bits, dim), words):  # unused bits set: rans would not round-trip
        return None
    return codes


def _histogram(codes: np.ndarray, bits: int, contexts: int) -> np.ndarray:
    """Symbol counts ``(T, 2^bits)``: one row per coordinate (``contexts = 1``) or one row."""
    k = 1 << bits
    if contexts:
        dim = codes.shape[1]
        return np.bincount((np.arange(dim) * k + codes).reshape(-1), minlength=dim * k).reshape(dim, k)
    return np.bincount(codes.reshape(-1), minlength=k)[None]


def estimated_size(codes: np.ndarray, bits: int, contexts: int, prob_bits: int = WRITER_PROB_BITS) -> int:
    """Bytes of :func:`encode`'s output estimated from the histogram, without coding: the ideal code
    length under the quantized frequencies, plus the header, the tables and the lanes' states (within
    ~0.1 % of the real size on model caches; the lanes' final flushes are what it approximates)."""
    hist = _histogram(codes, bits, contexts)
    freq = np.stack([quantize_frequencies(h, prob_bits) for h in hist])
    with np.errstate(divide="ignore"):
        cost = np.where(hist > 0, prob_bits - np.log2(np.maximum(freq, 1)), 0.0)
    lanes = choose_lanes(codes.size, codes.shape[1], contexts)
    words = max(0, int(np.ceil(float(np.sum(hist * cost)) / WORD_BITS)) - lanes)  # each final state holds ~16 bits
    return FIXED.size + freq.size * 2 + lanes * 4 + 2 * words + lanes  # ~1 byte per lane of flush slack


def encode(raw: bytes | memoryview, bits: int, dim: int, *, contexts: int = 1,
           prob_bits: int = WRITER_PROB_BITS, lanes: int | None = None) -> bytes | None:
    """The ``rans`` stored bytes of a code section's raw bytes, or None if they are not canonical
    packed codes of this geometry (unused bits set, or a length that is not whole vectors)."""
    codes = _codes(raw, bits, dim)
    return None if codes is None else _encode_codes(codes, bits, contexts, prob_bits, lanes)


def encode_smallest(raw: bytes | memoryview, bits: int, dim: int) -> bytes | None:
    """The shorter of :func:`encode` with one table per coordinate and with one table (the writer's
    choice). The estimates pick the form; both are coded only when they are within 1 % of each other,
    so a section is coded about once instead of twice (identical output to coding both)."""
    codes = _codes(raw, bits, dim)
    if codes is None:
        return None
    est = {c: estimated_size(codes, bits, c) for c in (1, 0)}
    first, second = sorted(est, key=lambda c: (est[c], -c))
    stored = _encode_codes(codes, bits, first, WRITER_PROB_BITS, None)
    if est[second] <= 1.01 * est[first]:
        other = _encode_codes(codes, bits, second, WRITER_PROB_BITS, None)
        if len(other) < len(stored) or (len(other) == len(stored) and second == 1):
            stored = other
    return stored


def _encode_codes(codes: np.ndarray, bits: int, contexts: int, prob_bits: int, lanes: int | None) -> bytes:
    dim = codes.shape[1]
    n = codes.size
    T = dim if contexts else 1
    freq = np.stack([quantize_frequencies(h, prob_bits) for h in _histogram(codes, bits, contexts)])  # (T, k)
    cum = np.concatenate([np.zeros((T, 1), np.int64), np.cumsum(freq, axis=1)], axis=1)
    if lanes is None:
        lanes = choose_lanes(n, dim, contexts)
    steps = -(-n // lanes)
    # every symbol's frequency, cumulative frequency and renormalization bound, gathered once (the loop
    # below then slices: its cost is numpy's per-call overhead, ~steps x a few calls)
    sym = codes.reshape(-1).astype(np.int64)
    ctx = (np.arange(n) % dim) if contexts else np.zeros(n, np.int64)
    f_all = freq[ctx, sym].astype(np.uint64)
    c_all = cum[ctx, sym].astype(np.uint64)
    bound_all = f_all << np.uint64(32 - prob_bits)
    x = np.full(lanes, STATE_LOW, dtype=np.uint64)
    chunks: list[np.ndarray] = [None] * steps  # type: ignore[list-item]
    low16, word_bits, p = np.uint64(0xFFFF), np.uint64(WORD_BITS), np.uint64(prob_bits)
    for t in range(steps - 1, -1, -1):
        lo = t * lanes
        a = min(lanes, n - lo)
        f = f_all[lo: lo + a]
        xa = x[:a]
        emit = xa >= bound_all[lo: lo + a]
        chunks[t] = (xa[emit] & low16).astype("<u2")
        xa[emit] >>= word_bits
        q, r = np.divmod(xa, f)
        x[:a] = (q << p) + r + c_all[lo: lo + a]
    stream = np.concatenate(chunks) if chunks else np.zeros(0, "<u2")
    head = FIXED.pack(MAGIC, VERSION, bits, prob_bits, 1 if contexts else 0, dim, lanes, n, stream.size)
    return b"".join([head, freq.astype("<u2").tobytes(), x.astype("<u4").tobytes(), stream.tobytes()])


# ---- decoder ----------------------------------------------------------------------------------
def decode(stored: bytes | memoryview, raw_length: int, where: str = "section", path=None) -> np.ndarray:
    """The raw bytes (packed uint32 code words) of a ``rans`` section; MalformedSectionError for any
    malformed input.  Allocates ``raw_length`` bytes for the output and working memory bounded by
    the stored length and constants (SYMBOL_BLOCK symbols, LUT_MAX_ENTRIES table entries); runs
    exactly ceil(n_symbols / lanes) steps."""

    def bad(msg: str) -> MalformedSectionError:
        return MalformedSectionError(path, f"{where}: rans: {msg}")

    buf = memoryview(stored).cast("B")
    if len(buf) < FIXED.size:
        raise bad(f"{len(buf)} stored bytes, shorter than the {FIXED.size}-byte header")
    magic, ver, bits, pbits, contexts, dim, lanes, n, n_words = FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise bad("bad magic (not a rans stream)")
    if ver != VERSION:
        raise bad(f"version {ver} (this reader implements {VERSION})")
    if not 1 <= bits <= 4:
        raise bad(f"symbol width {bits} (must be 1..4)")
    if not PROB_BITS_RANGE[0] <= pbits <= PROB_BITS_RANGE[1]:
        raise bad(f"probability precision {pbits} bits (must be {PROB_BITS_RANGE[0]}..{PROB_BITS_RANGE[1]})")
    if contexts not in (0, 1):
        raise bad(f"contexts {contexts} (must be 0 or 1)")
    if not 1 <= dim <= MAX_DIM:
        raise bad(f"dim {dim} (must be 1..{MAX_DIM})")
    if not 1 <= lanes <= MAX_LANES or (contexts and lanes % dim):
        raise bad(f"{lanes} lanes (must be 1..{MAX_LANES}" + (f", a multiple of dim {dim})" if contexts else ")"))
    w = words_per_vector(dim, bits)
    if raw_length % (4 * w):
        raise bad(f"raw_length {raw_length} is not a whole number of {w}-word vectors")
    if n != raw_length // (4 * w) * dim:
        raise bad(f"{n} symbols, but raw_length {raw_length} holds {raw_length // (4 * w) * dim}")
    T, k = (dim if contexts else 1), 1 << bits
    need = FIXED.size + 2 * T * k + 4 * lanes + 2 * n_words
    if need != len(buf):
        raise bad(f"header implies {need} stored bytes, the section has {len(buf)}")
    pos = FIXED.size
    freq = np.frombuffer(buf, "<u2", T * k, pos).astype(np.int64).reshape(T, k)
    pos += 2 * T * k
    if np.any(freq.sum(axis=1) != (1 << pbits)):
        raise bad(f"a frequency table does not sum to 2^{pbits}")
    x = np.frombuffer(buf, "<u4", lanes, pos).astype(np.uint64)
    pos += 4 * lanes
    if np.any(x < STATE_LOW):
        raise bad("a lane state is below 2^16")
    stream = np.frombuffer(buf, "<u2", n_words, pos).astype(np.uint64)

    # One lookup per lane and step: slot -> symbol | freq << 8 | (slot - cum) << 24 (slot - cum < 2^P).
    cum = np.concatenate([np.zeros((T, 1), np.int64), np.cumsum(freq, axis=1)], axis=1)
    lane_ctx = (np.arange(lanes, dtype=np.int64) % dim) if contexts else np.zeros(lanes, np.int64)
    M = 1 << pbits
    if T * M <= LUT_MAX_ENTRIES:
        sym_of_slot = np.repeat(np.tile(np.arange(k, dtype=np.int64), T), freq.reshape(-1)).reshape(T, M)
        slots = np.arange(M, dtype=np.int64)
        ctx_rows = np.arange(T)[:, None]
        lut = (sym_of_slot | (freq[ctx_rows, sym_of_slot] << 8)
               | ((slots[None, :] - cum[ctx_rows, sym_of_slot]) << 24)).reshape(-1)
        search = None
    else:
        lut, search = None, cum[lane_ctx, 1:k]  # (lanes, k - 1) upper edges
    base = lane_ctx * M
    mask, P = M - 1, pbits
    x = x.astype(np.int64)
    stream = stream.astype(np.int64)

    out = np.zeros(raw_length // 4, dtype="<u4")
    out_pos = 0  # words written
    block = np.empty(min(n, max(SYMBOL_BLOCK, lanes)), dtype=np.uint8)
    filled = 0
    carry = np.zeros(0, np.uint8)
    read = 0
    steps = -(-n // lanes)

    def flush(final: bool) -> None:
        nonlocal out_pos, carry, filled
        syms = np.concatenate([carry, block[:filled]]) if carry.size else block[:filled]
        nv = syms.size // dim
        if nv:
            words = pack(syms[: nv * dim].reshape(nv, dim), bits, dim)
            out[out_pos: out_pos + words.size] = words
            out_pos += words.size
        carry = syms[nv * dim:].copy()
        filled = 0

    for t in range(steps):
        a = min(lanes, n - t * lanes)
        xa = x[:a]
        slot = xa & mask
        if lut is not None:
            e = lut[base[:a] + slot]
        else:
            s = (slot[:, None] >= search[:a]).sum(axis=1)
            c = lane_ctx[:a] * k + s
            e = s | (freq.reshape(-1)[c] << 8) | ((slot - cum[:, :k].reshape(-1)[c]) << 24)
        xa = ((e >> 8) & 0xFFFF) * (xa >> P) + (e >> 24)
        low = xa < STATE_LOW
        m = int(np.count_nonzero(low))
        if m:
            if read + m > n_words:
                raise bad(f"the stream ends early (step {t} of {steps})")
            xa[low] = (xa[low] << WORD_BITS) | stream[read: read + m]
            read += m
        x[:a] = xa
        if filled + a > block.size:
            flush(False)
        block[filled: filled + a] = e
        filled += a
    flush(True)
    if read != n_words:
        raise bad(f"{n_words - read} words of the stream are left over")
    if np.any(x != STATE_LOW):
        raise bad("a lane does not end in the initial state (corrupt stream)")
    if out_pos != out.size or carry.size:  # pragma: no cover - follows from the symbol count check
        raise bad("decoded symbols do not fill the section")
    return out.view(np.uint8)
