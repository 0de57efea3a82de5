"""The default policy ("auto"): each token count runs the backend measured fastest for it;
which candidates are timed, where, and how often; what explain() says of them. What bounds the
tuning (budget, cache, memory, a backend's max_tokens): test_default_routing_limits.py. The
backends are paced on a virtual clock (tests/paced.py): no test asserts a real kernel's
timing."""

from __future__ import annotations

import moe_dispatch as md
from moe_dispatch.testing import random_routing, random_weights

from paced import CAP, CFG, Paced, check_routed, default_policy, paced_registry  # noqa: F401  (default_policy: a fixture)


def test_the_default_routes_every_token_count_to_its_fastest_backend(default_policy, tmp_path):
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))):
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
            check_routed(layer, w, tokens, seed=tokens)
        assert small.calls[3] == before[0].get(3, 0) + 1
        assert large.calls[40] == before[1].get(40, 0) + 1
        assert large.calls[100] == 1


def test_a_clear_loser_is_not_timed_at_larger_buckets(default_policy):
    small, large, slow = Paced(2, 12), Paced(4, 3), Paced(30, 30)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large), slow=(30, slow))):
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
        with md.use_registry(paced_registry(**{n: (50 - i, b) for i, (n, b) in enumerate(paced.items())})):
            layer = md.MoELayer(CFG, tune_max_tokens=1, tuning_cache=False, max_candidates=3)
            layer.load_weights(**random_weights(CFG)).prepare()
        return {n: b.calls[1] for n, b in paced.items()}

    near = calls_at_t1(a=Paced(10, 10), b=Paced(10.5, 10.5), c=Paced(20, 20))
    clear = calls_at_t1(a=Paced(5, 5), b=Paced(20, 20), c=Paced(40, 40))
    assert near["a"] - clear["a"] == near["b"] - clear["b"] == RUNOFF_REPS
    assert near["c"] == clear["c"]  # not one of the best two: no runoff


def test_priority_stays_exact(default_policy):
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))):
        layer = md.MoELayer(CFG, policy="priority").load_weights(**w).prepare()
        assert layer.tuned_table is None and large.prepared == 0 and not small.calls
        for tokens in (1, 40):
            check_routed(layer, w, tokens, seed=tokens)
        assert set(small.calls) == {1, 40} and not large.calls
        assert "routed per token count" not in layer.explain()


def test_auto_times_at_most_three_candidates_by_default(default_policy):
    backends = {f"b{i}": (50 - i, Paced(1 + i, 1 + i)) for i in range(4)}
    with md.use_registry(paced_registry(**backends)):
        layer = md.MoELayer(CFG, tune_max_tokens=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
        assert [b.prepared for _, b in backends.values()] == [1, 1, 1, 0]  # priority order
        assert "candidates b0, b1, b2" in layer.explain()
        md.MoELayer(CFG, tune_max_tokens=4, max_candidates=4, tuning_cache=False).load_weights(
            **random_weights(CFG)).prepare()
        assert backends["b3"][1].prepared == 1


def test_one_accepting_backend_is_not_timed(default_policy):
    only = Paced(1, 1)
    with md.use_registry(paced_registry(only=(50, only))):
        layer = md.MoELayer(CFG, tune_max_tokens=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
        assert not only.calls and set(layer.tuned_table.values()) == {"only"}
        assert "one candidate (only): nothing to measure" in layer.explain()


def test_each_bucket_runs_its_route_native_entry(default_policy):
    """Plain calls go to the native entry of the route their token count is routed to;
    tuning timed those entries (what the forward runs)."""
    small, large = Paced(2, 12, entry=True), Paced(4, 3, entry=True)
    w = random_weights(CFG)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False).load_weights(**w).prepare()
        assert small.entry_calls and large.entry_calls  # tuning went through the entries
        assert layer.uses_native_entry and layer.plan.native is None  # two routes, two entries
        assert "native entry (fast_call) of large, small" in layer.explain()
        counts = small.entry_calls, large.entry_calls
        check_routed(layer, w, 2, seed=2)
        check_routed(layer, w, 50, seed=50)
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
    with md.use_registry(paced_registry(slow=(50, slow), fast=(40, fast))):
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False)
        w = random_weights(CFG)
        layer.load_weights(**w).prepare()
        assert set(layer.tuned_table.values()) == {"fast"} and layer.backend == "fast"
        gc.collect()
        assert states and all(ref() is None for ref in states)
        check_routed(layer, w, 3)


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
    with md.use_registry(paced_registry(**backends)):
        layer = md.MoELayer(CFG, tune_max_tokens=4, max_candidates=4, tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
    text = layer.explain()
    assert ("candidates a; not tuned: b: rejects the layer: REASON-B; c: could not be prepared "
            "(RuntimeError: REASON-C); d: failed a tuning call (RuntimeError: REASON-D)") in text, text
