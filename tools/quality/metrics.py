"""Per-token comparison of a method's next-token distributions with the unquantized run, and the
summaries drawn from it (mean token KL first; perplexity change with a block-bootstrap interval)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

BLOCK = 32  # bootstrap block (tokens): neighbouring tokens' losses are correlated
RESAMPLES = 1000


@dataclass
class TokenScores:
    """Per scored token: KL(ref || method), the two negative log-likelihoods, argmax agreement."""

    kl: np.ndarray
    nll: np.ndarray
    nll_ref: np.ndarray
    agree: np.ndarray

    @staticmethod
    def concat(parts: list["TokenScores"]) -> "TokenScores":
        return TokenScores(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("kl", "nll", "nll_ref", "agree")))


def compare(logp_ref: mx.array, logp: mx.array, targets: mx.array) -> TokenScores:
    """``logp_ref``/``logp``: (T, V) log-probabilities; ``targets``: (T,) the tokens that came next."""
    kl = mx.sum(mx.exp(logp_ref) * (logp_ref - logp), axis=-1)
    pick = lambda lp: -mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]  # noqa: E731
    agree = mx.argmax(logp_ref, axis=-1) == mx.argmax(logp, axis=-1)
    out = [np.array(a.astype(mx.float32)) for a in (kl, pick(logp), pick(logp_ref), agree)]
    out[0] = np.maximum(out[0], 0.0)  # float32 rounding can leave -1e-9 for identical rows
    return TokenScores(*out)


def _blocks(n: int, rng: np.random.Generator, block: int) -> np.ndarray:
    """Indices of one moving-block bootstrap resample of ``n`` tokens."""
    starts = rng.integers(0, max(1, n - block + 1), size=-(-n // block))
    return (starts[:, None] + np.arange(block)[None]).ravel()[:n] % n


def ppl_delta_ci(groups: list[TokenScores], *, seed: int = 0, resamples: int = RESAMPLES,
                 block: int = BLOCK) -> tuple[float, float, float]:
    """Relative perplexity change (pooled over the groups' tokens) and its 95% interval from a
    moving-block bootstrap, resampled within each group (text) and paired (the same tokens for the
    method and the reference)."""
    diff = [g.nll - g.nll_ref for g in groups]
    point = float(np.expm1(np.mean(np.concatenate(diff))))
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for r in range(resamples):
        stats[r] = np.mean(np.concatenate([d[_blocks(len(d), rng, block)] for d in diff]))
    lo, hi = np.expm1(np.percentile(stats, [2.5, 97.5]))
    return point, float(lo), float(hi)


def summarize(groups: list[TokenScores]) -> dict:
    """Pooled summary: each group (text) weighs the same in the mean token KL and agreement;
    perplexities pool the tokens."""
    d, lo, hi = ppl_delta_ci(groups)
    allv = TokenScores.concat(groups)
    return {
        "tok_kl": float(np.mean([np.mean(g.kl) for g in groups])),
        "top1_agree": float(np.mean([np.mean(g.agree) for g in groups])),
        "ppl": float(np.exp(np.mean(allv.nll))), "ppl_ref": float(np.exp(np.mean(allv.nll_ref))),
        "ppl_delta": d, "ppl_delta_lo": lo, "ppl_delta_hi": hi, "n_scored": int(len(allv.kl)),
    }
