"""Which formulation serves one attention call on a packed cache.

- the GPU kernel (:mod:`rvqstore.attention.kernel`) for decode-shaped calls on a GPU backend;
- on MLX's CPU backend, the same formulation computed on the host (:mod:`rvqstore.attention.host`);
- the MLX-ops formulation (:mod:`rvqstore.attention.ops`) up to :data:`MAX_QUERIES_ON_CODES` queries;
- otherwise None: the caller runs decode-then-SDPA on the keys/values ``update_and_fetch`` returned.

The crossover is measured (tools/bench_generation.py --crossover, results in
tools/results/generation-crossover-cpu.json): see docs/attention.md.
"""

from __future__ import annotations

import mlx.core as mx

from . import host, kernel, masks, ops
from .view import CodesView

#: queries per call up to which attention runs on the codes; above it, decode-then-SDPA. Measured on
#: the CPU (SmolLM2 geometry, 4+2, 512 and 2,048 cached tokens): codes 1.7-2.0x faster at 1 query,
#: 1.2-2.7x at 4, 0.97-1.24x at 16, 0.87-1.04x from 64 queries on (docs/attention.md)
MAX_QUERIES_ON_CODES = 16


def attend(view: CodesView, queries: mx.array, scale: float, mask=None, sinks=None, *,
           use_kernels: bool = True) -> mx.array | None:
    if mask is not None:
        masks.check(mask)
    if view.n_coded + view.n_dense == 0 or queries.shape[2] > MAX_QUERIES_ON_CODES:
        return None
    if use_kernels and view.n_coded:
        out = kernel.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    if host.on_cpu():
        out = host.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    return ops.attend(view, queries, scale, mask, sinks)
