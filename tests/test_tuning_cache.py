"""The tuning cache's file and key: what it reuses, and what it survives."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

import moe_dispatch as md
from moe_dispatch._tuning_cache import TuningCache, tuning_key

CFG = md.MoEConfig(4, 2, 32, 16, dtype=torch.float32)
SIZES = [1, 2, 4]
TABLE = {1: "a", 2: "a", 4: "b"}


def _put(cache: TuningCache, key: str) -> None:
    cache.put(key, TABLE, {1: {"a": 1.0, "b": 2.0}}, CFG)


@pytest.mark.parametrize("content", [
    b"\xff\xfe not utf-8",
    b"[" * 100_000 + b"]" * 100_000,  # parsing it overflows the recursion limit
    json.dumps({"version": 2, "entries": {"k": {"buckets": {"\u00b9": "a"}}}}).encode(),
], ids=["not utf-8", "nested too deep", "a non-ascii digit"])
def test_a_corrupt_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "tuning.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        assert TuningCache(path).get("k", ["a", "b"], SIZES) is None
    assert caplog.records
    _put(TuningCache(path), "k")  # and a write replaces it
    assert TuningCache(path).get("k", ["a", "b"], SIZES).winners == TABLE


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, caplog):
    path = tmp_path / "tuning.json"
    path.mkdir()  # the replace fails
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        _put(TuningCache(path), "k")
    assert "cannot write tuning cache" in caplog.text
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tuning-")]


_WRITER = """
import sys, torch, moe_dispatch as md
from moe_dispatch._tuning_cache import TuningCache
cfg = md.MoEConfig(4, 2, 32, 16, dtype=torch.float32)
cache = TuningCache(sys.argv[1])
for i in range(int(sys.argv[3])):
    cache.put(f"{sys.argv[2]}{i}", {1: "a"}, {1: {"a": 1.0}}, cfg)
"""


def test_writers_in_two_processes_keep_each_others_entries(tmp_path):
    path = tmp_path / "tuning.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), p, "100"])
             for p in ("x", "y")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    keys = set(json.loads(path.read_text())["entries"])
    assert keys == {f"{p}{i}" for p in "xy" for i in range(100)}


def test_the_key_names_what_the_table_was_measured_with(monkeypatch):
    caps = md.Capabilities.detect()
    base = tuning_key(CFG, caps, {"a": "1"})
    assert tuning_key(CFG, caps, {"a": "1"}) == base
    # another CPU model with the same flags (a shared cache on a mixed cluster)
    assert tuning_key(CFG, caps.evolve(cpu_model=caps.cpu_model + " v2"), {"a": "1"}) != base
    # the value of a variable a candidate reads (the native kernel's forced ISA, say)
    assert tuning_key(CFG, caps, {"a": "1"}, env={"X_ISA": "avx2"}) != \
        tuning_key(CFG, caps, {"a": "1"}, env={"X_ISA": None})
    # torch's thread count now, not the one Capabilities.detect() read once per process
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert tuning_key(CFG, caps, {"a": "1"}) != base
    finally:
        torch.set_num_threads(threads)
