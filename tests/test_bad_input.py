"""Malformed input through the public API: a typed error naming the argument and the value,
or (for legal but unusual input) a documented, correct result. Never a raw kernel error."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, strategies as st

import moe_dispatch as md
from helpers import TOLERANCE, random_routing, random_weights, reference, rel_error

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)
W = random_weights(CFG)
X, TW, IDS = random_routing(CFG, 5)
BACKENDS = [c.name for c in md.resolve(CFG).candidates if c.decision.accepted]


def _layer(backend):
    return md.MoELayer(CFG, backend=backend).load_weights(**W).prepare()


def _with(name, value):
    kw = dict(W)
    kw[name] = value
    return kw


# (id, callable, expected error type, argument named in the message)
def _under_inference_mode(w: dict) -> dict:
    with torch.inference_mode():
        return {k: None if v is None else v.clone() for k, v in w.items()}


CASES = [
    ("experts_zero", lambda: md.MoEConfig(0, 1, 8, 8), md.InvalidArgumentError, "num_experts"),
    ("hidden_negative", lambda: md.MoEConfig(4, 1, -8, 8), md.InvalidArgumentError, "hidden_size"),
    ("inter_zero", lambda: md.MoEConfig(4, 1, 8, 0), md.InvalidArgumentError, "intermediate_size"),
    ("top_k_zero", lambda: md.MoEConfig(4, 0, 8, 8), md.InvalidArgumentError, "top_k"),
    ("top_k_gt_e", lambda: md.MoEConfig(4, 5, 8, 8), md.InvalidArgumentError, "top_k"),
    ("experts_float", lambda: md.MoEConfig(4.0, 1, 8, 8), md.InvalidTypeError, "num_experts"),
    ("activation_unknown", lambda: md.MoEConfig(4, 1, 8, 8, activation="relu"), md.InvalidArgumentError, "activation"),
    ("activation_case", lambda: md.MoEConfig(4, 1, 8, 8, activation="SiLU"), md.InvalidArgumentError, "activation"),
    ("dtype_int", lambda: md.MoEConfig(4, 1, 8, 8, dtype=torch.int32), md.InvalidArgumentError, "dtype"),
    ("dtype_f64", lambda: md.MoEConfig(4, 1, 8, 8, dtype=torch.float64), md.InvalidArgumentError, "dtype"),
    ("router_on_input_k2", lambda: md.MoEConfig(4, 2, 8, 8, apply_router_weight_on_input=True),
     md.InvalidArgumentError, "apply_router_weight_on_input"),
    ("w13_shape", lambda: md.MoELayer(CFG).load_weights(**_with("w13", torch.randn(8, 16, 32))), md.InvalidArgumentError, "w13"),
    ("w13_rank", lambda: md.MoELayer(CFG).load_weights(**_with("w13", torch.randn(8 * 32, 32))), md.InvalidArgumentError, "w13"),
    ("w2_dtype", lambda: md.MoELayer(CFG).load_weights(**_with("w2", W["w2"].double())), md.InvalidTypeError, "w2"),
    ("w2_device_meta", lambda: md.MoELayer(CFG).load_weights(**_with("w2", torch.empty(8, 32, 16, device="meta"))),
     md.InvalidArgumentError, "w2"),
    ("w2_not_tensor", lambda: md.MoELayer(CFG).load_weights(**_with("w2", W["w2"].numpy())), md.InvalidTypeError, "w2"),
    ("bias_unexpected", lambda: md.MoELayer(CFG).load_weights(**_with("w2_bias", torch.zeros(8, 32))),
     md.InvalidArgumentError, "w2_bias"),
    ("bias_shape", lambda: md.MoELayer(md.MoEConfig(8, 2, 32, 16, dtype=torch.float32, has_bias=True)).load_weights(
        W["w13"], W["w2"], torch.zeros(8, 16), torch.zeros(8, 32)), md.InvalidArgumentError, "w13_bias"),
    ("x_1d", lambda: _layer("torch")(X[0], TW, IDS), md.InvalidArgumentError, "hidden_states"),
    ("x_3d", lambda: _layer("torch")(X[None], TW, IDS), md.InvalidArgumentError, "hidden_states"),
    ("x_h_mismatch", lambda: _layer("torch")(torch.randn(5, 33), TW, IDS), md.InvalidArgumentError, "hidden_states"),
    ("x_dtype", lambda: _layer("torch")(X.half(), TW, IDS), md.InvalidTypeError, "hidden_states"),
    ("ids_negative", lambda: _layer("torch")(X, TW, IDS.clone().fill_(-1)), md.InvalidArgumentError, "topk_ids"),
    ("ids_ge_e", lambda: _layer("torch")(X, TW, IDS + 8), md.InvalidArgumentError, "topk_ids"),
    ("ids_float", lambda: _layer("torch")(X, TW, IDS.float()), md.InvalidTypeError, "topk_ids"),
    ("ids_bool", lambda: _layer("torch")(X, TW, IDS.bool()), md.InvalidTypeError, "topk_ids"),
    ("ids_shape", lambda: _layer("torch")(X, TW, IDS[:4]), md.InvalidArgumentError, "topk_ids"),
    ("weights_shape", lambda: _layer("torch")(X, TW[:, :1], IDS), md.InvalidArgumentError, "topk_weights"),
    ("weights_int", lambda: _layer("torch")(X, TW.long(), IDS), md.InvalidTypeError, "topk_weights"),
    ("forward_before_prepare", lambda: md.MoELayer(CFG).load_weights(**W)(X, TW, IDS), md.LayerStateError, "prepare"),
    ("prepare_before_load", lambda: md.MoELayer(CFG).prepare(), md.LayerStateError, "load_weights"),
    ("logits_nan", lambda: md.select_experts(torch.full((2, 8), math.nan), 2), md.InvalidArgumentError, "router_logits"),
    ("groups_inconsistent", lambda: md.select_experts(torch.randn(2, 8), 2, num_expert_group=4, topk_group=5),
     md.InvalidArgumentError, "topk_group"),
    ("groups_not_divisor", lambda: md.select_experts(torch.randn(2, 8), 2, num_expert_group=3, topk_group=1),
     md.InvalidArgumentError, "num_expert_group"),
    ("resolve_not_config", lambda: md.resolve({"num_experts": 8}), md.InvalidTypeError, "config"),
    ("resolve_bad_caps", lambda: md.resolve(CFG, capabilities="zen4"), md.InvalidTypeError, "capabilities"),
    ("resolve_unknown_backend", lambda: md.resolve(CFG, backend="cuda"), md.UnknownBackendError, "cuda"),
    ("exclude_not_names", lambda: md.resolve(CFG, exclude=[1, 2]), md.InvalidTypeError, "exclude"),
    ("weights_inference_tensor", lambda: md.MoELayer(CFG).load_weights(
        **_under_inference_mode(W)), md.InvalidArgumentError, "w13='an inference tensor"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_typed_error_naming_the_argument(case):
    _, fn, exc, argument = case
    with pytest.raises(exc) as err:
        fn()
    assert isinstance(err.value, md.MoEDispatchError)
    assert argument in str(err.value)


def test_at_least_thirty_distinct_bad_inputs():
    assert len({c[0] for c in CASES}) >= 30


@pytest.mark.parametrize("bad", [-1, 8, 2**31 - 1, 2**32 + 3, -(2**32) + 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_on_every_backend_and_policy(backend, bad):
    """Out-of-range ids give the typed error on every backend, whether the layer or the
    kernel (zentorch: BackendSpec.validates_ids) finds them, and never demote the backend."""
    layer = md.MoELayer(CFG, exclude=[b for b in BACKENDS if b != backend])
    layer.load_weights(**W).prepare()
    assert layer.backend == backend
    for tokens in (1, 5):
        x, tw, ids = random_routing(CFG, tokens, seed=tokens)
        ids = ids.to(torch.int64)  # 2**32 + 3 would wrap to 3 if narrowed to int32
        ids[-1, -1] = bad
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, ids)
    assert layer.demotions == () and layer.backend == backend
    assert rel_error(layer(X, TW, IDS), reference(CFG, W, X, TW, IDS)) <= TOLERANCE[torch.float32]


# Legal but unusual input: documented behaviour, identical on every accepting backend.
@pytest.mark.parametrize("backend", BACKENDS)
def test_unusual_but_legal_inputs(backend):
    layer = _layer(backend)
    # T == 0: an empty output, no kernel call.
    assert layer(torch.empty(0, 32), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64)).shape == (0, 32)
    # Negative router weights are used as given (nothing renormalises them).
    tw = -TW
    assert rel_error(layer(X, tw, IDS), reference(CFG, W, X, tw, IDS)) <= TOLERANCE[torch.float32]
    # Duplicate ids within a token contribute twice (zentorch rewrites such rows exactly).
    ids = IDS.clone()
    ids[:, 1] = ids[:, 0]
    assert rel_error(layer(X, TW, ids), reference(CFG, W, X, TW, ids)) <= TOLERANCE[torch.float32]
    # int64 ids and non-contiguous views of everything.
    xs = torch.randn(5, 64)
    xs[:, ::2] = X
    out = layer(xs[:, ::2], TW.t().contiguous().t(), IDS.long().t().contiguous().t())
    assert rel_error(out, reference(CFG, W, X, TW, IDS)) <= TOLERANCE[torch.float32]
    # NaN / Inf in hidden_states propagate to that token only; other rows are exact.
    x = X.clone()
    x[2, 3] = math.nan
    out = layer(x, TW, IDS)
    assert torch.isnan(out[2]).any() and not torch.isnan(out[[0, 1, 3, 4]]).any()
    # A NaN router weight poisons only its token.
    tw = TW.clone()
    tw[1, 0] = math.nan
    out = layer(X, tw, IDS)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2, 3, 4]]).any()


def test_load_and_prepare_twice_are_defined():
    layer = _layer("torch")
    layer.prepare()  # again: rebuilds from the current weights
    w2 = random_weights(CFG, seed=7)
    layer.load_weights(**w2)  # again: replaces the weights, must prepare again
    with pytest.raises(md.LayerStateError):
        layer(X, TW, IDS)
    layer.prepare()
    assert rel_error(layer(X, TW, IDS), reference(CFG, w2, X, TW, IDS)) <= TOLERANCE[torch.float32]


# -- fuzz: arbitrary combinations -------------------------------------------------------------
def _maybe(draw, good, bad):
    return draw(st.sampled_from([good, good, good] + bad))


def _valid(t: int, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> bool:
    """The model of a valid forward call for CFG (E=8, top_k=2, H=32, float32)."""
    return (x.dtype == torch.float32 and tuple(x.shape) == (t, 32)
            and tw.is_floating_point() and tuple(tw.shape) == (t, 2)
            and ids.dtype in (torch.int32, torch.int64) and tuple(ids.shape) == (t, 2)
            and (t == 0 or (int(ids.min()) >= 0 and int(ids.max()) < 8)))


@given(data=st.data())
def test_fuzz_typed_error_exactly_for_invalid_input(data):
    """Both directions: every invalid call raises a typed error, and every valid one (odd
    dtypes, strides, repeated ids included) returns the reference's numbers."""
    backend = data.draw(st.sampled_from(BACKENDS))
    layer = _layer(backend)
    t = data.draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    x = torch.randn(t, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]) if t else torch.empty(0, 2, dtype=torch.int64)
    tw = torch.rand(t, 2, generator=g)
    x = _maybe(data.draw, x, [x.half(), x[:, :31], x.t() if t else x[:, :0], x[None],
                              torch.cat([x, x], 1)[:, ::2]])
    ids = _maybe(data.draw, ids, [ids.int(), ids.float(), ids - 1, ids + 7, ids[:, :1], ids.t(),
                                  ids[:, [0, 0]] if t else ids, ids.t().contiguous().t()])
    tw = _maybe(data.draw, tw, [tw.double(), -tw, tw[:, :1], tw.int(), tw.t(), tw.bfloat16()])
    if not _valid(t, x, tw, ids):
        with pytest.raises(md.MoEDispatchError):
            layer(x, tw, ids)
        return
    out = layer(x, tw, ids)
    want = reference(CFG, W, x, tw, ids)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel_error(out, want) <= TOLERANCE[torch.float32]


