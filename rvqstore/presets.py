"""Cache settings named by what they promise on disk, chosen from docs/quality.md.

Keys are the sensitive side of the cache: quantizing every key with RVQ 2+1 costs SmolLM2-135M
about seven times the next-token KL that the same code on every value does (tools/probe_sensitivity.py).
Each preset gives keys at least the bits of values, under the budget its name promises: bits per
coordinate of the saved ``.rvq`` file (default ``compress="auto"``, everything counted: header,
token ids, norms, codes). Figures are measured on the bundled model (mean token KL against the
float32 cache, pooled over three texts of different kinds, and on a fourth kept aside): see
docs/quality.md. On the command line: ``rvqstore cache-prompt --preset balanced [--profile P]``.

    caches = rvqstore.presets.make_cache(model, "balanced")
    caches = rvqstore.presets.make_cache(model, "balanced", profile="smollm2.json")  # bits per layer too

With a sensitivity profile of the model (``tools/probe_sensitivity.py``), bits are also allocated
per layer (:mod:`rvqstore.bit_allocation`) at the preset's fixed-width target, measured to land
within the on-disk budget; snapshots carry per-layer, per-side settings in their quantizer table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .bit_allocation import Slot, allocate, load_profile
from .cache import RVQKVCache
from .codec import RVQCodec
from .errors import CodecConfigError


@dataclass(frozen=True)
class Preset:
    """``budget``: bits per coordinate ON DISK the preset promises (a ``.rvq`` saved with the default
    ``compress="auto"``, everything counted; measured on SmolLM2 at 512 cached tokens, longer files are
    smaller per coordinate). Files are smaller than the in-memory width (zstd), so both settings spend
    more bits in memory than the budget: ``key_bits``/``value_bits`` without a profile, and
    ``alloc_target``, the fixed-width average the per-layer allocation is made at, found by saving
    real files (``tools/eval_quality.py --fit``) rather than assumed."""

    name: str
    key_bits: tuple[int, int]
    value_bits: tuple[int, int]
    budget: float
    alloc_target: float
    promise: str

    def memory_bits(self, head_dim: int = 64) -> float:
        """Bits per coordinate in memory (codes, per-vector norms, packing), keys and values averaged."""
        return (RVQCodec(head_dim, self.key_bits).bits_per_coordinate
                + RVQCodec(head_dim, self.value_bits).bits_per_coordinate) / 2

    def layer_bits(self, n_layers: int, profile: Any = None) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(key bits, value bits) per layer: the preset's pair, or with ``profile`` (a path or a
        ``{(layer, "k"|"v"): sensitivity}`` map covering every layer) an allocation at ``alloc_target``."""
        if profile is None:
            return [(self.key_bits, self.value_bits)] * n_layers
        sens: dict[Slot, float] = load_profile(profile) if not isinstance(profile, dict) else dict(profile)
        want = {(l, s) for l in range(n_layers) for s in ("k", "v")}
        if set(sens) != want:
            raise CodecConfigError(f"the profile covers {len(sens)} slots; this model has {n_layers} layers "
                                   f"({len(want)} slots): a profile of another model?")
        table = allocate(sens, self.alloc_target)
        return [(table[(l, "k")], table[(l, "v")]) for l in range(n_layers)]

    def make_cache(self, model: Any, *, profile: Any = None, **kwargs: Any) -> list:
        """One cache per layer of ``model`` (:func:`rvqstore.make_prompt_cache` with these bits).

        Plain attention layers get per-side (and with ``profile`` per-layer) bits; other RVQ cache
        kinds (sliding windows) take the key bits on both sides: more bits there, never less quality."""
        from .prompt_cache import make_prompt_cache

        caches = make_prompt_cache(model, self.key_bits, **kwargs)
        bits = self.layer_bits(len(caches), profile)
        return [RVQKVCache(kb, value_bits=vb, **kwargs) if type(c) is RVQKVCache else c
                for c, (kb, vb) in zip(caches, bits)]


# Budgets are on disk; the settings and targets below were chosen with tools/eval_quality.py (--fit for
# the targets: the largest whose 512-token files of the three tuning texts all stay within the budget;
# the per-side pairs: the lowest pooled token KL among those within it). Figures: docs/quality.md.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("near-lossless", (4, 2), (4, 2), 6.0, 6.32, "<= 6 bits/coord on disk: token KL a few thousandths"),
    Preset("balanced", (4, 1), (2, 2), 4.5, 4.74, "<= 4.5 bits/coord on disk: ahead of rotated 4-bit affine"),
    Preset("small", (2, 1), (1, 1), 3.0, 3.16, "<= 3 bits/coord on disk: the smallest usable cache"),
)}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise CodecConfigError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}") from None


def make_cache(model: Any, preset: str = "balanced", *, profile: Any = None, **kwargs: Any) -> list:
    """Caches for ``model`` with the settings of the named preset (see :data:`PRESETS`)."""
    return get(preset).make_cache(model, profile=profile, **kwargs)
