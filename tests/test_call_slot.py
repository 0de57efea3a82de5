"""MoELayer's C call slot (moe_dispatch/_call_slot.cpp): the plain calls it runs itself, and
every other call, which it hands to the Python ``__call__`` with the same result.

Every layer test runs through the slot where it builds (it is installed at the first
``prepare()`` with a native entry); the call-path tests of test_native.py and
test_compile_and_hooks.py run once per path (the ``call_path`` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
import torch

import moe_dispatch as md
from moe_dispatch import _call_slot
from moe_dispatch._layer_calls import LayerCalls

from helpers import random_routing, random_weights, torch_and
from test_native import CFG, EntryBackend, _entry_layer


@pytest.fixture
def slot():
    if not _call_slot.active():
        pytest.skip(f"the call slot is not in use here: {_call_slot.describe()}")
    yield
    _call_slot.set_active(True)


def _on_and_off(call):
    """call() through the slot, then through the Python __call__: (both results, or for an
    exception its type, message and __context__'s type; calls the slot ran itself)."""
    results, before = [], _call_slot.taken()
    for on in (True, False):
        _call_slot.set_active(on)
        try:
            results.append(call())
        except Exception as exc:  # the same error either way
            results.append((type(exc), str(exc), type(exc.__context__)))
        finally:
            _call_slot.set_active(True)
    return results, _call_slot.taken() - before


def _same(on, off):
    return on == off if isinstance(on, tuple) else torch.equal(on, off)


def test_a_plain_call_runs_from_the_slot(slot):
    with _entry_layer() as (backend, layer, _):
        x, tw, ids = random_routing(CFG, 5)
        (on, off), taken = _on_and_off(lambda: layer(x, tw, ids))
        assert torch.equal(on, off) and taken == 1
        assert backend.entry_calls == 2 and backend.apply_calls == 0
        # What dynamo traces, what a subclass inherits: the Python __call__.
        assert type(layer).__call__ is LayerCalls.__call__ and _call_slot.active()
        assert "in use on MoELayer" in _call_slot.describe()


class _Sub(md.MoELayer):
    pass


@pytest.mark.parametrize("case", ["keywords", "four arguments", "module hook", "global hook",
                                  "instance forward", "compile session", "subclass", "declined"])
def test_every_other_call_goes_to_the_python_call(slot, case, monkeypatch):
    with _entry_layer("decline" if case == "declined" else "run") as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 4, seed=2)
        call = lambda: layer(x, tw, ids)  # noqa: E731
        if case == "keywords":
            call = lambda: layer(x, tw, topk_ids=ids)  # noqa: E731
        elif case == "four arguments":
            call = lambda: layer(x, tw, ids, ids)  # noqa: E731
        elif case == "module hook":
            layer.register_forward_hook(lambda mod, args, out: out * 2)
        elif case == "global hook":
            handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: out + 1)
        elif case == "instance forward":
            layer.forward = lambda *args: args[0] * 3
        elif case == "compile session":  # export and compile sessions set the flag
            monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        elif case == "subclass":
            layer = _Sub(CFG).load_weights(**w).prepare()
        try:
            (on, off), taken = _on_and_off(call)
        finally:
            if case == "global hook":
                handle.remove()
        assert taken == 0 and _same(on, off)
        if case == "declined":  # the entry is asked once per call, never again by __call__
            assert backend.entry_calls == 2 and backend.apply_calls == 2


def test_a_plain_call_with_empty_keywords_runs_from_the_slot(slot):
    with _entry_layer() as (_, layer, _w):
        args = random_routing(CFG, 3)
        (on, off), taken = _on_and_off(lambda: layer(*args, **{}))
        assert taken == 1 and _same(on, off)


def test_an_entrys_exception_is_handled_as_in_the_python_call(slot):
    """_entry_failed runs with the entry's exception as the one being handled, as in the
    Python __call__'s except clause: what it raises has it as __context__, inside the
    caller's own except clause too."""
    with _entry_layer("raise") as (backend, layer, _):
        x, tw, ids = random_routing(CFG, 3)
        ids[0, 0] = 99  # the caller's error: InvalidArgumentError, no demotion

        def inside_an_except():
            try:
                raise KeyError("the caller's own")
            except KeyError:
                return layer(x, tw, ids)

        for call in (lambda: layer(x, tw, ids), inside_an_except):
            (on, off), taken = _on_and_off(call)
            assert on == off == (md.InvalidArgumentError, on[1], RuntimeError) and taken == 0
        assert layer.demotions == ()


