"""A state machine registers and unregisters backends; the resolver must match a model."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import moe_dispatch as md
from moe_dispatch.testing.strategies import Gate, SyntheticBackend, backend_names, capabilities, configs, gates


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.registry = md.Registry(load_entry_points=False)
        self.model: dict[str, tuple[int, Gate]] = {}  # name -> (priority, gate)

    @rule(name=backend_names, priority=st.integers(-3, 3), gate=gates)
    def register(self, name, priority, gate):
        spec = md.BackendSpec(name, priority, SyntheticBackend(gate))
        with md.use_registry(self.registry):
            if name in self.model:
                with pytest.raises(md.PluginError, match=f"duplicate backend name '{name}'"):
                    md.register(spec)
            else:
                md.register(spec)
                self.model[name] = (priority, gate)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def unregister(self, data):
        name = data.draw(st.sampled_from(sorted(self.model)))
        with md.use_registry(self.registry):
            md.unregister(name)
        del self.model[name]

    @rule(name=backend_names)
    def unregister_unknown(self, name):
        if name in self.model:
            return
        with md.use_registry(self.registry), pytest.raises(md.UnknownBackendError):
            md.unregister(name)

    @rule(config=configs(), caps=capabilities())
    def resolve_matches_model(self, config, caps):
        order = sorted(self.model, key=lambda n: (-self.model[n][0], n))
        want = next((n for n in order if self.model[n][1].accepts(config, caps)), None)
        with md.use_registry(self.registry):
            if want is None:
                with pytest.raises(md.NoBackendError):
                    md.resolve(config, capabilities=caps)
            else:
                res = md.resolve(config, capabilities=caps)
                assert res.backend == want
                assert [c.name for c in res.candidates] == order

    @invariant()
    def listing_matches_model(self):
        with md.use_registry(self.registry):
            assert md.available_backends() == sorted(
                self.model, key=lambda n: (-self.model[n][0], n))


TestRegistryMachine = RegistryMachine.TestCase
