"""What resolution produces: a status per backend, the candidates, the outcome (records only)."""

from __future__ import annotations

import enum

import attrs

from ._capabilities import Capabilities
from ._config import MoEConfig
from ._decision import Decision
from ._registry import PluginFailure
from ._spec import BackendRecord


class Status(str, enum.Enum):
    """A backend's place in one resolution (a ``str``: JSON and comparisons see the value)."""

    CHOSEN = "chosen"
    REJECTED = "rejected"  # its supports_config said no
    EXCLUDED = "excluded"  # exclude= or MOE_DISPATCH_DISABLE
    STANDBY = "standby"  # accepted, but a higher-priority backend was chosen
    NOT_FORCED = "not forced"  # accepted, but another backend was forced
    LAYER_REJECTED = "layer rejected"  # its supports_layer (or process_weights) said no
    DEMOTED = "demoted"  # failed at run time on this layer

    def __str__(self) -> str:
        return self.value


@attrs.frozen(slots=True)
class Candidate:
    """One backend as the resolver saw it."""

    name: str
    priority: int
    source: str
    decision: Decision  # supports_config
    status: Status
    layer_decision: Decision | None = None  # supports_layer (layer stage only)

    @property
    def reason(self) -> str:
        if self.layer_decision is not None and not self.layer_decision.accepted:
            return self.layer_decision.reason
        return self.decision.reason


@attrs.frozen(slots=True)
class Resolution:
    """The outcome: the chosen backend, and every candidate in the order tried.

    ``records`` are the registry's records as of the config stage: the layer stage walks
    exactly these, so a plugin registered in between changes nothing half-way.
    """

    config: MoEConfig
    backend: str
    candidates: tuple[Candidate, ...]
    capabilities: Capabilities = attrs.field(eq=False, repr=False)
    forced: str | None = None
    excluded: frozenset[str] = frozenset()
    failures: tuple[PluginFailure, ...] = ()
    stage: str = "config"
    notes: tuple[str, ...] = ()
    records: tuple[BackendRecord, ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.name == self.backend)

    def record(self, name: str) -> BackendRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def explain(self) -> str:
        from ._explain import format_table
        return format_table(self)
