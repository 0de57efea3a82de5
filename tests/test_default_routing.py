"""The default policy ("auto"): each token count runs the backend measured fastest for it.

The backends here run the portable loop (so every answer is checked against the float64
reference) and take a time that depends on the token count on the tuner's clock, which these
tests make virtual (``VirtualClock``): their speed ranking per token count is exact, with
margins of 3x and more, so the routing the tuner must find is known too (ratios within
``DROP_FACTOR``, so no candidate is dropped unless a test means it to be). No test asserts a
real kernel's timing.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

import pytest
import torch

import moe_dispatch as md
from moe_dispatch import _measure, _timing, _tuning
from moe_dispatch.kernels import expert_loop
from moe_dispatch.testing import TOLERANCE, random_routing, random_weights, reference, rel_error

CFG = md.MoEConfig(4, 2, 32, 16, dtype=torch.float32)
CAP = 64  # buckets 1, 2, 4, 8, 16, 32, 64; probed first: 1, 8, 64


# Milliseconds per unit of pace.
PACE = 3.0


class VirtualClock:
    """The tuner's clock (``time`` in the modules that time candidates) in these tests: it
    moves only when a paced backend says how long its call took. Why: with real sleeps, the
    loop's own time and the scheduler's late wake-ups on a loaded 2-core CI machine flipped
    rankings at T=1 (3 of these tests failed in one CI run, and under a background matmul
    locally, at 3 and at 6 ms per unit alike)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


_CLOCKS: list[VirtualClock] = []  # the running test's clock (the fixture sets it)


class Paced(md.BackendBase):
    """The loop, in calls of ``small`` units (``PACE`` ms each, unless ``scale`` says) for
    T <= ``switch`` tokens, else ``large``."""

    def __init__(self, small: float, large: float, switch: int = 16, entry: bool = False,
                 scale: float = PACE) -> None:
        self.small, self.large = small * scale, large * scale
        self.switch, self.entry = switch, entry
        self.prepared = 0
        self.calls: Counter[int] = Counter()  # token count -> calls (tuning and forwards)
        self.entry_calls = 0

    def supports_config(self, config, capabilities):
        return md.accept("paced loop")

    def process_weights(self, weights, capabilities):
        self.prepared += 1
        return weights

    def apply(self, state, x, tw, ids):
        # The call lasts its paced time on the tuner's (virtual) clock, whatever the loop took.
        tokens = x.shape[0]
        self.calls[tokens] += 1
        out = expert_loop(state, x, tw, ids)
        _CLOCKS[-1].now += (self.small if tokens <= self.switch else self.large) / 1e3
        return out

    def fast_call(self, state, guard):
        if not self.entry:
            return None

        def entry(x, tw, ids):
            if torch._C._get_tracing_state():
                return None  # the entry contract: declined inside torch.jit.trace
            self.entry_calls += 1
            return self.apply(state, x, tw, ids)
        return entry


def _registry(**backends: tuple[int, Paced]) -> md.Registry:
    reg = md.Registry(load_entry_points=False)
    for name, (priority, backend) in backends.items():
        reg.register(md.BackendSpec(name, priority, backend))
    return reg


@pytest.fixture
def default_policy(monkeypatch):
    """The environment a user has: no MOE_DISPATCH_POLICY (conftest sets "priority"); and
    the tuner's clock virtual, for the paced backends (``VirtualClock``)."""
    monkeypatch.delenv("MOE_DISPATCH_POLICY", raising=False)
    clock = VirtualClock()
    for module in (_timing, _measure, _tuning):
        monkeypatch.setattr(module, "time", clock)
    _CLOCKS.append(clock)
    yield clock
    _CLOCKS.pop()


