"""The GPU parity tests' report: with RVQ_ATTN_PARITY_REPORT=path each comparison appends a line there
(``kind <TAB> pass|FAIL <TAB> detail``; the files under tools/results/gpu-parity-*.txt)."""

from __future__ import annotations

import os

REPORT = os.environ.get("RVQ_ATTN_PARITY_REPORT")


def record(kind: str, ok: bool, detail: str) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(f"{kind}\t{'pass' if ok else 'FAIL'}\t{detail}\n")
