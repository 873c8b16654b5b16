"""Cache settings named by what they promise on disk, chosen from docs/quality.md.

Keys are the sensitive side of the cache: quantizing every key with RVQ 2+1 costs SmolLM2-135M
about seven times the next-token KL that the same code on every value does (tools/probe_sensitivity.py).
Each preset codes keys finer than values, under the budget its name promises: bits per coordinate of
the saved ``.rvq`` file (everything counted: header, token ids, norms, codes), saved with the preset's
:meth:`Preset.compress` mode. Figures are measured on the bundled model (mean token KL against the
float32 cache, pooled over three texts of different kinds, and on a fourth kept aside): see
docs/quality.md. On the command line: ``rvqstore cache-prompt --preset balanced [--profile P]``.

    p = rvqstore.presets.get("balanced")
    caches = p.make_cache(model)                              # uniform grids, one step per side
    caches = p.make_cache(model, profile="smollm2.json")      # a step per layer and side
    rvqstore.save_prompt_cache(path, caches, tokens=ids, compress=p.compress())   # "best": rANS

The presets code with **uniform grids** (``RVQCodec(step=...)``), stored near their entropy by
``compress="best"`` (rANS sections): 23-63% less token KL than Lloyd–Max codes at the same bits on
disk (SmolLM2, pooled; lower on every text), because a grid's rate follows its step continuously,
so each side (and with a profile each layer) gets the step its sensitivity calls for
(:mod:`rvqstore.bit_allocation`). Two costs: in memory grid codes keep their fixed width, wider than
the budget (``memory_bits``: e.g. balanced 5.75 bits per coordinate against 4.5 on disk), and "best"
files code and decode rANS in numpy (a 512-token SmolLM2 file: saved in 2.4 s, loaded in 1.05 s,
against 0.04 s and 0.03 s with "auto"; docs/quality.md). ``grid=False`` selects the previous
Lloyd–Max settings, which meet the same budgets with ``compress="auto"`` (zstd, milliseconds to
load) at a higher token KL.

The grid forms also hold **codec state** (``Preset.state()``: ``RVQKVCache(sink_tokens=1,
center_keys=True)``: the first position kept exact, a per-head key mean taken out before coding; files
store it, format 1.2 ``codec-state``), with steps refitted so that its bytes fit the same budgets
(SmolLM2, 1,024 tokens per text, 512 scored; pooled token KL, held-aside text in brackets): per side
near-lossless 0.0019 -> 0.0015 (0.0011 -> 0.00085) at 5.99 bits, balanced 0.0155 -> 0.0120, Δppl +3.0%
-> +1.0% (0.0086 -> 0.0073) at 4.50, small 0.133 -> 0.105 (0.086 -> 0.062) at 2.99. With a profile, pass
the one measured with that state (tools/results/quality-sensitivity-smollm2-state.json, which the scales
are fitted to): near-lossless 0.0014, balanced 0.0113 (+0.9%), small 0.09997 (held aside 0.0008, 0.0065,
0.059). A profile measured without state (quality-sensitivity-smollm2.json) still works but weighs the
keys as if uncentred.
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
    sink_tokens: int = 0
    center_keys: bool = False

    def state(self, profile: Any = None, grid: bool = True) -> dict:
        """The codec state the preset's caches hold (``RVQKVCache(sink_tokens=, center_keys=)``): the
        first ``sink_tokens`` positions kept exact and, with ``center_keys``, a per-head key mean taken
        out before coding. Only the grid forms carry it (their steps and scale are fitted with its bytes
        counted); the Lloyd–Max forms (``grid=False``) keep their earlier settings, fitted without it."""
        if not self.uses_grid(profile, grid) or not (self.sink_tokens or self.center_keys):
            return {}
        return {"sink_tokens": self.sink_tokens, "center_keys": self.center_keys}

    def sides(self, grid: bool = True) -> tuple[Side, Side]:
        """(key, value) settings without a profile (``grid=False``: the Lloyd–Max ones)."""
        if self.key_step is None or not grid:
            return (self.key_bits, None), (self.value_bits, None)
        return (grid_bits(self.key_step), self.key_step), (grid_bits(self.value_step), self.value_step)

    def uses_grid(self, profile: Any = None, grid: bool = True) -> bool:
        return grid and (self.step_scale if profile is not None else self.key_step) is not None

    def compress(self, profile: Any = None, grid: bool = True) -> str:
        """The ``save_prompt_cache`` mode the budget is measured with: ``"best"`` for grid codes
        (their size is in the rANS sections), else the default ``"auto"``."""
        return "best" if self.uses_grid(profile, grid) else "auto"

    def memory_bits(self, head_dim: int = 64, grid: bool = True) -> float:
        """Bits per coordinate in memory without a profile (codes, per-vector norms, packing), keys
        and values averaged."""
        return sum(RVQCodec(head_dim, b, step=st).bits_per_coordinate for b, st in self.sides(grid)) / 2

    def layer_settings(self, n_layers: int, profile: Any = None, grid: bool = True) -> list[tuple[Side, Side]]:
        """(key, value) settings per layer: the preset's pair, or with ``profile`` (a path or a
        ``{(layer, "k"|"v"): sensitivity}`` map covering every layer) an allocation."""
        if profile is None:
            return [self.sides(grid)] * n_layers
        sens: dict[Slot, float] = load_profile(profile) if not isinstance(profile, dict) else dict(profile)
        want = {(l, s) for l in range(n_layers) for s in ("k", "v")}
        if set(sens) != want:
            raise CodecConfigError(f"the profile covers {len(sens)} slots; this model has {n_layers} layers "
                                   f"({len(want)} slots): a profile of another model?")
        if self.step_scale is not None and grid:
            steps = allocate_steps(sens, self.step_scale)
            return [tuple((grid_bits(steps[(l, s)]), steps[(l, s)]) for s in ("k", "v")) for l in range(n_layers)]
        table = allocate(sens, self.alloc_target)
        return [((table[(l, "k")], None), (table[(l, "v")], None)) for l in range(n_layers)]

    def layer_bits(self, n_layers: int, profile: Any = None, grid: bool = True) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(key bits, value bits) in memory per layer (see :meth:`layer_settings`)."""
        return [(k[0], v[0]) for k, v in self.layer_settings(n_layers, profile, grid)]

    def make_cache(self, model: Any, *, profile: Any = None, grid: bool = True, **kwargs: Any) -> list:
        """One cache per layer of ``model`` (:func:`rvqstore.make_prompt_cache` with these settings).

        Plain attention layers get per-side (and with ``profile`` per-layer) settings; other RVQ cache
        kinds (sliding windows) take the key setting on both sides: more bits there, never less quality.
        ``grid=False``: the Lloyd–Max settings, whose files meet the budget with ``compress="auto"``
        (zstd: they load in milliseconds, where "best" files decode rANS in numpy) at a higher token KL."""
        from .prompt_cache import make_prompt_cache

        (kb, ks), _ = self.sides(grid)
        state = self.state(profile, grid)
        caches = make_prompt_cache(model, kb, step=ks, **state, **kwargs)
        settings = self.layer_settings(len(caches), profile, grid)
        # both sides of a setting are grids or neither (value_step=None would mean "the keys' step")
        return [RVQKVCache(k[0], value_bits=v[0], step=k[1], value_step=v[1], **state, **kwargs)
                if type(c) is RVQKVCache else c for c, (k, v) in zip(caches, settings)]


