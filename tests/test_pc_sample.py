"""tools/pc_sample.py without a GPU: the sampler's text as the tool reads it, the per-kernel summary (a reason's
``_not_issued`` samples are a subset of its samples and are not counted twice), and the per-case re-invocation's
arguments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import pc_sample  # noqa: E402

RAW = """\
reason 1 smsp__pcsamp_warps_issue_stalled_long_scoreboard
reason 2 smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued
reason 3 smsp__pcsamp_warps_issue_stalled_selected
pc kern_a 8480 1:60 2:55 3:0
pc kern_a 16 1:5 3:25
pc kern_b 32 3:7
total 97 dropped 0 nonuser 0
"""


def test_parse_reads_reasons_pcs_and_totals(tmp_path):
    p = tmp_path / "raw.txt"
    p.write_text(RAW)
    raw = pc_sample.parse(p)
    assert raw["reasons"][2].endswith("_not_issued")
    assert raw["pcs"][0] == ("kern_a", 8480, {1: 60, 2: 55, 3: 0})
    assert raw["totals"] == [{"total": 97, "dropped": 0, "nonuser": 0}]


def test_summary_counts_each_sample_once_and_orders_pcs_by_samples(tmp_path):
    p = tmp_path / "raw.txt"
    p.write_text(RAW)
    s = pc_sample.summarize(pc_sample.parse(p))
    a = s["kern_a"]
    assert a["samples"] == 60 + 5 + 25  # the 55 not-issued samples are inside the 60
    assert [x["pc"] for x in a["top_pcs"]] == [8480, 16]
    assert a["top_pcs"][0]["samples"] == 60 and a["top_pcs"][1]["samples"] == 30
    assert a["reasons"]["smsp__pcsamp_warps_issue_stalled_long_scoreboard"] == 65
    assert s["kern_b"]["samples"] == 7


def test_several_cases_run_one_process_each(monkeypatch, tmp_path):
    calls = []

    def fake_call(cmd):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--json") + 1])
        n, bits = cmd[cmd.index("--contexts") + 1], cmd[cmd.index("--bits") + 1]
        out.write_text('{"cases": [{"context": %s, "bits": "%s"}]}' % (n, bits))
        return 0

    monkeypatch.setattr(pc_sample.subprocess, "call", fake_call)
    out = tmp_path / "out.json"
    argv = ["--lib", "x.so", "--cupti", "c.so", "--contexts", "1024,2048", "--bits=2+2,4+2", "--calls", "5",
            "--json", str(out), "--cubins", str(tmp_path / "c.tar.gz")]
    assert pc_sample.main(argv) == 0
    assert len(calls) == 4
    for cmd in calls:  # the case's own context and bits, the shared options kept, never the list of cases
        assert cmd.count("--contexts") == 1 and cmd.count("--bits") == 1 and "--bits=2+2,4+2" not in cmd
        assert cmd[cmd.index("--calls") + 1] == "5" and cmd[cmd.index("--lib") + 1] == "x.so"
    assert sum("--cubins" in c for c in calls) == 1 and "--cubins" in calls[-1]
    got = json.loads(out.read_text())
    assert [(c["context"], c["bits"]) for c in got["cases"]] == [(1024, "2+2"), (1024, "4+2"), (2048, "2+2"),
                                                                (2048, "4+2")]
    assert not list(tmp_path.glob("*.case*.json"))
