"""policy="fastest" (autotuning with a persistent, validated cache) and the tuning that
policy="auto" shares with it: buckets, the winner rule, the budget, progress, cache hits and
failing candidates. torch.compile, torch.jit.trace and hooks: tests/test_compile_and_hooks.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import moe_dispatch as md
from helpers import TOLERANCE, random_routing, random_weights, reference, rel_error
from moe_dispatch._plan import bucket_index
from moe_dispatch._buckets import bucket_sizes, pick_winner
from moe_dispatch._tuning_cache import CACHE_VERSION

CFG = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)


def test_buckets_and_lookup():
    assert bucket_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    n = 10
    assert [bucket_index(t, n) for t in (1, 2, 3, 4, 5, 512, 513, 10_000)] == [0, 1, 2, 2, 3, 9, 9, 9]


def test_winner_rule_keeps_the_priority_choice_in_a_near_tie():
    assert pick_winner({"zentorch": 10.1, "onednn": 10.0}, "zentorch") == "zentorch"  # 1%: tie
    assert pick_winner({"zentorch": 10.5, "onednn": 10.0}, "zentorch") == "onednn"  # 5%: switch
    assert pick_winner({"zentorch": 10.0, "onednn": 10.0}, "onednn") == "onednn"
    assert pick_winner({"a": 3.0, "b": 3.0}, "gone") == "a"  # exact tie: by name
    assert pick_winner({"a": 3.0, "b": 2.0}, "a", margin=0.6) == "a"


def test_policy_argument_and_env_validated(monkeypatch):
    with pytest.raises(md.InvalidArgumentError, match="policy='fast'"):
        md.MoELayer(CFG, policy="fast")
    monkeypatch.setenv("MOE_DISPATCH_POLICY", "fastest")
    assert md.MoELayer(CFG).policy == "fastest"
    monkeypatch.delenv("MOE_DISPATCH_POLICY")
    assert md.MoELayer(CFG).policy == "auto"  # the default
    for bad in (-1, "5", True, float("nan")):
        with pytest.raises(md.InvalidArgumentError, match="tune_budget_s"):
            md.MoELayer(CFG, tune_budget_s=bad)


def test_fastest_tunes_persists_and_stays_correct(tmp_path):
    cache = tmp_path / "tuning.json"
    w = random_weights(CFG)
    layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=16, tuning_cache=cache)
    layer.load_weights(**w).prepare()
    table = layer.tuned_table
    assert sorted(table) == [1, 2, 4, 8, 16]
    accepting = {c.name for c in md.resolve(CFG).candidates if c.decision.accepted}
    assert set(table.values()) <= accepting
    assert "policy=fastest: measured at prepare()" in layer.explain()
    for t in (1, 3, 16, 40):  # 40 > cap: the last bucket's winner
        x, tw, ids = random_routing(CFG, t, seed=t)
        assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
    data = json.loads(cache.read_text())
    assert data["version"] == CACHE_VERSION and len(data["entries"]) == 1
    entry = next(iter(data["entries"].values()))
    assert {int(k) for k in entry["buckets"]} == {1, 2, 4, 8, 16}
    # A second layer reads the cache instead of timing again.
    again = md.MoELayer(CFG, policy="fastest", tune_max_tokens=16, tuning_cache=cache)
    again.load_weights(**w).prepare()
    assert again.tuned_table == table and "from the tuning cache" in again.explain()


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 99, "entries": {}}',
                                     '{"version": VERSION, "entries": {"KEY": {"buckets": {"1": "no_such_backend"}}}}',
                                     '{"version": OLDER, "entries": {}}'])
def test_corrupt_or_stale_cache_is_ignored_with_warning(tmp_path, content, caplog):
    cache = tmp_path / "tuning.json"
    if "KEY" in content:  # a stale entry under the real key
        probe = md.MoELayer(CFG, policy="fastest", tune_max_tokens=2, tuning_cache=cache)
        probe.load_weights(**random_weights(CFG)).prepare()
        key = next(iter(json.loads(cache.read_text())["entries"]))
        content = content.replace("KEY", key)
    cache.write_text(content.replace("OLDER", str(CACHE_VERSION - 1))
                     .replace("VERSION", str(CACHE_VERSION)))
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=2, tuning_cache=cache)
        layer.load_weights(**random_weights(CFG)).prepare()
    assert layer.tuned_table is not None
    assert any("tuning cache" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert json.loads(cache.read_text())["version"] == CACHE_VERSION  # rewritten as valid data


def test_max_candidates_caps_the_tuned_set(tmp_path):
    layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=2, max_candidates=1, tuning_cache=False)
    layer.load_weights(**random_weights(CFG)).prepare()
    assert set(layer.tuned_table.values()) == {layer.backend}


def test_forced_backend_is_not_tuned():
    layer = md.MoELayer(CFG, backend="torch", policy="fastest", tuning_cache=False)
    layer.load_weights(**random_weights(CFG)).prepare()
    assert layer.tuned_table is None


def test_tuning_budget_spent_falls_back_to_the_priority_choice(caplog):
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=8, tune_budget_s=0.0,
                            tuning_cache=False)
        layer.load_weights(**random_weights(CFG)).prepare()
    # T=1 is measured whatever the budget; the buckets after it take the priority choice.
    assert {v for t, v in layer.tuned_table.items() if t > 1} == {layer.backend}
    assert any("tuning budget" in r.message for r in caplog.records)
    assert "not measured (budget spent): the priority choice" in layer.explain()


def test_tuning_reports_progress_after_a_second(caplog):
    """measure() logs one INFO line per bucket once tuning has run for more than a second."""
    import time as _time

    from moe_dispatch._measure import measure

    def slow(x, tw, ids):
        _time.sleep(0.05)  # 2 runners x 6 calls x 50 ms: ~0.6 s per bucket
        return x

    with caplog.at_level(logging.INFO, logger="moe_dispatch"):
        table, timings, complete = measure({"a": slow, "b": slow}, CFG, [1, 2, 4], budget_s=60.0, default="a")
    progress = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert progress and all("tuning" in m and "bucket" in m for m in progress)
    assert "bucket 3/3 (T=4)" in progress[-1]
    assert sorted(table) == [1, 2, 4] and set(timings) == {1, 2, 4} and complete


class _CountingLoop(md.BackendBase):
    """The torch loop under another name, counting how often it is prepared."""

    def __init__(self) -> None:
        self.prepared = 0

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        self.prepared += 1
        return weights

    def apply(self, state, x, tw, ids):
        from moe_dispatch.kernels import expert_loop
        return expert_loop(state, x, tw, ids)


def test_a_cache_hit_prepares_only_the_winners(tmp_path):
    a, b = _CountingLoop(), _CountingLoop()
    reg = md.Registry(load_entry_points=False)
    reg.register(md.BackendSpec("loop_a", 50, a))
    reg.register(md.BackendSpec("loop_b", 40, b))
    cache = tmp_path / "tuning.json"
    w = random_weights(CFG)
    with md.use_registry(reg):
        md.MoELayer(CFG, policy="fastest", tune_max_tokens=2, tuning_cache=cache).load_weights(**w).prepare()
        assert (a.prepared, b.prepared) == (1, 1)  # measured: both prepared
        data = json.loads(cache.read_text())
        entry = next(iter(data["entries"].values()))
        for winners, b_prepared in ((["loop_a", "loop_a"], 1), (["loop_a", "loop_b"], 2)):
            entry["buckets"] = {"1": winners[0], "2": winners[1]}
            cache.write_text(json.dumps(data))
            layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=2, tuning_cache=cache)
            layer.load_weights(**w).prepare()
            assert layer.tuned_table == {1: winners[0], 2: winners[1]}
            assert b.prepared == b_prepared  # loop_b is prepared only when it won a bucket
            x, tw, ids = random_routing(CFG, 2, seed=2)
            assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_a_candidate_that_fails_while_tuning_is_dropped(tmp_path, caplog):
    """policy="fastest": a backend whose kernel raises is not timed and wins no bucket;
    prepare() still succeeds on the others."""
    from helpers import torch_and

    class Broken(md.BackendBase):
        def supports_config(self, config, capabilities):
            return md.accept()

        def process_weights(self, weights, capabilities):
            return weights

        def apply(self, state, x, tw, ids):
            raise RuntimeError("broken kernel")

    with md.use_registry(torch_and(md.BackendSpec("broken", -5, Broken()))):
        cfg = md.MoEConfig(4, 2, 32, 16, dtype=torch.float32)
        layer = md.MoELayer(cfg, policy="fastest", tune_max_tokens=2, tuning_cache=False)
        layer.load_weights(**random_weights(cfg)).prepare()
        assert set(layer.tuned_table.values()) == {"torch"}
        assert "failed a tuning call" in caplog.text
