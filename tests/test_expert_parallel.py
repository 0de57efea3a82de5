"""Expert parallelism: configs and placement here; 2- and 4-rank gloo runs in subprocesses."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

import moe_dispatch as md
import ep_workers
from helpers import TOLERANCE, random_routing, random_weights, reference, rel_error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, tmp_path, timeout_s=240.0):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("experts,world,placement,want", [
    (10, 4, "contiguous", [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]),
    (10, 4, "round_robin", [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]),
    (8, 2, "contiguous", [(0, 1, 2, 3), (4, 5, 6, 7)]),
])
def test_placement(experts, world, placement, want):
    got = [md.MoEConfig(experts, 2, 8, 8, ep_size=world, ep_rank=r, placement=placement).local_expert_ids
           for r in range(world)]
    assert got == want
    c = md.MoEConfig(experts, 2, 8, 8, ep_size=world, ep_rank=1, placement=placement)
    emap = c.expert_map()
    assert [int(emap[e]) for e in want[1]] == list(range(len(want[1])))
    assert int((emap >= 0).sum()) == len(want[1])


@pytest.mark.parametrize("kwargs,field", [
    (dict(ep_size=4, ep_rank=4), "ep_rank"), (dict(ep_size=4, ep_rank=-1), "ep_rank"),
    (dict(ep_size=9), "ep_size"), (dict(ep_size=2, placement="random"), "placement"),
    (dict(ep_size=0), "ep_size"),
])
def test_bad_ep_fields(kwargs, field):
    with pytest.raises(md.MoEDispatchError) as err:
        md.MoEConfig(8, 2, 8, 8, **kwargs)
    assert field in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_process_sum_of_ranks_matches(dtype):
    full = md.MoEConfig(10, 4, 64, 32, dtype=dtype, has_bias=True)
    w = random_weights(full)
    x, tw, ids = random_routing(full, 11)
    total = torch.zeros(11, 64, dtype=torch.float32)
    for r in range(3):
        cfg = md.MoEConfig(10, 4, 64, 32, dtype=dtype, has_bias=True, ep_size=3, ep_rank=r)
        sel = list(cfg.local_expert_ids)
        layer = md.ExpertParallelLayer(cfg).load_weights(
            *(w[k][sel] for k in ("w13", "w2", "w13_bias", "w2_bias"))).prepare()
        assert layer.backend == md.resolve(cfg.local_config()).backend
        assert f"rank {r} of 3" in layer.explain()
        partial = layer(x, tw, ids)
        # The partial sum stays float32 until after the reduce (it was rounded to bf16 first).
        assert partial.dtype == torch.float32
        total += partial
    assert rel_error(total.to(dtype), reference(full, w, x, tw, ids)) <= TOLERANCE[dtype]
    # A token whose experts all live elsewhere gets zeros on this rank.
    cfg = md.MoEConfig(10, 4, 64, 32, dtype=dtype, has_bias=True, ep_size=3, ep_rank=2)
    sel = list(cfg.local_expert_ids)
    layer = md.ExpertParallelLayer(cfg).load_weights(
        *(w[k][sel] for k in ("w13", "w2", "w13_bias", "w2_bias"))).prepare()
    remote = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    assert torch.equal(layer(x[:1], tw[:1], remote), torch.zeros(1, 64, dtype=torch.float32))
    with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
        layer(x[:1], tw[:1], remote + 7)  # 10 is owned by no rank


def test_quantized_experts_load_as_one_argument():
    """load_weights(quantized_experts), as MoELayer takes it: the ranks' sum is the layer's."""
    scheme = md.QuantScheme("int8")
    full = md.MoEConfig(6, 2, 64, 32, dtype=torch.bfloat16, weight_scheme=scheme)
    w = random_weights(md.MoEConfig(6, 2, 64, 32))
    x, tw, ids = random_routing(full, 5)
    whole = md.MoELayer(full, backend="torch").load_weights(
        md.quantize_experts(w["w13"], w["w2"], scheme)).prepare()(x, tw, ids)
    total = torch.zeros(5, 64, dtype=torch.float32)
    for r in range(2):
        cfg = md.MoEConfig(6, 2, 64, 32, dtype=torch.bfloat16, weight_scheme=scheme, ep_size=2, ep_rank=r)
        sel = list(cfg.local_expert_ids)
        qe = md.quantize_experts(w["w13"][sel], w["w2"][sel], scheme)
        total += md.ExpertParallelLayer(cfg, backend="torch").load_weights(qe).prepare()(x, tw, ids)
    assert rel_error(total, whole) <= TOLERANCE[torch.bfloat16]


def test_moe_layer_and_resolve_refuse_an_expert_parallel_config():
    cfg = md.MoEConfig(10, 4, 64, 32, ep_size=2, ep_rank=0)
    with pytest.raises(md.InvalidArgumentError, match="ExpertParallelLayer"):
        md.MoELayer(cfg)
    with pytest.raises(md.InvalidArgumentError, match="local_config"):
        md.resolve(cfg)


def test_every_field_that_changes_the_math_is_compared_across_ranks():
    """Ranks that disagree on placement, activation, dtype, bias or router-on-input would
    sum wrong partials: each such field is among those the ranks compare."""
    import attrs
    from moe_dispatch.distributed import config_fields
    base = md.MoEConfig(10, 2, 64, 32, ep_size=2, ep_rank=0)
    # every config field but the rank itself: a new field must be compared too
    assert set(config_fields(base)) == {f.name for f in attrs.fields(md.MoEConfig)} - {"ep_rank"}
    for change in (dict(placement="round_robin"), dict(activation="gelu"), dict(dtype=torch.float32),
                   dict(has_bias=True), dict(top_k=1, apply_router_weight_on_input=True)):
        other = md.MoEConfig(**{**dict(num_experts=10, top_k=2, hidden_size=64, intermediate_size=32,
                                       ep_size=2, ep_rank=0), **change})
        differ = [k for k, v in config_fields(base).items() if config_fields(other)[k] != v]
        assert differ and set(differ) <= set(change) | {"top_k"}, (change, differ)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_match_single_process_and_reference(world, tmp_path):
    results = _spawn(ep_workers.parity_worker, world, tmp_path)
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res.pop("grad") == "raised"
    for key in results[0]:
        dtype_name, bias, placement = key.split("-")
        dtype = getattr(torch, dtype_name)
        outs = [torch.load(tmp_path / f"{key}-rank{r}.pt", weights_only=True) for r in range(world)]
        assert all(torch.equal(o, outs[0]) for o in outs)  # the all-reduce gives every rank the sum
        w, x, tw, ids = ep_workers._model(dtype, bias == "True")
        config = md.MoEConfig(10, 4, 64, 32, dtype=dtype, has_bias=bias == "True")
        single = md.MoELayer(config).load_weights(**w).prepare()(x, tw, ids)
        ref = reference(config, w, x, tw, ids)
        assert rel_error(outs[0], ref) <= TOLERANCE[dtype], key
        assert rel_error(outs[0], single) <= TOLERANCE[dtype], key
        owned = sorted(e for r in range(world) for e in results[r][key]["local"])
        assert owned == list(range(10))  # 10 experts over 2 or 4 ranks, uneven for 4
        for r in range(world):
            assert results[r][key]["backend"] == results[r][key]["expected"]
            assert results[r][key]["explain_has_rank"]


def test_errors_reach_every_rank_without_hanging(tmp_path):
    results = _spawn(ep_workers.error_worker, 2, tmp_path)
    for r, seen in enumerate(results):
        assert "topk_ids" in seen["unowned_id"] and "rank(s) [0, 1]" in seen["unowned_id"], seen
        assert "rank(s) [1]" in seen["wrong_shape"], seen
        assert "rank(s) [0, 1]" in seen["ep_size"] or "rank(s) [0]" in seen["ep_size"], seen
        assert seen["after"] == "ok"
    assert "w13" in results[1]["wrong_shape"]
    assert "ep_size" in results[0]["ep_size"]
    for seen in results:  # ranks that disagree on placement get an error, never wrong sums
        assert "ranks disagree on placement" in seen["placement"] and "rank(s) [0, 1]" in seen["placement"], seen


@pytest.fixture(scope="module")
def mismatches(tmp_path_factory):
    """One 2-rank run of ep_workers.mismatch_worker: rank 1 differs from rank 0 in one way
    per case. The worker's 20 s process-group timeout and this deadline make a rank left
    waiting fail the tests in about a minute."""
    results = _spawn(ep_workers.mismatch_worker, 2, tmp_path_factory.mktemp("mismatch"), timeout_s=90)
    assert all(seen.get("after") == "no error" for seen in results), results
    return results


def test_different_token_counts_raise_on_every_rank(mismatches):
    for seen in mismatches:
        for n in (0, 3):
            msg = seen[f"tokens_{n}"]
            assert msg.startswith("the expert-parallel forward failed on rank(s) [0, 1]"), msg
            assert f"tokens (hidden_states.shape[0]): 5 on rank(s) [0], {n} on rank(s) [1]" in msg, msg
            assert "every rank must pass the same tokens" in msg, msg


def test_errors_of_any_type_reach_every_rank(mismatches):
    rank0, rank1 = mismatches
    for name, own in (("config_dict", "expected a moe_dispatch.MoEConfig"), ("misspelled_option", "tuning_cach"),
                      ("kernel_failure", "RuntimeError: simulated kernel failure")):
        assert "rank(s) [1] (this is rank 0)" in rank0[name], (name, rank0[name])
        assert "rank(s) [1] (this is rank 1)" in rank1[name] and own in rank1[name], (name, rank1[name])
    assert rank1["kernel_failure"].endswith("[cause: RuntimeError]")  # raised `from` the error


def test_different_routing_raises_on_every_rank(mismatches):
    for seen in mismatches:
        for name, field in (("ids_differ", "topk_ids"), ("weights_differ", "topk_weights")):
            msg = seen[name]
            assert msg.startswith("the expert-parallel forward failed on rank(s) [0, 1]"), msg
            assert f"ranks disagree on {field}" in msg and "every rank must pass the same" in msg, msg