def _check(layer, w, tokens, seed=0):
    x, tw, ids = random_routing(CFG, tokens, seed=seed)
    assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_the_default_routes_every_token_count_to_its_fastest_backend(default_policy, tmp_path):
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(_registry(small=(50, small), large=(40, large))):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=tmp_path / "t.json")
        assert layer.policy == "auto"
        layer.load_weights(**w).prepare()
        assert layer.backend == "small"  # the resolver's choice is unchanged
        assert layer.tuned_table == {1: "small", 2: "small", 4: "small", 8: "small", 16: "small",
                                     32: "large", 64: "large"}
        # Probed 1, 8, 64; bisected between 8 and 64 (winners differ): 16, then 32.
        assert set(large.calls) == {1, 8, 16, 32, 64}
        text = layer.explain()
        assert "policy=auto: measured at prepare()" in text and "5 of 7 buckets" in text
        assert "T<=2     small        not measured: nearest measured bucket" in text
        assert "T<=32    large        measured (large " in text
        before = dict(small.calls), dict(large.calls)
        for tokens in (3, 40, 100):  # 100: beyond the last bucket, which takes it
            _check(layer, w, tokens, seed=tokens)
        assert small.calls[3] == before[0].get(3, 0) + 1
        assert large.calls[40] == before[1].get(40, 0) + 1
        assert large.calls[100] == 1


def test_a_clear_loser_is_not_timed_at_larger_buckets(default_policy):
    small, large, slow = Paced(2, 12), Paced(4, 3), Paced(30, 30)
    with md.use_registry(_registry(small=(50, small), large=(40, large), slow=(30, slow))):
        md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False).load_weights(
            **random_weights(CFG)).prepare()
        assert set(slow.calls) == {1, 8}  # 15x slower than the best at T=1 and 8: dropped
        slow.calls.clear()
        md.MoELayer(CFG, policy="fastest", tune_max_tokens=CAP, tuning_cache=False).load_weights(
            **random_weights(CFG)).prepare()
        assert set(slow.calls) == {1, 2, 4, 8, 16, 32, 64}  # "fastest" times everything


def test_a_near_tie_is_timed_again_between_the_best_two_only(default_policy):
    """The best two within RUNOFF_MARGIN get RUNOFF_REPS more rounds; a clear win, none."""
    from moe_dispatch._measure import RUNOFF_MARGIN, RUNOFF_REPS
    assert 10.5 / 10 < 1 + RUNOFF_MARGIN < 20 / 5

    def calls_at_t1(**paced: Paced) -> dict[str, int]:
        with md.use_registry(_registry(**{n: (50 - i, b) for i, (n, b) in enumerate(paced.items())})):
            layer = md.MoELayer(CFG, tune_max_tokens=1, tuning_cache=False, max_candidates=3)
            layer.load_weights(**random_weights(CFG)).prepare()
        return {n: b.calls[1] for n, b in paced.items()}

    near = calls_at_t1(a=Paced(10, 10), b=Paced(10.5, 10.5), c=Paced(20, 20))
    clear = calls_at_t1(a=Paced(5, 5), b=Paced(20, 20), c=Paced(40, 40))
    assert near["a"] - clear["a"] == near["b"] - clear["b"] == RUNOFF_REPS
    assert near["c"] == clear["c"]  # not one of the best two: no runoff


def test_the_budget_bounds_the_first_prepare(default_policy, caplog):
    a, b = Paced(40, 40, scale=1), Paced(45, 45, scale=1)  # ~0.5 s per bucket (2 x 6 calls)
    with md.use_registry(_registry(a=(50, a), b=(40, b))), \
            caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        t0 = time.perf_counter()
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tune_budget_s=0.3, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
        spent = time.perf_counter() - t0
    # T=1 is always measured; T=8 is estimated at 8x T=1's cost and skipped.
    assert set(a.calls) == {1} and spent < 2.0
    assert set(layer.tuned_table.values()) == {"a"}  # every bucket: the nearest measured
    assert any("tuning budget of 0.3 s spent after 1 of 7 buckets" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(md.InvalidArgumentError, match="tune_budget_s=-1"):
        md.MoELayer(CFG, tune_budget_s=-1)


def test_the_table_persists_and_a_hit_measures_nothing(default_policy, tmp_path):
    cache = tmp_path / "tuning.json"
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(_registry(small=(50, small), large=(40, large))):
        first = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=cache).load_weights(**w).prepare()
        entry = next(iter(json.loads(cache.read_text())["entries"].values()))
        assert entry["measured"] == [1, 8, 16, 32, 64]
        small.calls.clear(), large.calls.clear()
        prepared = small.prepared, large.prepared
        again = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=cache).load_weights(**w).prepare()
        assert again.tuned_table == first.tuned_table
        assert not small.calls and not large.calls  # nothing timed
        assert (small.prepared, large.prepared) == (prepared[0] + 1, prepared[1] + 1)  # the winners
        assert "from the tuning cache" in again.explain()
        # "fastest" wants every bucket measured: a probed table is measured again, in full.
        md.MoELayer(CFG, policy="fastest", tune_max_tokens=CAP, tuning_cache=cache).load_weights(
            **w).prepare()
        assert set(large.calls) == {1, 2, 4, 8, 16, 32, 64}


