"""rvqstore.first_use: the first-use check and latch shared by the CUDA step kernels."""

import threading

from rvqstore import first_use


def _serve(config, launch, check, state):
    return first_use.serve(config, launch, check, verified=state[0], disabled=state[1], lock=threading.Lock(),
                           what="test kernel")


def test_checked_once_then_served_without_checking():
    state, checks = (set(), {}), []
    check = lambda out: checks.append(out)  # noqa: E731  (returns None: agrees)
    assert _serve("a", lambda: 1, check, state) == 1 and _serve("a", lambda: 2, check, state) == 2
    assert checks == [1] and state == ({"a"}, {})


def test_disagreement_or_failure_latches_off_that_configuration_only(caplog):
    state = (set(), {})
    assert _serve("a", lambda: 1, lambda out: "differs", state) is None
    assert "first-use check failed: differs" in state[1]["a"] and "switched off" in caplog.text

    def broken():
        raise ValueError("cannot build")

    assert _serve("b", broken, lambda out: None, state) is None and "cannot build" in state[1]["b"]
    launched = []
    assert _serve("a", lambda: launched.append(1), lambda out: None, state) is None and not launched
    assert _serve("c", lambda: 3, lambda out: None, state) == 3 and state[0] == {"c"}
