"""Fuzzing the model-level readers from real snapshots (issue 12, item 12).

tools/fuzz_format.py holds the container to "typed FormatError or a verified load". This goes one
level up, through what a user calls: ``load_prompt_cache`` and ``resume`` with ``model=``, so that
re-checksummed header mutations reach the model check (fingerprint, layer kinds, geometry), the cache
options and the cache constructors. Seeds are real snapshots of tiny random-weight mlx-lm models'
activations (a plain llama; a gemma3 with sliding-window layers). Every mutated file must load or
raise an RVQError subclass; nothing else may escape.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rvqstore import load_prompt_cache, make_prompt_cache, resume, save_prompt_cache
from rvqstore.errors import RVQError
from rvqstore.generation import prefill

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))
import fuzz_format as ff  # noqa: E402
from tiny_models import build  # noqa: E402

TOKENS = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11, 2, 90, 33, 4, 70, 12, 19, 26, 50, 1]  # beyond gemma3's window


def _snapshot(arch: str, tmp: Path) -> tuple[object, bytes]:
    model = build(arch)[0]
    cache = make_prompt_cache(model, bits=(2, 2))
    prefill(model, TOKENS, cache)
    path = tmp / f"{arch}.rvq"
    save_prompt_cache(path, cache, tokens=TOKENS, model=model, metadata={"arch": arch})
    return model, path.read_bytes()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seeds")
    return {arch: _snapshot(arch, tmp) for arch in ("llama", "gemma3_text")}


DEEP_KEYS = ("model", "layers", "cache", "n_tokens", "quantizer", "metadata")


def _nudge(v):
    """A plausible wrong value: what a careless writer or a crafted file would hold."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        w = [v + 1, v - 1, v * 2, 0][v % 4]
        return w if -(1 << 63) <= w < (1 << 64) else 0  # stay packable by msgpack
    if isinstance(v, str):
        return (v[:-1] + ("0" if v[-1:] != "0" else "1")) if v else "x"
    if isinstance(v, float):
        return -v if v else 1.0
    return None


@st.composite
def header_mutations(draw, names):
    name = draw(st.sampled_from(names))
    return name, draw(st.randoms(use_true_random=False))


def _mutate_header(data: bytes, rnd) -> bytes:
    header, _ = ff.split(data)
    for _ in range(rnd.randint(1, 2)):
        ps = ff.paths(header)
        # half of the picks go where the model-level code reads (fingerprint, layer maps, cache
        # options, tokens count, quantizer): mutations of section offsets stop at the container checks
        deep = [p for p in ps if p[0] in DEEP_KEYS]
        p = rnd.choice(deep if deep and rnd.random() < 0.5 else ps)
        parent = header
        for k in p[:-1]:
            parent = parent[k]
        op = rnd.choice(["nudge", "nudge", "hostile", "delete"])
        try:
            if op == "nudge":
                ff.set_path(header, p, _nudge(parent[p[-1]]))
            elif op == "hostile":
                ff.set_path(header, p, copy.deepcopy(rnd.choice(ff.HOSTILE_VALUES)))
            else:
                ff.del_path(header, p)
        except (KeyError, IndexError, TypeError):
            pass
    return ff.rebuild(data, header)


def _mutate_bytes(data: bytes, rnd) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 3)):
        i = rnd.randrange(len(b))
        b[i] ^= 1 << rnd.randrange(8)
    return bytes(b)


def _load_all_ways(path: Path, model) -> str:
    """"ok" or the RVQError subclass name; anything else propagates (a bug)."""
    try:
        caches = load_prompt_cache(path, model=model)
        for c in caches:  # what a model call reads; must not fail for a file that loaded
            mx.eval(c.state if not hasattr(c, "keys_and_values") or c.offset == 0 else c.keys_and_values())
        r = resume(path, TOKENS + [9], model)
        assert 0 <= r.reused <= len(TOKENS)
        return "ok"
    except RVQError as e:
        return type(e).__name__


SETTINGS = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(case=header_mutations(["llama", "gemma3_text"]))
def test_header_mutations_of_real_snapshots_give_typed_errors(seeds, tmp_path_factory, case):
    name, rnd = case
    model, data = seeds[name]
    path = tmp_path_factory.getbasetemp() / "mutated.rvq"
    path.write_bytes(_mutate_header(data, rnd))
    _load_all_ways(path, model)


@SETTINGS
@given(case=header_mutations(["llama", "gemma3_text"]))
def test_bit_flips_in_real_snapshots_are_always_detected(seeds, tmp_path_factory, case):
    name, rnd = case
    model, data = seeds[name]
    mutated = _mutate_bytes(data, rnd)
    path = tmp_path_factory.getbasetemp() / "flipped.rvq"
    path.write_bytes(mutated)
    out = _load_all_ways(path, model)
    assert out != "ok" or mutated == data  # every byte a load relies on is checksummed


def test_seeds_load_and_another_model_is_refused(seeds, tmp_path):
    for name, (model, data) in seeds.items():
        p = tmp_path / f"{name}.rvq"
        p.write_bytes(data)
        assert _load_all_ways(p, model) == "ok"
    other = seeds["gemma3_text"][0]
    p = tmp_path / "llama.rvq"
    assert _load_all_ways(p, other) == "ModelMismatchError"