def test_priority_stays_exact(default_policy):
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(_registry(small=(50, small), large=(40, large))):
        layer = md.MoELayer(CFG, policy="priority").load_weights(**w).prepare()
        assert layer.tuned_table is None and large.prepared == 0 and not small.calls
        for tokens in (1, 40):
            _check(layer, w, tokens, seed=tokens)
        assert set(small.calls) == {1, 40} and not large.calls
        assert "routed per token count" not in layer.explain()


def test_auto_times_at_most_three_candidates_by_default(default_policy):
    backends = {f"b{i}": (50 - i, Paced(1 + i, 1 + i)) for i in range(4)}
    with md.use_registry(_registry(**backends)):
        layer = md.MoELayer(CFG, tune_max_tokens=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
        assert [b.prepared for _, b in backends.values()] == [1, 1, 1, 0]  # priority order
        assert "candidates b0, b1, b2" in layer.explain()
        md.MoELayer(CFG, tune_max_tokens=4, max_candidates=4, tuning_cache=False).load_weights(
            **random_weights(CFG)).prepare()
        assert backends["b3"][1].prepared == 1


def test_one_accepting_backend_is_not_timed(default_policy):
    only = Paced(1, 1)
    with md.use_registry(_registry(only=(50, only))):
        layer = md.MoELayer(CFG, tune_max_tokens=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
        assert not only.calls and set(layer.tuned_table.values()) == {"only"}
        assert "one candidate (only): nothing to measure" in layer.explain()


def test_each_bucket_runs_its_route_native_entry(default_policy):
    """Plain calls go to the native entry of the route their token count is routed to;
    tuning timed those entries (what the forward runs)."""
    small, large = Paced(2, 12, entry=True), Paced(4, 3, entry=True)
    w = random_weights(CFG)
    with md.use_registry(_registry(small=(50, small), large=(40, large))):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False).load_weights(**w).prepare()
        assert small.entry_calls and large.entry_calls  # tuning went through the entries
        assert layer.uses_native_entry and layer.plan.native is None  # two routes, two entries
        assert "native entry (fast_call) of large, small" in layer.explain()
        counts = small.entry_calls, large.entry_calls
        _check(layer, w, 2, seed=2)
        _check(layer, w, 50, seed=50)
        assert (small.entry_calls, large.entry_calls) == (counts[0] + 1, counts[1] + 1)
        x, tw, ids = random_routing(CFG, 2, seed=3)
        layer.run(x, tw, ids, native=False)  # the Python path: no entry
        assert (small.entry_calls, large.entry_calls) == (counts[0] + 1, counts[1] + 1)


def test_the_demo_shows_the_default_routing(tmp_path):
    """The README's first command: a fresh process, the user's environment (no policy set)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MOE_DISPATCH_POLICY"}
    env["MOE_DISPATCH_TUNING_CACHE"] = str(tmp_path / "tuning.json")
    out = subprocess.run([sys.executable, "-m", "moe_dispatch.demo", "--small", "--tokens", "8"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "policy='auto'" in out.stdout and "== explain (layer stage)" in out.stdout
    assert "routed per token count" in out.stdout
    assert out.stdout.count("(OK; tolerance") == 4  # bf16 and fp32, at T=1 and T=8


def test_candidates_are_not_prepared_without_the_memory_for_them(default_policy, monkeypatch, caplog):
    """Each extra candidate needs twice the weights' bytes available; short of that it is
    left out (WARNING) and the others are timed."""
    from moe_dispatch import _tuning

    small, large = Paced(2, 12), Paced(4, 3)
    monkeypatch.setattr(_tuning, "available_bytes", lambda: 1024)
    with md.use_registry(_registry(small=(50, small), large=(40, large))), \
            caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
    assert large.prepared == 0 and set(layer.tuned_table.values()) == {"small"}
    assert "'large' not prepared for tuning" in caplog.text
    assert "not tuned: large: not prepared: memory" in layer.explain()


def test_a_backend_with_max_tokens_serves_only_buckets_up_to_it(default_policy):
    """BackendSpec.max_tokens: never timed nor routed above it, under every policy; forced,
    it runs every call."""
    decode, gemm = Paced(1, 1), Paced(4, 3)  # decode is the fastest everywhere it may run
    w = random_weights(CFG)
    reg = md.Registry(load_entry_points=False)
    reg.register(md.BackendSpec("decode", 50, decode, max_tokens=4))
    reg.register(md.BackendSpec("gemm", 40, gemm))
    with md.use_registry(reg):
        for policy in ("auto", "fastest", "priority"):
            decode.calls.clear()
            layer = md.MoELayer(CFG, policy=policy, tune_max_tokens=CAP, tuning_cache=False)
            layer.load_weights(**w).prepare()
            assert layer.tuned_table == {1: "decode", 2: "decode", 4: "decode", 8: "gemm",
                                         16: "gemm", 32: "gemm", 64: "gemm"}, policy
            assert max(decode.calls, default=0) <= 4, (policy, decode.calls)
            for tokens in (3, 5, 100):
                _check(layer, w, tokens, seed=tokens)
            assert decode.calls[5] == 0 and decode.calls[100] == 0 and decode.calls[3] >= 1
            if policy == "priority":
                assert "decode serves T <= 4 (its max_tokens); larger calls run on gemm" in layer.explain()
        forced = md.MoELayer(CFG, backend="decode").load_weights(**w).prepare()
        _check(forced, w, 100)
        assert decode.calls[100] == 1


def test_candidates_dropped_beside_a_decode_kernel_are_timed_where_it_stops(default_policy):
    """gemm is dropped at T=16 (4x slower than decode at T=8 and 16), slow at T=8, but
    decode serves T <= 16 only: at T=32 (bisected between 16 and the probe at 64) both are
    timed again."""
    decode, gemm, slow = Paced(1, 1), Paced(1.5, 4, switch=1), Paced(10, 10)  # gemm: 1.5x, then 4x
    reg = md.Registry(load_entry_points=False)
    reg.register(md.BackendSpec("decode", 50, decode, max_tokens=16))
    reg.register(md.BackendSpec("gemm", 40, gemm))
    reg.register(md.BackendSpec("slow", 30, slow))
    with md.use_registry(reg):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
    assert layer.tuned_table == {1: "decode", 2: "decode", 4: "decode", 8: "decode",
                                 16: "decode", 32: "gemm", 64: "gemm"}
    assert {32, 64} <= set(gemm.calls) and max(decode.calls) <= 16
    assert 32 in slow.calls and 16 not in slow.calls
    assert "T<=32    gemm         measured" in layer.explain()


def test_a_budget_of_zero_measures_t1_only(default_policy):
    a, b = Paced(2, 2), Paced(4, 4)
    with md.use_registry(_registry(a=(50, a), b=(40, b))):
        for policy in ("auto", "fastest"):
            a.calls.clear()
            layer = md.MoELayer(CFG, policy=policy, tune_max_tokens=CAP, tune_budget_s=0,
                                tuning_cache=False)
            layer.load_weights(**random_weights(CFG)).prepare()
            assert set(a.calls) == {1}, policy


def test_a_table_cut_short_or_without_a_candidate_does_not_stand_for_good(default_policy,
                                                                          monkeypatch, tmp_path):
    """A table cut short by the budget is cached with that budget: a layer with the same
    budget reads it (a model's layers tune once), one with a larger budget measures again.
    A table without a candidate that could not be prepared now (memory) serves this
    process's layers of the shape, and is kept out of the file."""
    from moe_dispatch._tuning_cache import TuningCache
    cache = tmp_path / "tuning.json"
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)

    def layer(**kw):
        return md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=cache, **kw).load_weights(
            **w).prepare()
    with md.use_registry(_registry(small=(50, small), large=(40, large))):
        cut = layer(tune_budget_s=0)
        assert "(cached as cut short by the 0 s budget)" in cut.explain()
        small.calls.clear()
        assert "from the tuning cache" in layer(tune_budget_s=0).explain() and not small.calls
        full = layer()  # the default budget: measured again, in full, and cached so
        assert "measured at prepare()" in full.explain() and small.calls
        assert set(full.tuned_table.values()) == {"small", "large"}
        small.calls.clear()
        assert "from the tuning cache" in layer().explain() and not small.calls
        with monkeypatch.context() as m:
            other = tmp_path / "other.json"
            m.setattr(_tuning, "available_bytes", lambda: 1024)
            short = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=other)
            short.load_weights(**w).prepare()
            assert "(kept for this process only: large not measured)" in short.explain()
            again = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=other)
            assert "from the tuning cache" in again.load_weights(**w).prepare().explain()
        assert not other.exists()  # a later process measures it anew
        TuningCache._session.clear()

