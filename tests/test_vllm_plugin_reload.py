"""A weight update under the vLLM plugin (vLLM's layerwise reload: the method's hook runs again
on fresh tensors, then the processed values are written into the loaded parameters with
.data.copy_, no version bump): a served layer is rebuilt from the new values, a layer not
served goes to vLLM's own path. Stand-ins: tests/vllm_standins.py."""

from __future__ import annotations

import pytest
import torch

from moe_dispatch.testing import TOLERANCE, random_routing, random_weights, reference, rel_error
from moe_dispatch.vllm_plugin import _seam

from helpers import copying_backends
from vllm_standins import CONFIG, LOG, Layer, apply_experts, experts_class, method_class


@pytest.mark.parametrize("copy_first", [False, True], ids=["hook, then copy", "copy, then hook"])
def test_a_weight_update_rebuilds_the_served_layer_from_the_new_values(copy_first: bool) -> None:
    # vLLM's layerwise reload runs the method's hook on fresh tensors, then writes the
    # processed values into the loaded parameters with .data.copy_ (no version bump).
    backends = copying_backends(CONFIG)  # the ones a write through .data would leave stale
    if not backends:
        pytest.skip("no backend here serves fp32 from copies of its own")
    for backend in backends:
        cls = experts_class()
        method_cls = method_class(cls)
        assert _seam.install(cls, [], lambda: {"backend": backend}, LOG, method_cls)
        layer, method = Layer(CONFIG), method_cls(CONFIG)
        method.process_weights_after_loading(layer)
        experts = method.moe_kernel.fused_experts
        first = experts.__dict__[_seam._ATTR][0]
        x, tw, ids = random_routing(CONFIG, 5, seed=4)
        apply_experts(experts, layer, x, tw, ids)
        new = random_weights(CONFIG, seed=9)

        def copy() -> None:
            layer.w13_weight.data.copy_(new["w13"])
            layer.w2_weight.data.copy_(new["w2"])
        if copy_first:
            copy()
        method.process_weights_after_loading(layer)
        assert experts.__dict__[_seam._ATTR][0] is None  # the old copies are dropped now
        if not copy_first:
            copy()
        got = apply_experts(experts, layer, x, tw, ids)
        assert rel_error(got, reference(CONFIG, new, x, tw, ids)) < TOLERANCE[torch.float32], \
            backend
        rebuilt = experts.__dict__[_seam._ATTR][0]
        assert rebuilt is not first and rebuilt.backend == backend
        assert experts.calls == []  # vLLM's own path never ran


def test_after_a_weight_update_a_layer_not_served_goes_to_vllms_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cls = experts_class()
    method_cls = method_class(cls)
    _seam.install(cls, [], dict, LOG, method_cls)
    layer, method = Layer(CONFIG), method_cls(CONFIG)
    method.process_weights_after_loading(layer)
    experts = method.moe_kernel.fused_experts
    method.process_weights_after_loading(layer)
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "no_such_backend")
    x, tw, ids = random_routing(CONFIG, 3, seed=6)
    got = apply_experts(experts, layer, x, tw, ids)
    assert experts.calls == ["prepack", "apply"]  # prepared as vLLM would have, then its apply
    assert rel_error(got, reference(CONFIG, layer.weights, x, tw, ids)) < TOLERANCE[torch.float32]
    assert _seam._ATTR not in experts.__dict__
