"""What bounds the default policy's tuning: its time budget, the tuning cache (and what it
keeps out), the memory for extra candidates, and a backend's max_tokens (never timed nor
routed above it). The backends are paced on a virtual clock (tests/paced.py): no test asserts
a real kernel's timing."""

from __future__ import annotations

import json
import logging
import time

import pytest

import moe_dispatch as md
from moe_dispatch import _tuning
from moe_dispatch.testing import random_weights

from paced import CAP, CFG, Paced, check_routed, default_policy, paced_registry  # noqa: F401  (default_policy: a fixture)


def test_the_budget_bounds_the_first_prepare(default_policy, caplog):
    a, b = Paced(40, 40, scale=1), Paced(45, 45, scale=1)  # ~0.5 s per bucket (2 x 6 calls)
    with md.use_registry(paced_registry(a=(50, a), b=(40, b))), \
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


def test_a_budget_of_zero_measures_t1_only(default_policy):
    a, b = Paced(2, 2), Paced(4, 4)
    with md.use_registry(paced_registry(a=(50, a), b=(40, b))):
        for policy in ("auto", "fastest"):
            a.calls.clear()
            layer = md.MoELayer(CFG, policy=policy, tune_max_tokens=CAP, tune_budget_s=0,
                                tuning_cache=False)
            layer.load_weights(**random_weights(CFG)).prepare()
            assert set(a.calls) == {1}, policy


def test_the_table_persists_and_a_hit_measures_nothing(default_policy, tmp_path):
    cache = tmp_path / "tuning.json"
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))):
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
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))):
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


def test_candidates_are_not_prepared_without_the_memory_for_them(default_policy, monkeypatch, caplog):
    """Each extra candidate needs twice the weights' bytes available; short of that it is
    left out (WARNING) and the others are timed."""
    from moe_dispatch import _tuning

    small, large = Paced(2, 12), Paced(4, 3)
    monkeypatch.setattr(_tuning, "available_bytes", lambda: 1024)
    with md.use_registry(paced_registry(small=(50, small), large=(40, large))), \
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
                check_routed(layer, w, tokens, seed=tokens)
            assert decode.calls[5] == 0 and decode.calls[100] == 0 and decode.calls[3] >= 1
            if policy == "priority":
                assert "decode serves T <= 4 (its max_tokens); larger calls run on gemm" in layer.explain()
        forced = md.MoELayer(CFG, backend="decode").load_weights(**w).prepare()
        check_routed(forced, w, 100)
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
            check_routed(short, w, tokens, seed=tokens)
