"""MoELayer life cycle, errors, logging and explanations."""

from __future__ import annotations

import logging

import pytest
import torch

import moe_dispatch as md
from helpers import (TOLERANCE, copying_backends, random_routing, random_weights, reference,
                     rel_error, torch_and)

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


def _copying_backend() -> str:
    """A backend that accepts CFG and keeps its own copy (not differentiable)."""
    return copying_backends(CFG)[0]


def test_in_place_weight_change_is_detected_and_prepare_rebuilds():
    weights = random_weights(CFG)
    name = _copying_backend()
    layer = md.MoELayer(CFG, backend=name).load_weights(**weights).prepare()
    x, tw, ids = random_routing(CFG, 4)
    weights["w13"].mul_(2)
    with pytest.raises(md.WeightsModifiedError, match=f"w13 was modified in place.*{name}"):
        layer(x, tw, ids)
    layer.prepare()
    assert rel_error(layer(x, tw, ids), reference(CFG, weights, x, tw, ids)) <= TOLERANCE[torch.float32]


class _Holder(torch.nn.Module):
    """A model that owns the experts' weights as parameters and runs them through a layer."""

    def __init__(self, weights: dict, backend: str | None):
        super().__init__()
        self.w13 = torch.nn.Parameter(weights["w13"].clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(weights["w2"].clone(), requires_grad=False)
        self.moe = md.MoELayer(CFG, backend=backend).load_weights(self.w13, self.w2).prepare()


@pytest.mark.parametrize("backend", [None, "torch"])
def test_a_dtype_move_of_the_owning_module_is_a_clear_error(backend):
    """.half() / .to() on a module that holds the weights replaces their data (same tensors,
    same versions): every route says so, none runs stale copies or demotes a backend."""
    model = _Holder(random_weights(CFG), backend)
    x, tw, ids = random_routing(CFG, 4)
    model.moe(x, tw, ids)
    model.half()
    for tokens in (1, 4, 64):
        x, tw, ids = random_routing(CFG, tokens, seed=tokens)
        with pytest.raises(md.WeightsModifiedError, match="torch.float16 now, torch.float32 at prepare"):
            model.moe(x, tw, ids)
    assert model.moe.prepared and not model.moe.demotions
    model.float()  # back to the dtype of the config: a copying route still wants prepare()
    if backend is None:
        with pytest.raises(md.WeightsModifiedError, match="storage was replaced"):
            model.moe(x, tw, ids)
        model.moe.prepare()
    w = {"w13": model.w13, "w2": model.w2, "w13_bias": None, "w2_bias": None}
    assert rel_error(model.moe(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_the_differentiable_backend_sees_in_place_changes():
    weights = random_weights(CFG)
    layer = md.MoELayer(CFG, backend="torch").load_weights(**weights).prepare()
    x, tw, ids = random_routing(CFG, 4)
    layer(x, tw, ids)
    weights["w13"].mul_(2)
    assert rel_error(layer(x, tw, ids), reference(CFG, weights, x, tw, ids)) <= TOLERANCE[torch.float32]


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


@pytest.mark.parametrize("prepared", [False, True])
def test_deepcopy_and_pickle_give_an_independent_layer(prepared, tmp_path):
    """A plan's kernel states neither copy nor pickle: the copy keeps the config, options,
    hooks and weights (a model's copied parameters stay shared with its copied layer), and
    prepares its own plan when the original had one."""
    import copy
    model = _Holder(random_weights(CFG), None)
    if not prepared:
        model.moe.load_weights(model.w13, model.w2)  # loaded, not prepared
    torch.save(model.moe, tmp_path / "layer.pt")  # before a hook: a lambda does not pickle
    seen = []
    model.moe.register_forward_hook(lambda mod, args, out: seen.append(1))
    x, tw, ids = random_routing(CFG, 5)
    clone = copy.deepcopy(model)
    assert clone.moe.prepared == prepared and clone.moe._handle != model.moe._handle
    if not prepared:
        clone.moe.prepare()
        model.moe.prepare()
    with torch.no_grad():
        clone.w2.mul_(2)  # the copy's layer holds the copy's parameters, not the original's
    clone.moe.prepare()
    w = {"w13": clone.w13, "w2": clone.w2, "w13_bias": None, "w2_bias": None}
    assert rel_error(clone.moe(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
    assert seen == [1]  # the hook was copied
    w = {"w13": model.w13, "w2": model.w2, "w13_bias": None, "w2_bias": None}
    assert rel_error(model.moe(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert loaded.prepared == prepared
    loaded.prepare()
    # its own tuning may route T=5 elsewhere: the reference, not bit equality
    assert rel_error(loaded(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_share_memory_is_not_a_change_and_a_swap_is_caught_for_good():
    """model.share_memory() moves each storage's bytes and keeps the storage: no change. A
    swap is caught by the storage's identity, and the layer holds the original storage, so a
    later allocation cannot take its address and pass for it."""
    from torch.multiprocessing.reductions import StorageWeakRef
    model = _Holder(random_weights(CFG), _copying_backend())
    x, tw, ids = random_routing(CFG, 4)
    want = model.moe(x, tw, ids)
    model.share_memory()
    assert torch.equal(model.moe(x, tw, ids), want)
    original = StorageWeakRef(model.w2.untyped_storage())
    for _ in range(3):
        model.w2.data = model.w2.data * 1.0  # same values, new storage each time
        with pytest.raises(md.WeightsModifiedError, match="storage was replaced"):
            model.moe(x, tw, ids)
    import gc
    gc.collect()
    assert not original.expired()  # held by the layer (until prepare(), or by the backend)
    model.moe.prepare()
    assert torch.equal(model.moe(x, tw, ids), want)


def test_a_weakly_held_layer_whose_weights_are_gone_refuses_to_copy():
    import copy
    import gc
    if not md.resolve(CFG, backend="onednn").candidates[0].decision.accepted:
        pytest.skip("onednn (a backend that copies the weights) is unavailable here")
    w = random_weights(CFG)
    layer = md.MoELayer(CFG, backend="onednn", keep_canonical=False).load_weights(**w).prepare()
    x, tw, ids = random_routing(CFG, 4)
    layer(x, tw, ids)
    del w
    gc.collect()
    with pytest.raises(md.LayerStateError, match="keep_canonical=False"):
        copy.deepcopy(layer)


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
