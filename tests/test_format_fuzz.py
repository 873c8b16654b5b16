"""Property-based fuzzing of the reader (the harness lives in tools/fuzz_format.py; run it longer there).

Every mutated file gives a typed FormatError or a load; byte-level damage is always detected; Python
allocations stay under 40x the file size.  Derandomized, so the run is the same every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import fuzz_format  # noqa: E402

BYTE_MUTATION, HEADER_MUTATION = fuzz_format.strategies()
ORIGINALS = fuzz_format.seeds()
SETTINGS = settings(max_examples=1500, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(BYTE_MUTATION)
def test_fuzz_byte_mutations(tmp_path_factory, case):
    work = str(tmp_path_factory.getbasetemp())
    fuzz_format.check_case(case, work, ORIGINALS, byte_level=True)


@SETTINGS
@given(HEADER_MUTATION)
def test_fuzz_header_mutations(tmp_path_factory, case):
    work = str(tmp_path_factory.getbasetemp())
    fuzz_format.check_case(case, work, ORIGINALS, byte_level=False)


def test_fuzz_harness_runs_as_a_script(capsys):
    fuzz_format.main(["--examples", "20"])
    out = capsys.readouterr().out
    assert "bytes: 20 cases" in out and "header: 20 cases" in out
