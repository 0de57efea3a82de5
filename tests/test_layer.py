"""MoELayer life cycle, errors, logging and explanations. The caller's weights under a layer
(in-place changes, a dtype move, copies, pickles, shared memory): tests/test_layer_weights.py."""

from __future__ import annotations

import logging

import pytest
import torch

import moe_dispatch as md
from helpers import TOLERANCE, random_routing, random_weights, reference, rel_error, torch_and

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


def _layer(config=CFG, **kw):
    return md.MoELayer(config, backend="torch", **kw).load_weights(**random_weights(config))


def test_is_a_module_and_explains():
    layer = _layer().prepare()
    assert isinstance(layer, torch.nn.Module)
    assert layer.backend == "torch" and layer.prepared
    text = layer.explain()
    assert "layer stage" in text and "=> torch" in text
    assert "torch" in repr(layer)


def test_forward_before_prepare():
    layer = _layer()
    x, tw, ids = random_routing(CFG, 3)
    with pytest.raises(md.LayerStateError, match="before prepare"):
        layer(x, tw, ids)
    with pytest.raises(md.LayerStateError, match="before load_weights"):
        md.MoELayer(CFG).prepare()


def test_zero_tokens_returns_empty():
    layer = _layer().prepare()
    out = layer(torch.empty(0, 32), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 32) and out.dtype == torch.float32


def test_load_weights_twice_requires_prepare_again():
    layer = _layer().prepare()
    layer.load_weights(**random_weights(CFG, seed=3))
    assert not layer.prepared
    with pytest.raises(md.LayerStateError):
        layer(*random_routing(CFG, 2))


@pytest.mark.parametrize("name,value,exc,match", [
    ("w13", torch.zeros(8, 32, 31), md.InvalidArgumentError, r"w13=.*shape \(8, 32, 32\)"),
    ("w13", torch.zeros(8, 32, 32, dtype=torch.bfloat16), md.InvalidTypeError, "w13 has .*dtype torch.float32"),
    ("w2", torch.zeros(8, 32), md.InvalidArgumentError, "w2="),
    ("w2", "weights", md.InvalidTypeError, "w2 has 'weights'"),
    ("w13_bias", torch.zeros(8, 32), md.InvalidArgumentError, "w13_bias=.*has_bias=False"),
])
def test_bad_weights(name, value, exc, match):
    weights = random_weights(CFG)
    weights[name] = value
    with pytest.raises(exc, match=match):
        md.MoELayer(CFG).load_weights(**weights)


def test_missing_bias_when_config_has_bias():
    cfg = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32, has_bias=True)
    weights = random_weights(cfg)
    weights["w2_bias"] = None
    with pytest.raises(md.InvalidArgumentError, match="w2_bias=None.*has_bias=True"):
        md.MoELayer(cfg).load_weights(**weights)


@pytest.mark.parametrize("case,exc,match", [
    ("x_1d", md.InvalidArgumentError, r"hidden_states=.*\[T, 32\]"),
    ("x_wrong_h", md.InvalidArgumentError, r"hidden_states=.*H=32"),
    ("x_dtype", md.InvalidTypeError, "hidden_states has .*dtype torch.float32"),
    ("x_list", md.InvalidTypeError, "hidden_states"),
    ("ids_negative", md.InvalidArgumentError, r"topk_ids=.*-1.*\[0, 8\)"),
    ("ids_too_big", md.InvalidArgumentError, r"topk_ids=.*8.*\[0, 8\)"),
    ("ids_float", md.InvalidTypeError, "topk_ids .*int32 or torch.int64"),
    ("ids_shape", md.InvalidArgumentError, r"topk_ids=.*shape \(3, 2\)"),
    ("w_shape", md.InvalidArgumentError, r"topk_weights=.*shape \(3, 2\)"),
    ("w_int", md.InvalidTypeError, "topk_weights .*floating"),
])
def test_bad_forward_inputs(case, exc, match):
    layer = _layer().prepare()
    x, tw, ids = random_routing(CFG, 3)
    if case == "x_1d":
        x = x[0]
    elif case == "x_wrong_h":
        x = torch.randn(3, 31)
    elif case == "x_dtype":
        x = x.to(torch.bfloat16)
    elif case == "x_list":
        x = x.tolist()
    elif case == "ids_negative":
        ids = ids.clone(); ids[1, 0] = -1
    elif case == "ids_too_big":
        ids = ids.clone(); ids[2, 1] = 8
    elif case == "ids_float":
        ids = ids.float()
    elif case == "ids_shape":
        ids = ids[:, :1]
    elif case == "w_shape":
        tw = tw.t()
    elif case == "w_int":
        tw = tw.to(torch.int32)
    with pytest.raises(exc, match=match):
        layer(x, tw, ids)


