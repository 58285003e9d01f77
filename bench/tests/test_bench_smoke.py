"""Smoke test of the benchmark harness: a tiny shared-prefix run through
Envoy + prefix-router (override_host) and Envoy round robin, on simulated
replicas, each with one and with two independent Envoy instances, in one
report. Checks that the report (Markdown + JSON) is written, that every
run has its own records, that the two-instance prefix-router run really
went through both Envoys, and that prefix-router's measured prefix-cache
hit rate beats round robin's.

Needs: target/release/{replica-sim,prefix-bench} (built here if missing),
the wasm module (scripts/build) and Envoy (scripts/setup). No matplotlib.
Bounded: the harness caps each run; the whole test takes ~40-80 s.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from testkit import harness  # noqa: E402


def _need_binaries():
    missing = [p for p in ("replica-sim", "prefix-bench") if not (ROOT / "target" / "release" / p).exists()]
    if missing:
        subprocess.run(
            ["cargo", "build", "--release", "-p", "replica-sim", "-p", "prefix-bench"],
            cwd=ROOT, check=True, timeout=900,
        )
    if not harness.WASM.exists():
        pytest.fail(f"{harness.WASM} not built: run scripts/build first")


def test_prefix_router_beats_round_robin(tmp_path):
    _need_binaries()
    import orchestrate

    out = tmp_path / "results"
    rc = orchestrate.main([
        "--workload", "shared-prefix",
        "--routers", "prefix-router,round-robin",
        "--scale", "0.02",           # 3 groups x 2,048-token prefixes, 180 prompts
        "--replicas", "4",
        "--time-scale", "0.2",
        "--envoy-instances", "1,2",
        "--max-run-seconds", "30",
        "--drain-seconds", "20",
        "--no-plots",
        "--out", str(out),
    ])
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "| router |" in md and "Envoy + prefix-router" in md and "ROUND_ROBIN" in md
    results = json.loads((out / "results.json").read_text())
    runs = {(r["router"], r["envoy_instances"]): r for r in results["workloads"]["shared-prefix"]["runs"]}
    assert sorted(runs) == [("prefix-router", 1), ("prefix-router", 2), ("round-robin", 1), ("round-robin", 2)]
    assert len({r["records_file"] for r in runs.values()}) == 4
    for key, r in runs.items():
        assert not r.get("skipped"), (key, r.get("skipped"))
        assert r["ok"] > 0 and r["errors"] == 0, (key, r.get("error_kinds"))
        assert r["hit_rate"] is not None
        assert (out / r["records_file"]).exists()
        assert len(r["targets"]) == key[1]
        # Every run records the p95 of its requests after the first quarter
        # (the many-gateways table's warm column).
        assert r["ttft_warm_p95_ms"] is not None and r["ttft_warm_p95_ms"] > 0, key
    # The two-instance run sent requests to both Envoys, and every request
    # was decided by one of the two filters (their counters are summed).
    two = runs[("prefix-router", 2)]
    records = json.loads((out / two["records_file"]).read_text())["records"]
    assert {r["target"] for r in records} == {0, 1}  # indices into the targets
    decided = sum(v for k, v in two["filter_stats"].items() if k.startswith("decision."))
    assert decided == two["requests"], two["filter_stats"]
    assert "Many gateways" in md and "| Envoy + prefix-router (override_host) x2 | 2 |" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| Envoy + prefix-router (override_host) x2 | 2 |"))
    warm, warm_ratio = row.split("|")[7].strip(), row.split("|")[8].strip()
    assert warm.replace(",", "").isdigit() and float(warm_ratio) > 0, row
    pr, rr = runs[("prefix-router", 1)], runs[("round-robin", 1)]
    assert pr["hit_rate"] > rr["hit_rate"], (pr["hit_rate"], rr["hit_rate"])
    bound = pr["upper_bound"]["hit_rate"]
    assert pr["hit_rate"] <= bound + 0.02, (pr["hit_rate"], bound)
