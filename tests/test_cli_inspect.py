"""`rvqstore inspect` and `rvqstore verify`: what they print, their exit status, and their errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rvqstore.format as F
from rvqstore import cli

ROOT = Path(__file__).resolve().parent.parent
VEC = ROOT / "format_spec" / "vectors"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def cache_file(tmp_path_factory):
    from test_format_roundtrip import make_cache

    header, secs, codec, _ = make_cache(n_layers=3, B=1, H=2, T=50, D=64, bits=(2, 2), n_dense=4)
    header["model"] = {"arch": "llama", "weights_sha256": "ab" * 32, "n_layers": 3}
    header["metadata"] = {"prompt": "hello"}
    p = tmp_path_factory.mktemp("cli") / "cache.rvq"
    F.write_rvq(p, header, secs, compress="auto")
    return p


def test_inspect_text(capsys, cache_file):
    code, out, err = run(capsys, "inspect", str(cache_file))
    assert code == 0 and err == ""
    for needle in ("rvq 1.0", "arch = llama", "weights_sha256", "tokens      50", "(token ids stored)",
                   "prompt = hello", "turboquant-rvq v1: dim 64, bits 2+2, conditional residual", "seed 0", "randomized-hadamard",
                   "splitmix64-msb-sign", "bits/coord", "at rest (file)", "resident as packed codes",
                   "decoded (fp16 keys + values)", "total"):
        assert needle in out, needle
    lines = [ln for ln in out.splitlines() if ln[:5].strip().isdigit()]
    assert len(lines) == 3  # one row per layer


def test_inspect_json_numbers_add_up(capsys, cache_file):
    code, out, err = run(capsys, "inspect", "--json", str(cache_file))
    assert code == 0
    d = json.loads(out)
    assert d["format_version"] == [1, 0]
    assert d["n_tokens"] == 50 and d["token_ids_stored"] is True
    assert d["model"]["arch"] == "llama"
    assert d["quantizer"]["name"] == "turboquant-rvq" and isinstance(d["quantizer"]["rotation"]["signs"], str)
    assert len(d["layers"]) == 3
    with F.open_rvq(cache_file) as f:
        stored = sum(s.length for s in f.sections if s.layer >= 0)
        raw = sum(s.raw_length for s in f.sections if s.layer >= 0)
        assert d["memory"]["at_rest_bytes"] == f.file_length == cache_file.stat().st_size
    assert d["totals"]["stored_bytes"] == stored == sum(r["stored_bytes"] for r in d["layers"])
    assert d["memory"]["resident_packed_bytes"] == raw
    fp16 = 3 * 2 * (1 * 2 * 50 * 64) * 2
    assert d["memory"]["decoded_fp16_bytes"] == fp16 == d["totals"]["fp16_bytes"]
    r0 = d["layers"][0]
    assert r0["n_tokens"] == 50 and r0["n_dense_tokens"] == 4 and r0["n_kv_heads"] == 2 and r0["head_dim"] == 64
    assert r0["ratio"] == pytest.approx(r0["fp16_bytes"] / r0["stored_bytes"])
    assert r0["bits_per_coordinate"] == pytest.approx(8 * r0["stored_bytes"] / (2 * 2 * 50 * 64))
    # 2+2 bits at dim 64 is 4.25 bits per quantized coordinate before zstd; 4 of 50 tokens are dense fp16
    assert 3.0 < r0["bits_per_coordinate"] < 5.5


def test_inspect_reads_only_the_header(capsys, cache_file, tmp_path):
    """Damaged section data: inspect still works (it reads no section), verify fails."""
    with F.open_rvq(cache_file) as f:
        s = f.section("layers.2.keys.codes1")
    data = bytearray(cache_file.read_bytes())
    data[s.offset] ^= 0xFF
    bad = tmp_path / "bad.rvq"
    bad.write_bytes(bytes(data))
    code, out, _ = run(capsys, "inspect", str(bad))
    assert code == 0 and "turboquant-rvq" in out
    code, out, err = run(capsys, "verify", str(bad))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "ChecksumMismatchError" in err and "layers.2.keys.codes1" in err


def test_verify_ok(capsys, cache_file):
    code, out, err = run(capsys, "verify", str(cache_file))
    assert code == 0 and err == ""
    assert out.startswith("OK ") and "vectors decoded by the codec" in out
    code, out, _ = run(capsys, "verify", "--no-decode", str(cache_file))
    assert code == 0 and "decoded by the codec" not in out
    code, out, _ = run(capsys, "verify", "-q", str(cache_file))
    assert code == 0 and out == ""


@pytest.mark.parametrize("entry", json.loads((VEC / "invalid" / "MANIFEST.json").read_text()),
                         ids=lambda e: e["file"])
def test_verify_fails_every_invalid_vector_in_one_line(capsys, entry):
    code, out, err = run(capsys, "verify", str(VEC / "invalid" / entry["file"]))
    assert code == 1, entry
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("rvqstore verify: error: " + entry["error"] + ": "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("entry", json.loads((VEC / "valid" / "MANIFEST.json").read_text()),
                         ids=lambda e: e["file"])
def test_inspect_and_verify_every_valid_vector(capsys, entry):
    p = str(VEC / "valid" / entry["file"])
    assert run(capsys, "inspect", p)[0] == 0
    assert run(capsys, "inspect", "--json", p)[0] == 0
    code, out, err = run(capsys, "verify", p)
    assert code == 0 and out.startswith("OK"), err


def test_open_errors_are_one_line(capsys, tmp_path):
    code, out, err = run(capsys, "inspect", str(tmp_path / "missing.rvq"))
    assert code == 1 and err == f"rvqstore inspect: error: No such file or directory: {tmp_path / 'missing.rvq'}\n"
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 1 and err.count("\n") == 1 and "directory" in err.lower()
    p = tmp_path / "text.rvq"
    p.write_text("hello\n")
    code, out, err = run(capsys, "inspect", str(p))
    assert code == 1 and err.startswith("rvqstore inspect: error: BadMagicError: ") and err.count("\n") == 1


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["inspect"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        cli.main(["frobnicate"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        cli.main([])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_unexpected_exceptions_are_one_line(capsys, monkeypatch, cache_file):
    import rvqstore.format as fmt

    def boom(*a, **k):
        raise RuntimeError("something\nunexpected")

    monkeypatch.setattr(fmt, "open_rvq", boom)
    code, out, err = run(capsys, "inspect", str(cache_file))
    assert code == 1 and err == ("rvqstore inspect: internal error: RuntimeError: something unexpected "
                                 "(set RVQSTORE_DEBUG=1 for a traceback)\n")


def test_subcommand_registry_is_extensible(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_COMMANDS", list(cli._COMMANDS))

    def args(p):
        p.add_argument("--n", type=int, default=3)

    @cli.subcommand("echo-test", help="test only", configure=args)
    def cmd(a):
        print("n =", a.n)
        return 5

    assert run(capsys, "echo-test", "--n", "7") == (5, "n = 7\n", "")
    with pytest.raises(ValueError):
        cli.subcommand("echo-test", help="again")(cmd)


def test_console_script_has_no_traceback_and_true_exit_status(tmp_path, cache_file):
    """The real process: python -m rvqstore.cli, as the console script runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RVQSTORE_DEBUG", None)
    bad = VEC / "invalid" / "zstd_huge_claim.rvq"
    r = subprocess.run([sys.executable, "-m", "rvqstore.cli", "verify", str(bad)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("rvqstore verify: error: LimitExceededError: ") and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, "-m", "rvqstore.cli", "inspect", "--json", str(cache_file)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["n_tokens"] == 50


def test_inspect_lists_every_quantizer_of_a_quantizer_table(capsys):
    code, out, _ = run(capsys, "inspect", str(VEC / "valid" / "per_side_quantizers.rvq"))
    assert code == 0
    assert "quantizer 0 turboquant-rvq v1: dim 56, bits 4+2" in out
    assert "quantizer 1 turboquant-rvq v1: dim 40, bits 2+2, shared residual" in out
    assert "none (all layers dense)" not in out
