"""Per-run results (per-token scores and K/V errors) kept on disk, so that a long evaluation can
be resumed and the report re-rendered without re-running the model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .metrics import TokenScores
from .protocol import Run


class RunStore:
    def __init__(self, folder: Path | None):
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: dict) -> Path:
        blob = json.dumps(key, sort_keys=True)
        return self.folder / (hashlib.sha256(blob.encode()).hexdigest()[:20] + ".npz")

    def get(self, key: dict) -> Run | None:
        if self.folder is None or not self._path(key).exists():
            return None
        z = np.load(self._path(key), allow_pickle=False)
        return Run(TokenScores(z["kl"], z["nll"], z["nll_ref"], z["agree"]), float(z["k_err"]), float(z["v_err"]))

    def get_disk(self, key: dict) -> dict[str, float]:
        """Stored on-disk bits of a (text, method) pair, by compress mode ({} if none)."""
        if self.folder is None:
            return {}
        p = self._path(key).with_suffix(".disk.json")
        return json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}

    def put_disk(self, key: dict, bits: dict[str, float]) -> None:
        if self.folder is None:
            return
        p = self._path(key).with_suffix(".disk.json")
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.get_disk(key), **bits}), encoding="utf-8")
        tmp.replace(p)

    def put(self, key: dict, run: Run) -> None:
        if self.folder is None:
            return
        tmp = self._path(key).with_suffix(".tmp.npz")
        s = run.scores
        np.savez(tmp, kl=s.kl, nll=s.nll, nll_ref=s.nll_ref, agree=s.agree, k_err=run.k_err, v_err=run.v_err,
                 key=json.dumps(key, sort_keys=True))
        tmp.replace(self._path(key))