def test_fuzz_model_sees_both_kinds():
    """The validity model is not trivially one-sided."""
    x, tw, ids = X, TW, IDS
    assert _valid(5, x, tw, ids) and _valid(5, x, tw.double(), ids.int())
    assert not _valid(5, x, tw, ids + 7) and not _valid(5, x.half(), tw, ids)


# -- concurrency -----------------------------------------------------------------------------
def test_threads_share_layers_and_caches():
    layers = [_layer(b) for b in BACKENDS]
    inputs = [random_routing(CFG, t, seed=t) for t in range(1, 7)]
    configs = [md.MoEConfig(8, k, 32, 16, dtype=dt) for k in (1, 2) for dt in (torch.float32, torch.bfloat16)]
    serial_out = [[layer(*inp) for inp in inputs] for layer in layers]
    serial_res = [md.resolve(c).backend for c in configs]
    serial_txt = [md.explain(c) for c in configs]
    errors: list[str] = []

    def work(tid: int) -> None:
        for i in range(125):  # 8 threads x 125 = 1000 mixed calls
            kind = (i + tid) % 3
            try:
                if kind == 0:
                    li, ii = (i + tid) % len(layers), (i * 5 + tid) % len(inputs)
                    if not torch.equal(layers[li](*inputs[ii]), serial_out[li][ii]):
                        errors.append(f"forward {BACKENDS[li]} {ii}")
                elif kind == 1:
                    ci = (i + tid) % len(configs)
                    if md.resolve(configs[ci]).backend != serial_res[ci]:
                        errors.append(f"resolve {ci}")
                else:
                    ci = (i * 3 + tid) % len(configs)
                    if md.explain(configs[ci]) != serial_txt[ci]:
                        errors.append(f"explain {ci}")
            except Exception as exc:  # noqa: BLE001 - any exception is a failure here
                errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert errors == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_under_vmap_demotes_no_backend(dtype):
    """torch.func.vmap wraps the inputs in tensors without storage of their own: a kernel
    that reads memory fails on them, which is the call's form, not the kernel's fault. The
    call raises a typed error naming the transform (or, where the routed backend computes
    under vmap, gives the right numbers), and the layer keeps every backend."""
    cfg = md.MoEConfig(8, 2, 32, 16, dtype=dtype)
    w = random_weights(cfg, seed=3)
    layer = md.MoELayer(cfg).load_weights(w["w13"], w["w2"]).prepare()
    before = layer.backend
    x, tw, ids = random_routing(cfg, 3, seed=4)
    xs = torch.stack([x, 2 * x])
    try:
        out = torch.func.vmap(lambda xi: layer(xi, tw, ids))(xs)
    except md.InvalidArgumentError as exc:
        assert "hidden_states='a tensor under a torch.func transform" in str(exc)
    else:
        for i in range(2):
            assert rel_error(out[i], reference(cfg, w, xs[i], tw, ids)) <= TOLERANCE[dtype]
    assert layer.demotions == () and layer.backend == before
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]

    try:  # the error names the wrapped argument
        torch.func.vmap(lambda twi: layer(x, twi, ids))(torch.stack([tw, tw]))
    except md.InvalidArgumentError as exc:
        assert str(exc).startswith("topk_weights="), exc
