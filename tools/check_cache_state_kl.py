"""The real cache with codec state against the evaluation's simulation: token KL, text by text.

For each text: the first 1,024 tokens under the evaluation's ``half`` protocol (512 cached, 512
scored; tools/quality/protocol.py), once with RVQKVCache caches (``make`` below: a uniform grid per
side, plain and with ``sink_tokens=1, center_keys=True``) and once with the simulation ``SimCache`` of
the same method. Reports the mean token KL against the unquantized run for both and whether the
per-token KL arrays are identical (they are when the cache hands out bit for bit what the simulation
does). Grid steps: keys 0.3648, values 0.96 (the state design's "grid per side" row).

    python tools/check_cache_state_kl.py --json tools/results/cache-state-kl-smollm2.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from rvqstore.blas import maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--key-step", type=float, default=0.3648)
    ap.add_argument("--value-step", type=float, default=0.96)
    ap.add_argument("--json")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)

    from quality import methods as M
    from quality import metrics as Q
    from quality import protocol as P
    from quality.texts import DEFAULT_TEXTS, load_tokens

    from rvqstore import RVQKVCache
    from rvqstore.bit_allocation import grid_bits
    from rvqstore.model import load_model

    model, tok = load_model()
    kb, vb = grid_bits(a.key_step), grid_bits(a.value_step)
    rows = []
    for text in DEFAULT_TEXTS:
        tokens = load_tokens(tok, text, a.tokens)
        ref = P.reference(model, tokens)
        targets = mx.array(tokens[len(tokens) // 2:], dtype=mx.int32)
        for state in ({}, {"sink_tokens": 1, "center_keys": True}):
            t0 = time.time()
            caches = [RVQKVCache(kb, value_bits=vb, step=a.key_step, value_step=a.value_step, **state)
                      for _ in model.layers]
            real = Q.compare(ref, P.next_token_logprobs(model, tokens, caches, "half"), targets)
            method = M.grid_per_side(a.key_step, a.value_step, "grid per side")
            if state:
                method = M.variant(method, sink=1, center_keys=True)
            sim = P.run_method(model, tokens, method, ref).scores
            row = {"text": text.name, "held_aside": text.held_aside, "state": bool(state),
                   "kl_cache": float(real.kl.mean()), "kl_simulation": float(sim.kl.mean()),
                   "identical_per_token": bool(np.array_equal(real.kl, sim.kl)), "seconds": time.time() - t0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": "SmolLM2-135M float32", "protocol": "half", "tokens": a.tokens,
           "key_step": a.key_step, "value_step": a.value_step, "bits": [list(kb), list(vb)], "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
