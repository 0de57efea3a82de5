"""MoELayer's options and the variables that stand in for them: a bad value is a typed error
naming the argument (or the variable), the value and what is accepted; blank is unset."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


@pytest.mark.parametrize("kwargs,error,named", [
    (dict(exclude=None), md.InvalidTypeError, "exclude"),
    (dict(exclude=5), md.InvalidTypeError, "exclude"),
    (dict(exclude=[5]), md.InvalidTypeError, "exclude"),
    (dict(tuning_cache=123), md.InvalidTypeError, "tuning_cache"),
    (dict(strict="false"), md.InvalidTypeError, "strict"),
    (dict(strict=0), md.InvalidTypeError, "strict"),
    (dict(keep_canonical="no"), md.InvalidTypeError, "keep_canonical"),
    (dict(max_candidates=True), md.InvalidArgumentError, "max_candidates"),
    (dict(tune_max_tokens=True), md.InvalidArgumentError, "tune_max_tokens"),
    (dict(policy=1), md.InvalidTypeError, "policy"),
    (dict(backend=""), md.InvalidArgumentError, "backend"),
    (dict(backend="  "), md.InvalidArgumentError, "backend"),
])
def test_bad_layer_arguments_are_typed_errors(kwargs, error, named):
    with pytest.raises(error) as err:
        md.MoELayer(CFG, **kwargs)
    assert str(err.value).startswith(named) and repr(next(iter(kwargs.values()))) in str(err.value)


def test_blank_backend_to_resolve_is_a_value_error():
    with pytest.raises(md.InvalidArgumentError, match="backend=' ' is invalid"):
        md.resolve(CFG, backend=" ")


def test_good_arguments_are_kept():
    layer = md.MoELayer(CFG, exclude=iter(["Torch"]), strict=True, keep_canonical=False,
                        max_candidates=2, tuning_cache=False)
    assert layer.options.exclude == ("Torch",) and layer.strict is True
    assert layer.keep_canonical is False and layer.options.tuning.max_candidates == 2
    assert md.MoELayer(CFG, exclude="torch").options.exclude == ("torch",)


def test_blank_backend_variable_is_unset(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "  ")
    assert md.resolve(CFG).forced is None
    assert md.MoELayer(CFG).backend == md.resolve(CFG).backend


def test_an_unknown_backend_from_the_variable_names_it(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "nope")
    with pytest.raises(md.UnknownBackendError, match="'nope' \\(from env MOE_DISPATCH_BACKEND\\)"):
        md.MoELayer(CFG)
    with pytest.raises(md.UnknownBackendError) as err:
        md.resolve(CFG, backend="nope")  # the argument wins, and the message does not blame env
    assert "MOE_DISPATCH_BACKEND" not in str(err.value)


def test_a_forced_and_excluded_variable_is_named(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "torch")
    with pytest.raises(md.InvalidArgumentError, match="^MOE_DISPATCH_BACKEND='torch'"):
        md.resolve(CFG, exclude=["torch"])
    assert md.resolve(CFG).forced == "torch" and type(md.resolve(CFG).forced) is str


@pytest.mark.parametrize("value,policy", [("Priority", "priority"), (" fastest ", "fastest"),
                                          ("  ", "auto"), ("", "auto")])
def test_policy_variable_ignores_case_and_spaces(monkeypatch, value, policy):
    monkeypatch.setenv("MOE_DISPATCH_POLICY", value)
    assert md.MoELayer(CFG).policy == policy


def test_a_bad_policy_variable_is_named(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_POLICY", "quickest")
    with pytest.raises(md.InvalidArgumentError,
                       match="^MOE_DISPATCH_POLICY='quickest' is invalid: expected one of"):
        md.MoELayer(CFG)
    with pytest.raises(md.InvalidArgumentError, match="^policy='Priority'"):
        md.MoELayer(CFG, policy="Priority")  # an argument is taken as given
