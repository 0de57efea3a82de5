"""Native entries for plain calls (BackendBase.fast_call): the layer's contract, on a
pure-Python backend with a fast_call, everywhere (both call paths: the C call slot and the
Python ``__call__``). The zentorch backend's C++ entry, for real: tests/test_zentorch_entry.py;
the toolkit's module builds: tests/test_native_build.py."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

import pytest
import torch

import moe_dispatch as md
from helpers import TOLERANCE, random_routing, random_weights, reference, rel_error, torch_and
from moe_dispatch_backends import torch_loop

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


class EntryBackend(md.BackendBase):
    """The torch loop, plus a fast_call entry that counts calls and declines, returns or
    raises as told."""

    def __init__(self, mode: str = "run") -> None:
        self.mode = mode
        self.entry_calls = self.apply_calls = 0
        self.guards: list[md.FastGuard] = []

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        return torch_loop.TorchLoopBackend().process_weights(weights, capabilities)

    def apply(self, state, x, tw, ids):
        self.apply_calls += 1
        return torch_loop.TorchLoopBackend().apply(state, x, tw, ids)

    def fast_call(self, state, guard):
        self.guards.append(guard)
        if self.mode == "broken_at_prepare":
            raise RuntimeError("cannot build the entry")

        def entry(x, tw, ids):
            self.entry_calls += 1
            if self.mode == "decline" or torch._C._get_tracing_state():
                return None  # declined (inside torch.jit.trace, as the contract asks)
            if self.mode == "raise":
                raise RuntimeError("native kernel status -7")
            return torch_loop.TorchLoopBackend().apply(state, x, tw, ids)
        return entry


@contextlib.contextmanager
def _entry_layer(mode: str = "run") -> Iterator[tuple[EntryBackend, md.MoELayer, dict]]:
    """(backend, prepared layer on it, the caller's weights), the backend registered first
    in front of the torch loop."""
    backend = EntryBackend(mode)
    with md.use_registry(torch_and(md.BackendSpec("entry", 900, backend))):
        weights = random_weights(CFG)
        yield backend, md.MoELayer(CFG).load_weights(**weights).prepare(), weights


# -- the layer's contract (any backend) ---------------------------------------------------
@pytest.mark.usefixtures("call_path")
def test_plain_calls_take_the_entry_and_the_guard_names_the_canonical_weights():
    with _entry_layer() as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 5)
        out = layer(x, tw, ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 0
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
        guard = backend.guards[-1]
        assert guard.watched[0] is w["w13"] and guard.watched[1] is w["w2"]
        assert guard.versions == tuple(t._version for t in guard.watched)
        # keyword arguments take the Python path; with a hook, forward runs the entry
        layer(hidden_states=x, topk_weights=tw, topk_ids=ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 1
        seen = []
        handle = layer.register_forward_hook(lambda mod, args, out: seen.append(out))
        assert torch.equal(layer(x, tw, ids), out) and len(seen) == 1
        handle.remove()
        assert backend.entry_calls == 2 and backend.apply_calls == 1
        # torch.jit.trace records the layer's op (moe_dispatch::moe_forward), whose run is
        # not traced (so the entry serves it); the trace, when it runs, runs the layer, entry
        # included, for any routing
        with warnings.catch_warnings():  # deprecation and data-dependent-branch warnings
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(layer, (x, tw, ids), check_trace=False)
        assert "moe_dispatch::moe_forward" in str(traced.graph) and backend.apply_calls == 1
        calls = backend.entry_calls
        assert torch.allclose(traced(x, tw, ids), out)
        assert backend.entry_calls == calls + 1 and backend.apply_calls == 1
        x2, tw2, ids2 = random_routing(CFG, 9, seed=21)
        assert torch.allclose(traced(x2, tw2, ids2), layer(x2, tw2, ids2))


def test_a_tuned_layer_takes_the_entry_when_one_backend_wins_every_bucket():
    backend = EntryBackend()
    with md.use_registry(torch_and(md.BackendSpec("entry", 900, backend))):
        layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=4, max_candidates=1,
                            tuning_cache=False).load_weights(**random_weights(CFG)).prepare()
        assert set(layer.tuned_table.values()) == {"entry"} and layer.uses_native_entry
        assert layer.plan.native is not None  # one route for every bucket: its entry
        layer(*random_routing(CFG, 3))
        assert backend.entry_calls == 1


@pytest.mark.usefixtures("call_path")
def test_a_declined_call_runs_the_python_path():
    with _entry_layer("decline") as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 4)
        out = layer(x, tw, ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 1
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@pytest.mark.usefixtures("call_path")
def test_an_entry_that_raises_is_a_kernel_failure(caplog):
    with _entry_layer("raise") as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 4)
        with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
            out = layer(x, tw, ids)
        assert layer.backend == "torch" and layer.demotions[0].backend == "entry"
        assert "native kernel status -7" in layer.demotions[0].error
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
        assert sum("demoted" in r.message for r in caplog.records) == 1


@pytest.mark.usefixtures("call_path")
def test_bad_input_is_the_callers_error_even_if_the_entry_raises_on_it():
    # a careless entry: it raises instead of declining
    with _entry_layer("raise") as (backend, layer, _):
        x, tw, ids = random_routing(CFG, 3)
        ids[0, 0] = 99
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, ids)
        assert layer.demotions == () and layer.backend == "entry"


def test_fast_call_failing_at_prepare_costs_speed_only(caplog):
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"), \
            _entry_layer("broken_at_prepare") as (backend, layer, w):
        assert layer.backend == "entry" and not layer.uses_native_entry
        assert any("cannot build the entry" in r.message for r in caplog.records)
        x, tw, ids = random_routing(CFG, 2)
        assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_in_place_weight_change_is_caught_with_an_entry():
    # a correct entry declines a changed version
    with _entry_layer("decline") as (backend, layer, w):
        w["w13"].mul_(1.0)
        with pytest.raises(md.WeightsModifiedError):
            layer(*random_routing(CFG, 2))
