"""The caller's weights under a MoELayer: an in-place change is caught and prepare() rebuilds,
a dtype move of the owning module is a clear error, the differentiable backend sees changes;
deepcopy and pickle give an independent layer; share_memory_() is no change and a storage
swap is caught for good; a layer whose weakly held weights are gone refuses to copy."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from helpers import (TOLERANCE, copying_backends, random_routing, random_weights, reference,
                     rel_error)

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


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