def test_a_lone_candidate_with_max_tokens_is_routed_past_it(default_policy, monkeypatch):
    """max_candidates=1, or every other candidate left out of the tuning: the buckets above
    the limit go to the next backend, as under policy="priority"."""
    decode, gemm = Paced(1, 1), Paced(4, 3)
    w = random_weights(CFG)
    reg = md.Registry(load_entry_points=False)
    reg.register(md.BackendSpec("decode", 50, decode, max_tokens=4))
    reg.register(md.BackendSpec("gemm", 40, gemm))
    want = {1: "decode", 2: "decode", 4: "decode", 8: "gemm", 16: "gemm", 32: "gemm", 64: "gemm"}
    with md.use_registry(reg):
        alone = md.MoELayer(CFG, tune_max_tokens=CAP, max_candidates=1, tuning_cache=False)
        assert alone.load_weights(**w).prepare().tuned_table == want
        monkeypatch.setattr(_tuning, "available_bytes", lambda: 1024)  # gemm not tuned
        short = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False).load_weights(**w).prepare()
        assert short.tuned_table == want
        assert "no prepared candidate serves every bucket" in short.explain()
        for tokens in (3, 40):
            _check(short, w, tokens, seed=tokens)


def test_a_resolver_choice_that_wins_no_bucket_is_not_kept(default_policy):
    """Its prepared state (a copy of the weights in a real backend) would be held for no
    token count, past max_weight_copies; the layer's backend is then the route of T=1."""
    import gc
    import weakref

    class Holder:
        def __init__(self, weights):
            self.weights = weights

    states: list = []

    class Keeping(Paced):
        def process_weights(self, weights, capabilities):
            state = Holder(super().process_weights(weights, capabilities))
            states.append(weakref.ref(state))
            return state

        def apply(self, state, x, tw, ids):
            return super().apply(state.weights, x, tw, ids)

    slow, fast = Keeping(9, 9), Paced(1, 1)  # slow is the priority choice, fast wins all
    with md.use_registry(_registry(slow=(50, slow), fast=(40, fast))):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False)
        w = random_weights(CFG)
        layer.load_weights(**w).prepare()
        assert set(layer.tuned_table.values()) == {"fast"} and layer.backend == "fast"
        gc.collect()
        assert states and all(ref() is None for ref in states)
        _check(layer, w, 3)


def test_explain_names_every_backend_the_tuning_left_out_and_why(default_policy):
    """A backend whose supports_layer says no, one whose process_weights raises and one whose
    tuning call fails: each named with its reason, none listed as a candidate."""
    class Picky(Paced):
        def supports_layer(self, weights, capabilities):
            return md.reject("REASON-B")

    class Broken(Paced):
        def process_weights(self, weights, capabilities):
            raise RuntimeError("REASON-C")

    class Failing(Paced):
        def apply(self, state, x, tw, ids):
            raise RuntimeError("REASON-D")

    backends = dict(a=(50, Paced(2, 2)), b=(40, Picky(1, 1)), c=(30, Broken(1, 1)),
                    d=(20, Failing(1, 1)))
    with md.use_registry(_registry(**backends)):
        layer = md.MoELayer(CFG, tune_max_tokens=4, max_candidates=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
    text = layer.explain()
    assert ("candidates a; not tuned: b: rejects the layer: REASON-B; c: could not be prepared "
            "(RuntimeError: REASON-C); d: failed a tuning call (RuntimeError: REASON-D)") in text, text
