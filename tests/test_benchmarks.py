"""The benchmark scripts run against the current framework (benchmarks/): each smoke test
calls a script's main() on its smallest settings and checks what it printed, so that an
internal API change that breaks a script fails here, not in the next person's measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ZENTORCH_OK, ZENTORCH_WHY

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _native_build() -> str:
    """The native kernel build this CPU runs, or a skip that says why there is none."""
    from moe_dispatch_backends.native import kernel

    import moe_dispatch as md

    isa, why = kernel.isa_for(md.Capabilities.detect())
    if isa is None:
        pytest.skip(f"the native kernel does not run here: {why}")
    if kernel.load(isa) is None:
        pytest.skip(f"the native kernel's {isa} build is unavailable: {kernel.status(isa)}")
    return isa


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    # The scripts import each other (bench_backends, bench_perf) as top-level modules.
    monkeypatch.syspath_prepend(str(BENCHMARKS))


@pytest.mark.skipif(not ZENTORCH_OK, reason=f"zentorch backend unavailable: {ZENTORCH_WHY}")
@pytest.mark.usefixtures("benchmarks_on_path")
def test_bench_overhead_runs_each_row(capsys):
    import bench_overhead

    assert bench_overhead.main(["--config", "C1", "--dtype", "float32", "--pairs", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "|" in line[2:]]
    labels = [row.split("|")[1].strip() for row in rows]
    for label in ("raw op (control)", "MoELayer", "MoELayer without the native entry",
                  "the layer's id range check (validates_ids=False)", "after a 3 ms sleep"):
        assert label in labels, (label, out)


@pytest.mark.usefixtures("benchmarks_on_path")
def test_bench_overhead_needs_two_pairs(capsys):
    import bench_overhead

    with pytest.raises(SystemExit):
        bench_overhead.main(["--pairs", "1"])
    assert "--pairs: at least 2, got 1" in capsys.readouterr().err


@pytest.mark.usefixtures("benchmarks_on_path")
def test_bench_ceiling_prints_a_row_per_format_and_token_count(capsys):
    import bench_ceiling

    _native_build()
    assert bench_ceiling.main(["--config", "C1", "--tokens", "1,2", "--formats", "int8,int4g32",
                               "--reps", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| C1 |")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("int8", "1"), ("int4g32", "1"), ("int8", "2"), ("int4g32", "2")]
    for row in rows:  # every time and share a positive number
        assert all(float(v.strip().rstrip("x%")) > 0 for v in row[3:]), row


@pytest.mark.usefixtures("benchmarks_on_path")
def test_bench_stream_prints_a_row_per_format_and_thread_count(capsys):
    import bench_stream

    _native_build()
    assert bench_stream.main(["--config", "C1", "--formats", "int8,int4g32", "--threads", "1,2",
                              "--inputs", "1,3", "--experts", "2", "--reps", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| int")]
    assert [tuple(v.strip() for v in r[:3]) for r in rows] == [
        (f, t, n) for f in ("int8", "int4g32") for t in ("1", "2") for n in ("1", "3")]
    for row in rows:  # speeds and the ratio: positive numbers
        assert all(float(v) > 0 for v in row[3:]), row
    for bad in (["--experts", "5"], ["--threads", "0"], ["--inputs", "7"], ["--inputs", "x"],
                ["--reps", "0"], ["--formats", "bf16"]):  # refused before any layer is built
        with pytest.raises(SystemExit):
            bench_stream.main(["--config", "C1", "--formats", "int8", "--reps", "1", *bad])


@pytest.mark.usefixtures("benchmarks_on_path")
def test_bench_native_ab_compares_two_builds_of_one_source(capsys):
    """An A/A pair (the kernel's own source twice): the same outputs, a row per case."""
    import bench_native_ab
    from moe_dispatch_backends.native import kernel

    isa = _native_build()
    source = str(Path(kernel.SOURCE).parent)
    assert bench_native_ab.main(["--base", source, "--new", source, "--isa", isa,
                                 "--cases", "C1:g32:1", "--rounds", "2", "--tag", "smoke"]) == 0
    rows = [[v.strip() for v in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| C1:g32:1 |")]
    assert len(rows) == 1 and rows[0][-1] == "True", rows
    base_ms, ratio, q1, q3, reads, fast, slow = rows[0][1:8]
    assert all(float(v) > 0 for v in (base_ms, ratio, q1, q3, fast)), rows  # two rounds: the
    low, high = (float(v) for v in reads.split("-"))                         # slower one's half
    assert 0 < low <= high and (slow == "-" or float(slow) > 0), rows        # may be empty
