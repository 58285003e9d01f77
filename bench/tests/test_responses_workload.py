"""The agentic-responses workload through the harness: agent sessions over
the Responses API, each turn continuing the stored response before it
(`previous_response_id`), with two independent Envoy instances picked at
random per request, on simulated replicas that keep stored responses in
their own memory and answer 404 for any other.

prefix-router (run as the profile configures it: `/v1/responses` parsed,
`affinity.response_ids`) serves every turn it sends, each follow-up
decided as `stored_response`; Envoy round robin loses sessions to 404s at
their second turn. Also checks the workload's plumbing: the load
generator reads the Responses API's event stream (text, usage, the id)
and the cache-hit bound is computed from what the server rendered.

Needs: target/release/{replica-sim,prefix-bench} (built here if missing),
the wasm module (scripts/build) and Envoy (scripts/setup). About 40-60 s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import orchestrate  # noqa: E402
from test_bench_smoke import _need_binaries  # noqa: E402


def test_prefix_router_serves_every_turn_round_robin_loses_sessions_to_404(tmp_path):
    _need_binaries()
    out = tmp_path / "results"
    rc = orchestrate.main([
        "--workload", "agentic-responses",
        "--routers", "prefix-router,round-robin",
        "--sessions", "3",
        "--agent-think", "0.5",
        "--time-scale", "0.1",
        "--envoy-instances", "2",
        "--max-run-seconds", "40",
        "--drain-seconds", "20",
        "--no-plots",
        "--out", str(out),
    ])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    runs = {r["router"]: r for r in results["workloads"]["agentic-responses"]["runs"]}
    pr, rr = runs["prefix-router"], runs["round-robin"]
    assert not pr.get("skipped") and not rr.get("skipped")

    # Every session's turns were sent and answered; each follow-up found
    # its stored response, whichever instance it reached.
    assert pr["errors"] == 0, pr["error_kinds"]
    assert pr["requests"] >= 3 * 10
    records = json.loads((out / pr["records_file"]).read_text())["records"]
    assert {r["target"] for r in records} == {0, 1}
    later = sum(1 for r in records if r["turn"] and r["turn"] > 0)
    assert pr["filter_stats"].get("decision.stored_response") == later
    assert pr["filter_stats"].get("responses.named") == pr["requests"]
    assert pr["filter_stats"].get("responses.unknown", 0) == 0
    # Each session stayed on one replica (it had to: nowhere else has it).
    assert pr["key_affinity"] == 1.0
    # The usage the event stream reported, and a bound from the server's
    # rendering (the history with its answers), not the short bodies.
    assert pr["client_hit_rate"] and pr["client_hit_rate"] > 0.5
    assert pr["upper_bound"]["prompt_tokens"] > 3 * 10 * 10_000

    # Round robin: a session lasts only while each turn happens to reach
    # the replica that stored the last (about 1 in 4 a turn); at its first
    # miss it gets 404 and ends.
    kinds = rr["error_kinds"]
    assert any(k.startswith("HTTP 404") for k in kinds), kinds
    assert rr["ok"] < pr["ok"]
