"""save_prompt_cache refuses bad token ids and metadata with typed errors, before touching the file
(issue 12, item 9)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import rvqstore
from rvqstore import RVQKVCache, load_prompt_cache, save_prompt_cache
from rvqstore.errors import InvalidArgumentError, RVQError
from rvqstore.save_arguments import parse_metadata, parse_token_ids


def _cache(t=4):
    c = RVQKVCache((2, 2))
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, t, 64)).astype(np.float32))
    c.update_and_fetch(k, k)
    return [c]


BAD_TOKENS = [
    [2**70, 1, 2, 3],  # was OverflowError
    [-1, 1, 2, 3],
    [2**31, 1, 2, 3],
    [1.5, 1, 2, 3],
    ["a", 1, 2, 3],
    [True, 1, 2, 3],
    [[1, 2], [3, 4]],
    "abcd",
    5,
    np.array([[1, 2], [3, 4]]),
    np.array([1.0, 2.0, 3.0, 4.0]),
    np.array([1, 2, 3, 2**40]),
    mx.array([1, 2, 3, -4]),
    [1, 2, 3],  # count differs from the cache's 4 tokens
]
BAD_METADATA = [["a"], "a=b", {"a": 1}, {1: "a"}, {"a": None}, 7]  # ["a"] was AttributeError


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_bad_tokens_raise_a_typed_error_and_leave_the_file(tmp_path, tokens):
    path = tmp_path / "s.rvq"
    save_prompt_cache(path, _cache(), tokens=[5, 6, 7, 8])
    before = path.read_bytes()
    with pytest.raises(InvalidArgumentError) as e:
        save_prompt_cache(path, _cache(), tokens=tokens)
    assert isinstance(e.value, (RVQError, ValueError, TypeError))
    assert path.read_bytes() == before


@pytest.mark.parametrize("metadata", BAD_METADATA, ids=range(len(BAD_METADATA)))
def test_bad_metadata_raises_a_typed_error(tmp_path, metadata):
    path = tmp_path / "s.rvq"
    with pytest.raises(InvalidArgumentError):
        save_prompt_cache(path, _cache(), tokens=[5, 6, 7, 8], metadata=metadata)
    assert not path.exists()


def test_good_arguments_in_every_accepted_form_round_trip(tmp_path):
    for tokens in ([5, 6, 7, 2**31 - 1], np.array([5, 6, 7, 2**31 - 1], np.uint32),
                   mx.array([5, 6, 7, 2**31 - 1]), (np.int64(5), 6, 7, 2**31 - 1)):
        path = tmp_path / "s.rvq"
        save_prompt_cache(path, _cache(), tokens=tokens, metadata={"prompt": "hi"})
        caches, meta = load_prompt_cache(path, return_metadata=True)
        assert meta == {"prompt": "hi"} and caches[0].offset == 4
    assert parse_token_ids([]).shape == (0,) and parse_metadata(None) == {}


def test_resume_refuses_bad_prompt_tokens_before_touching_the_file(tmp_path):
    missing = tmp_path / "never-opened.rvq"  # argument checks come first: no FileNotFoundError
    for bad in ([], ["a"], [2**40], [-1], "abc", [1.5]):
        with pytest.raises(rvqstore.InvalidArgumentError):
            rvqstore.resume(missing, bad)
