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

from .bit_allocation import Slot, allocate, allocate_steps, grid_bits, load_profile
from .cache import RVQKVCache
from .codec import RVQCodec
from .errors import CodecConfigError


Side = tuple[tuple[int, int], "float | None"]  # (bits in memory, grid step or None for Lloyd–Max)


@dataclass(frozen=True)
class Preset:
    """``budget``: bits per coordinate ON DISK the preset promises (a ``.rvq`` saved with the preset's
    :meth:`compress`, everything counted; measured on SmolLM2 at 512 cached tokens, longer files are
    smaller per coordinate). Two forms, each measured to fit the budget (``tools/eval_quality.py``):

    * without a profile, one setting per side: Lloyd–Max ``key_bits``/``value_bits``, or, when
      ``key_step``/``value_step`` are set, uniform grids of those steps (bits from
      :func:`rvqstore.bit_allocation.grid_bits`);
    * with a sensitivity profile, a setting per layer and side: Lloyd–Max bits allocated at the
      fixed-width ``alloc_target``, or, when ``step_scale`` is set, grid steps
      ``step_scale / sqrt(sens / mean sens)`` (:func:`rvqstore.bit_allocation.allocate_steps`).

    Grid codes are small only on disk: in memory they take their fixed width (more bits than the
    budget: :meth:`memory_bits`), and their files are saved with ``compress="best"`` (rANS sections,
    decoded in numpy when loaded: seconds for a 512-token SmolLM2 file, docs/entropy-files.md)."""

    name: str
    key_bits: tuple[int, int]
    value_bits: tuple[int, int]
    budget: float
    alloc_target: float
    promise: str
    key_step: float | None = None
    value_step: float | None = None
    step_scale: float | None = None

    def sides(self) -> tuple[Side, Side]:
        """(key, value) settings without a profile."""
        if self.key_step is None:
            return (self.key_bits, None), (self.value_bits, None)
        return (grid_bits(self.key_step), self.key_step), (grid_bits(self.value_step), self.value_step)

    def uses_grid(self, profile: Any = None) -> bool:
        return (self.step_scale if profile is not None else self.key_step) is not None

    def compress(self, profile: Any = None) -> str:
        """The ``save_prompt_cache`` mode the budget is measured with: ``"best"`` for grid codes
        (their size is in the rANS sections), else the default ``"auto"``."""
        return "best" if self.uses_grid(profile) else "auto"

    def memory_bits(self, head_dim: int = 64) -> float:
        """Bits per coordinate in memory without a profile (codes, per-vector norms, packing), keys
        and values averaged."""
        return sum(RVQCodec(head_dim, b, step=st).bits_per_coordinate for b, st in self.sides()) / 2

    def layer_settings(self, n_layers: int, profile: Any = None) -> list[tuple[Side, Side]]:
        """(key, value) settings per layer: the preset's pair, or with ``profile`` (a path or a
        ``{(layer, "k"|"v"): sensitivity}`` map covering every layer) an allocation."""
        if profile is None:
            return [self.sides()] * n_layers
        sens: dict[Slot, float] = load_profile(profile) if not isinstance(profile, dict) else dict(profile)
        want = {(l, s) for l in range(n_layers) for s in ("k", "v")}
        if set(sens) != want:
            raise CodecConfigError(f"the profile covers {len(sens)} slots; this model has {n_layers} layers "
                                   f"({len(want)} slots): a profile of another model?")
        if self.step_scale is not None:
            steps = allocate_steps(sens, self.step_scale)
            return [tuple((grid_bits(steps[(l, s)]), steps[(l, s)]) for s in ("k", "v")) for l in range(n_layers)]
        table = allocate(sens, self.alloc_target)
        return [((table[(l, "k")], None), (table[(l, "v")], None)) for l in range(n_layers)]

    def layer_bits(self, n_layers: int, profile: Any = None) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(key bits, value bits) in memory per layer (see :meth:`layer_settings`)."""
        return [(k[0], v[0]) for k, v in self.layer_settings(n_layers, profile)]

    def make_cache(self, model: Any, *, profile: Any = None, **kwargs: Any) -> list:
        """One cache per layer of ``model`` (:func:`rvqstore.make_prompt_cache` with these settings).

        Plain attention layers get per-side (and with ``profile`` per-layer) settings; other RVQ cache
        kinds (sliding windows) take the key setting on both sides: more bits there, never less quality."""
        from .prompt_cache import make_prompt_cache

        (kb, ks), _ = self.sides()
        caches = make_prompt_cache(model, kb, step=ks, **kwargs)
        settings = self.layer_settings(len(caches), profile)
        # both sides of a setting are grids or neither (value_step=None would mean "the keys' step")
        return [RVQKVCache(k[0], value_bits=v[0], step=k[1], value_step=v[1], **kwargs) if type(c) is RVQKVCache else c
                for c, (k, v) in zip(caches, settings)]


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
