"""pytest plugin: ``--moe-backend=NAME`` (repeatable) selects the backends that
``moe_dispatch.testing.conformance`` runs against."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moe-dispatch")
    group.addoption("--moe-backend", action="append", default=[], metavar="NAME",
                    help="run moe_dispatch.testing.conformance against this backend (repeatable)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.config.getoption("--moe-backend", default=[])
    if names and "moe_backend" in metafunc.fixturenames:
        # Direct parametrisation overrides the kit's fallback fixture (which skips).
        metafunc.parametrize("moe_backend", names, scope="module")
