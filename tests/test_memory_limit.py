"""``max_weight_copies``: the copies of the weights a layer's backends may hold together.

The resolver leaves out a backend that alone declares more (``BackendSpec.weight_copies``);
the default routing keeps to a set of backends that fits. Paced backends (tests/paced.py)
make the timings known; the built-ins' declarations are checked on simulated machines.
"""

from __future__ import annotations

import math

import pytest
import torch

import moe_dispatch as md
from moe_dispatch._memory import within_memory
from moe_dispatch.testing import machine, random_weights

from paced import CAP, CFG, Paced, check_routed, default_policy  # noqa: F401 (a fixture)

ZEN4 = machine("zen4")


def _registry(**backends):
    reg = md.Registry(load_entry_points=False)
    for name, (priority, backend, copies) in backends.items():
        reg.register(md.BackendSpec(name, priority, backend, weight_copies=copies))
    return reg


def test_weight_copies_is_declared_and_validated():
    spec = md.BackendSpec("x", 1, Paced(1, 1))
    assert spec.copies() == 1.0 and spec.copies("int4") == 1.0
    spec = md.BackendSpec("x", 1, Paced(1, 1), weight_copies={"int8": 2, "float": 0})
    assert (spec.copies("int8"), spec.copies("float"), spec.copies("int4")) == (2.0, 0.0, 1.0)
    for bad in (-1, math.inf, "2", {"int9": 1}, {"int8": -0.5}, True):
        with pytest.raises(ValueError, match="weight_copies"):
            md.BackendSpec("x", 1, Paced(1, 1), weight_copies=bad)


@pytest.mark.parametrize("bad", [-1, "1", True, [1]])
def test_a_bad_limit_names_the_argument(bad):
    with pytest.raises(md.InvalidArgumentError, match="max_weight_copies"):
        md.MoELayer(CFG, max_weight_copies=bad)
    with pytest.raises(md.InvalidArgumentError, match="max_weight_copies"):
        md.resolve(CFG, max_weight_copies=bad)


def test_a_backend_over_the_limit_is_left_out_with_the_reason_and_runs_forced():
    with md.use_registry(_registry(big=(50, Paced(1, 1), 2.0), lean=(40, Paced(1, 1), 1.0))):
        assert md.resolve(CFG).backend == "big"  # float weights: no limit by default
        res = md.resolve(CFG, max_weight_copies=1.5)
        big = next(c for c in res.candidates if c.name == "big")
        assert res.backend == "lean" and str(big.status) == "excluded"
        assert big.reason == ("holds 2 copies of the float weights (its weight_copies), over the "
                              "layer's max_weight_copies=1.5")
        assert "max_weight_copies=1.5" in md.explain(CFG, max_weight_copies=1.5)
        assert md.resolve(CFG, backend="big", max_weight_copies=1.5).backend == "big"
        with pytest.raises(md.NoBackendError, match="over the layer's max_weight_copies=0.5"):
            md.resolve(CFG, max_weight_copies=0.5)


def test_the_default_routing_keeps_to_the_set_that_fits(default_policy):
    """small wins up to 16 tokens, large above: together 3 copies. Within 2.5, the set that
    loses least over the measured buckets is large alone (2x slower at 1, 8 and 16 tokens)
    rather than small alone (4x slower at 32 and 64)."""
    small, large = Paced(2, 12), Paced(4, 3)
    w = random_weights(CFG)
    with md.use_registry(_registry(small=(50, small, 1.0), large=(40, large, 2.0))):
        free = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False).load_weights(**w).prepare()
        assert set(free.tuned_table.values()) == {"small", "large"}
        layer = md.MoELayer(CFG, tune_max_tokens=CAP, tuning_cache=False, max_weight_copies=2.5)
        layer.load_weights(**w).prepare()
        assert set(layer.tuned_table.values()) == {"large"}
        assert "routed within max_weight_copies=2.5: large" in layer.explain()
        assert "left out: small (1)" in layer.explain()
        for tokens in (3, 40):
            check_routed(layer, w, tokens, seed=tokens)


def test_within_memory_on_tables():
    sizes = [1, 2, 4, 8]
    timings = {1: {"a": 1.0, "b": 2.0, "c": 1.5}, 8: {"a": 9.0, "b": 4.0, "c": 5.0}}
    table = {1: "a", 2: "a", 4: "b", 8: "b"}
    copies = {"a": 1.0, "b": 1.0, "c": 0.0}
    assert within_memory(table, timings, sizes, copies, 2.0) == (table, "")
    # Within 1 copy: a + c loses log(1) + log(5/4) to the fastest, b + c log(1.5) + 0, and
    # every single backend more; bucket 4 (b's) takes c, the set's fastest at bucket 8.
    out, note = within_memory(table, timings, sizes, copies, 1.0)
    assert out == {1: "a", 2: "a", 4: "c", 8: "c"} and "a, c" in note and "left out: b (1)" in note
    # Nothing measured: nothing to choose by, the table stands.
    assert within_memory(table, {}, sizes, copies, 1.0) == (table, "")
    # A bucket moved off b goes only to a backend that serves it (c declares T <= 4).
    out, _ = within_memory(table, timings, sizes, copies, 1.0, lambda n, t: n != "c" or t <= 4)
    assert out == {1: "a", 2: "a", 4: "c", 8: "a"}


def test_quantized_layers_hold_one_copy_by_default():
    """On a simulated Zen 4 zentorch's quantized op (about two copies: its cache and its
    buffer) is left out of a quantized config by default and competes when the limit is
    lifted; float configs are unchanged."""
    cfg = md.MoEConfig(8, 2, 256, 128, dtype=torch.bfloat16, weight_scheme=md.QuantScheme("int8"))
    res = md.resolve(cfg, capabilities=ZEN4)
    zen = next(c for c in res.candidates if c.name == "zentorch")
    assert str(zen.status) == "excluded" and "max_weight_copies=1.1" in zen.reason
    kept = [c.name for c in res.candidates if c.decision.accepted]
    assert "native" in kept and all(res.record(n).spec.copies("int8") <= 1.1 for n in kept)
    lifted = md.resolve(cfg, capabilities=ZEN4, max_weight_copies=math.inf)
    assert lifted.backend == "zentorch"
    assert md.resolve(md.MoEConfig(8, 2, 256, 128, dtype=torch.bfloat16), capabilities=ZEN4).backend == "zentorch"