class _Interrupting(EntryBackend):
    def fast_call(self, state, guard):
        def entry(x, tw, ids):
            self.entry_calls += 1
            raise KeyboardInterrupt
        return entry


def test_a_keyboard_interrupt_in_the_entry_propagates(slot):
    backend = _Interrupting()
    with md.use_registry(torch_and(md.BackendSpec("entry", 900, backend))):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        for on in (True, False):
            _call_slot.set_active(on)
            with pytest.raises(KeyboardInterrupt):
                layer(*random_routing(CFG, 2))
        _call_slot.set_active(True)
        assert backend.entry_calls == 2 and layer.demotions == () and layer.backend == "entry"


def test_the_slot_reads_the_bucket_of_the_calls_token_count(slot):
    with _entry_layer() as (backend, layer, _w):
        pair = layer.plan.natives[0]
        # buckets of 1 token, 2, 3-4 and 5 or more (the last clamps): two without an entry
        layer._plan = attrs.evolve(layer.plan, natives=(pair, None, pair, None))
        assert layer.plan.single is None
        for tokens, taken_here in ((1, 1), (2, 0), (3, 1), (4, 1), (5, 0), (40, 0)):
            args = random_routing(CFG, tokens, seed=tokens)
            (on, off), taken = _on_and_off(lambda: layer(*args))
            assert torch.equal(on, off) and taken == taken_here, tokens
        # not a 2-D tensor: no bucket, no entry (the Python path raises the shape error)
        x, tw, ids = random_routing(CFG, 3)
        calls = backend.entry_calls
        (on, off), taken = _on_and_off(lambda: layer(x[None], tw, ids))
        assert on == off and issubclass(on[0], md.MoEDispatchError)
        assert taken == 0 and backend.entry_calls == calls


def test_a_reassigned_call_takes_the_slot_out(slot):
    """CPython resets a class's call slot where __call__ is assigned on it: from then on the
    Python __call__ runs every call, whatever it was replaced with."""
    with _entry_layer() as (_, layer, _w):
        seen = []

        def patched(self, *args, **kwargs):
            seen.append(len(args))
            return LayerCalls.__call__(self, *args, **kwargs)

        md.MoELayer.__call__ = patched
        try:
            assert not _call_slot.active() and "was assigned since" in _call_slot.describe()
            with pytest.raises(RuntimeError, match="not the one the slot was installed for"):
                _call_slot.set_active(True)  # the slot would skip the patch
            before = _call_slot.taken()
            layer(*random_routing(CFG, 2))
            assert seen == [3] and _call_slot.taken() == before
        finally:
            del md.MoELayer.__call__
        assert not _call_slot.active() and "switched off" in _call_slot.describe()
        _call_slot.set_active(True)
        assert _call_slot.active()


def test_the_off_switch():
    env = dict(os.environ, MOE_DISPATCH_CALL_SLOT="0")
    code = ("import moe_dispatch as md; from moe_dispatch import _call_slot; "
            "assert not _call_slot.install(md.MoELayer); print(_call_slot.describe())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "off (MOE_DISPATCH_CALL_SLOT=0)" in out


def test_a_keyboard_interrupt_while_the_slot_reads_the_call_propagates(slot):
    """The slot reads x.shape for a bucket table, which a TorchFunctionMode sees: an
    interrupt there propagates as it does from the Python __call__'s read of x.ndim."""
    from torch.overrides import TorchFunctionMode

    class _InterruptOnce(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.armed = True

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if self.armed and getattr(func, "__name__", "") == "__get__":
                self.armed = False
                raise KeyboardInterrupt
            return func(*args, **(kwargs or {}))

    with _entry_layer() as (backend, layer, _w):
        pair = layer.plan.natives[0]
        layer._plan = attrs.evolve(layer.plan, natives=(pair, None, pair, None))
        args = random_routing(CFG, 3)
        for on in (True, False):
            _call_slot.set_active(on)
            with _InterruptOnce(), pytest.raises(KeyboardInterrupt):
                layer(*args)
        _call_slot.set_active(True)
        assert backend.entry_calls == 0