# Budgets are on disk. Each preset keeps its Lloyd–Max settings (key_bits/value_bits, alloc_target: the
# previous revision's presets, measured with compress="auto") and, chosen over them on the pooled tuning
# texts, uniform grids with codec state (the first token exact, the key mean taken out: sink_tokens=1,
# center_keys=True): steps per side (keys at 0.38 of the values' step, the study's optimum; 0.55, tried
# with the key mean, was no better) and the allocation's scale for the profile measured with that state
# (tools/results/quality-sensitivity-smollm2-state.json), each the finest whose files (compress="best",
# the 512-token cached halves of the three tuning texts, the state's sections counted) all stay within
# the budget (tools/eval_quality.py --fit-grid --sink 1 --center-keys;
# tools/results/quality-fit-grid-state-smollm2.json, quality-fit-grid-state-profile-smollm2.json).
# Figures: docs/quality.md.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("near-lossless", (4, 2), (4, 2), 6.0, 6.32, "<= 6 bits/coord on disk: token KL a few thousandths",
           key_step=0.0475, value_step=0.125, step_scale=0.062, sink_tokens=1, center_keys=True),
    Preset("balanced", (4, 1), (2, 2), 4.5, 4.74, "<= 4.5 bits/coord on disk: ahead of rotated 4-bit affine",
           key_step=0.1346, value_step=0.3543, step_scale=0.1734, sink_tokens=1, center_keys=True),
    Preset("small", (2, 1), (1, 1), 3.0, 3.16, "<= 3 bits/coord on disk: the smallest usable cache",
           key_step=0.3963, value_step=1.043, step_scale=0.495, sink_tokens=1, center_keys=True),
)}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise CodecConfigError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}") from None


def make_cache(model: Any, preset: str = "balanced", *, profile: Any = None, grid: bool = True, **kwargs: Any) -> list:
    """Caches for ``model`` with the settings of the named preset (see :data:`PRESETS`); save them with
    ``compress=get(preset).compress(profile, grid)``."""
    return get(preset).make_cache(model, profile=profile, grid=grid, **kwargs)