def test_chosen_backend_logged_once_at_info_and_skips_at_debug(caplog):
    md.clear_cache()
    cfg = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32, activation="gelu_tanh")
    with caplog.at_level(logging.DEBUG, logger="moe_dispatch"):
        md.resolve(cfg)
        md.resolve(cfg)
        md.resolve(cfg, exclude=["amx_grouped"])  # a new cache key, the same choice
    infos = [r for r in caplog.records if r.levelno == logging.INFO and "runs on backend" in r.message]
    assert len(infos) == 1
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG and "skipped backend" in r.message]
    assert debugs and all(r.levelno < logging.INFO for r in debugs)


def test_forced_backend_layer_rejection_is_an_error():
    class PickyBackend(md.BackendBase):
        def supports_config(self, config, capabilities):
            return md.accept()

        def supports_layer(self, weights, capabilities):
            return md.reject("only contiguous w2 please")

        def process_weights(self, weights, capabilities):
            return weights

        def apply(self, state, x, tw, ids):
            raise AssertionError("never called")

    reg = md.Registry(load_entry_points=False)
    from moe_dispatch_backends import torch_loop
    reg.register(torch_loop, name="torch")
    reg.register(md.BackendSpec("picky", 50, PickyBackend()))
    with md.use_registry(reg):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        # The layer check narrows the list; the config-accepted torch backend takes over.
        assert layer.backend == "torch"
        cand = next(c for c in layer.resolution.candidates if c.name == "picky")
        assert cand.status == "layer rejected" and "contiguous" in cand.reason
        with pytest.raises(md.BackendRejectedError, match="picky.*layer.*only contiguous"):
            md.MoELayer(CFG, backend="picky").load_weights(**random_weights(CFG)).prepare()


def test_prepare_runs_outside_the_callers_autocast():
    """A transformers model first run under torch.autocast builds its layers there: a
    backend's warm-up check then compared its kernel with a bf16 reference and failed, and
    the tuning would time other kernels than the forward runs."""
    seen: list[bool] = []

    class Recording(md.BackendBase):
        def supports_config(self, config, capabilities):
            return md.accept()

        def process_weights(self, weights, capabilities):
            seen.append(torch.is_autocast_enabled("cpu"))
            return weights

        def apply(self, state, x, tw, ids):
            seen.append(torch.is_autocast_enabled("cpu"))
            from moe_dispatch.kernels import expert_loop
            return expert_loop(state, x, tw, ids)

    reg = torch_and(md.BackendSpec("recording", 50, Recording()))
    w = random_weights(CFG)
    with md.use_registry(reg), torch.autocast("cpu", dtype=torch.bfloat16):
        layer = md.MoELayer(CFG, policy="auto", tuning_cache=False, tune_max_tokens=2)
        layer.load_weights(**w).prepare()
        assert torch.is_autocast_enabled("cpu")  # the caller's context is back
    assert seen and not any(seen), seen
    x, tw, ids = random_routing(CFG, 3)
    assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", ["none", "shape", "dtype", "list"])
def test_an_apply_that_returns_no_output_is_a_kernel_failure(kind):
    """A plugin's apply that returns None, a list or a tensor of another shape or dtype: the
    caller never gets it (the backend is demoted, as for a kernel that raises), and the
    default routing never times it as a winner (doing nothing is fast)."""
    class Bad(md.BackendBase):
        def supports_config(self, config, capabilities):
            return md.accept()

        def process_weights(self, weights, capabilities):
            return weights

        def apply(self, state, x, tw, ids):
            return {"none": None, "list": [1, 2, 3],
                    "shape": torch.zeros(x.shape[0], 3, dtype=x.dtype),
                    "dtype": torch.zeros(x.shape, dtype=torch.float64)}[kind]

    reg = torch_and(md.BackendSpec("bad", 50, Bad()))
    w = random_weights(CFG)
    x, tw, ids = random_routing(CFG, 3)
    with md.use_registry(reg):
        for policy in ("priority", "auto"):
            layer = md.MoELayer(CFG, policy=policy, tuning_cache=False, tune_max_tokens=4)
            layer.load_weights(**w).prepare()
            out = layer(x, tw, ids)
            assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
            if policy == "auto":
                assert "bad" not in (layer.tuned_table or {}).values()
            else:
                assert [d.backend for d in layer.demotions] == ["bad"]
                assert "apply returned" in layer.demotions[0].error
