import pytest
import torch
from hypothesis import given, strategies as st

import moe_dispatch as md


def test_softmax_topk_renormalized():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = md.select_experts(logits, 2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == [[1, 2]]
    p = torch.softmax(logits, -1)[0]
    assert torch.allclose(w, torch.tensor([[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]]))


def test_no_renormalize_keeps_probabilities():
    logits = torch.randn(5, 8)
    w, ids = md.select_experts(logits, 3, renormalize=False)
    p = torch.softmax(logits, -1)
    assert torch.allclose(w, p.gather(1, ids.long()))


def test_sigmoid_bias_groups_and_scaling_deepseek_v3_style():
    torch.manual_seed(1)
    logits = torch.randn(6, 16)
    bias = torch.randn(16)
    w, ids = md.select_experts(logits, 4, scoring="sigmoid", num_expert_group=4, topk_group=2,
                               correction_bias=bias, routed_scaling_factor=2.5)
    s = torch.sigmoid(logits)
    choice = (s + bias).view(6, 4, 4)
    group_score = choice.topk(2, -1).values.sum(-1)
    keep = group_score.topk(2, -1).indices
    for t in range(6):
        groups = set((ids[t].long() // 4).tolist())
        assert groups <= set(keep[t].tolist())
        chosen = s[t, ids[t].long()]  # weights are the unbiased scores
        assert torch.allclose(w[t], chosen / chosen.sum() * 2.5, rtol=1e-5)


@given(t=st.integers(1, 20), e=st.integers(1, 32), data=st.data())
def test_ids_distinct_and_in_range(t, e, data):
    k = data.draw(st.integers(1, e))
    w, ids = md.select_experts(torch.randn(t, e), k)
    assert ids.shape == (t, k) and int(ids.min()) >= 0 and int(ids.max()) < e
    for row in ids.tolist():
        assert len(set(row)) == k
    assert torch.allclose(w.sum(-1), torch.ones(t), atol=1e-5)


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=0), "top_k"), (dict(top_k=9), "top_k"), (dict(scoring="relu"), "scoring"),
    (dict(num_expert_group=3, topk_group=1), "num_expert_group"),
    (dict(num_expert_group=4, topk_group=5), "topk_group"),
    (dict(num_expert_group=4), "topk_group"),
    (dict(num_expert_group=4, topk_group=1, top_k=3), "topk_group"),
    (dict(correction_bias=torch.zeros(3)), "correction_bias"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    kw = dict(top_k=2)
    kw.update(kwargs)
    with pytest.raises(md.MoEDispatchError) as err:
        md.select_experts(torch.randn(3, 8), **kw)
    assert err.value.argument == field


def test_nan_logits_rejected():
    logits = torch.randn(3, 8)
    logits[1, 2] = float("nan")
    with pytest.raises(md.InvalidArgumentError, match="router_logits.*NaN"):
        md.select_experts(logits, 2)


def test_bad_logits_type_and_rank():
    with pytest.raises(md.InvalidTypeError, match="router_logits"):
        md.select_experts([[1.0, 2.0]], 1)
    with pytest.raises(md.InvalidArgumentError, match="router_logits"):
        md.select_experts(torch.randn(8), 1)
    with pytest.raises(md.InvalidTypeError, match="router_logits"):
        md.select_experts(torch.ones(2, 8, dtype=torch.int64), 1)


def test_zero_tokens():
    w, ids = md.select_experts(torch.randn(0, 8), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
