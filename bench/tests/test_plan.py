"""What `scripts/bench` runs and how the report compares instance counts:
the run plan for `--envoy-instances 1,2,3,4`, the flag's parsing, the
`gateways` key each prefix-router run gets, and the many-gateways table.
Pure Python: no Envoy, no simulator."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import orchestrate  # noqa: E402
import report  # noqa: E402


def test_every_envoy_router_runs_once_per_instance_count_and_a_peer_once():
    plan = orchestrate.run_plan(["prefix-router", "sglang-router", "round-robin"], [1, 3])
    assert plan == [("prefix-router", 1), ("prefix-router", 3), ("sglang-router", 1),
                    ("round-robin", 1), ("round-robin", 3)]


def test_instance_counts_parse_a_count_or_a_list_and_reject_the_rest():
    assert orchestrate.instance_counts("3") == [3]
    assert orchestrate.instance_counts("1,2,3,4") == [1, 2, 3, 4]
    for bad in ("", "0", "1,x", "2,2", "17", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            orchestrate.instance_counts(bad)
    a = orchestrate.parser().parse_args(["--envoy-instances", "1,3"])
    assert a.envoy_instances == [1, 3]
    assert orchestrate.parser().parse_args([]).envoy_instances == [1]


def _plugin(cfg: dict) -> str:
    """The wasm filter's plugin configuration, as rendered."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    return wasm["typed_config"]["config"]["configuration"]["value"]


def test_each_prefix_router_run_is_told_its_own_instance_count(monkeypatch):
    import json

    monkeypatch.setattr(orchestrate, "PLUGIN_EXTRA", {})
    pool = ["127.0.0.1:9001", "127.0.0.1:9002"]
    one = json.loads(_plugin(orchestrate.envoy_config("prefix-router", pool, 10000, 10001, 1)))
    three = json.loads(_plugin(orchestrate.envoy_config("prefix-router", pool, 10000, 10001, 3)))
    assert "gateways" not in one
    assert three["gateways"] == 3
    # --plugin still has the last word (an experiment with unaware gateways).
    monkeypatch.setattr(orchestrate, "PLUGIN_EXTRA", {"gateways": 1})
    forced = json.loads(_plugin(orchestrate.envoy_config("prefix-router", pool, 10000, 10001, 3)))
    assert forced["gateways"] == 1


def _run(router: str, n: int, hit: float, p95: float, share: float, warm: float | None = None) -> dict:
    return {"router": router, "label": f"{router} x{n}", "envoy_instances": n, "hit_rate": hit,
            "ttft_ms": {"p95": p95}, "ttft_warm_p95_ms": warm, "share_max_over_mean": share}


def test_the_gateways_table_compares_each_count_with_the_same_routers_one_instance():
    runs = [_run("prefix-router", 1, 0.90, 100.0, 1.05, 40.0), _run("prefix-router", 3, 0.87, 150.0, 1.30, 50.0),
            _run("round-robin", 1, 0.30, 900.0, 1.00), _run("round-robin", 3, 0.31, 990.0, 1.01),
            {"router": "sglang-router", "label": "sglang", "envoy_instances": 1, "hit_rate": 0.9,
             "ttft_ms": {"p95": 1.0}, "share_max_over_mean": 1.0},
            {"router": "ring-hash", "skipped": "envoy not found"}]
    lines = report.gateways_table(runs)
    rows = [ln for ln in lines if ln.startswith("| prefix-router") or ln.startswith("| round-robin")]
    assert rows == [
        "| prefix-router x1 | 1 | 90.0% | 1.000 | 100 | 1.00 | 40 | 1.00 | 1.05 |",
        "| prefix-router x3 | 3 | 87.0% | 0.967 | 150 | 1.50 | 50 | 1.25 | 1.30 |",
        # Runs recorded before the warm p95 (older results files) show "-".
        "| round-robin x1 | 1 | 30.0% | 1.000 | 900 | 1.00 | - | - | 1.00 |",
        "| round-robin x3 | 3 | 31.0% | 1.033 | 990 | 1.10 | - | - | 1.01 |",
    ]
    # A router run at one count only (or without a one-instance run) has no row.
    assert not any("sglang" in ln for ln in lines)
    assert report.gateways_table([_run("prefix-router", 3, 0.8, 1.0, 1.0)]) == []


def test_a_replica_port_pins_the_replicas_addresses():
    a = orchestrate.parser().parse_args(["--replica-port", "41000"])
    sim = orchestrate.Sim(4, "fast", 1.0, None, None, a.replica_port)
    assert sim.args[sim.args.index("--port") + 1] == "41000"
    # By default every replica gets a free port of its own.
    a = orchestrate.parser().parse_args([])
    sim = orchestrate.Sim(4, "fast", 1.0, None, None, a.replica_port)
    assert sim.args[sim.args.index("--port") + 1] == "0"


def test_the_responses_workload_parses_the_api_and_names_responses_on_every_instance():
    import json

    prof = orchestrate.profiles(orchestrate.parser().parse_args([]))["agentic-responses"]
    assert "agentic-responses" in orchestrate.WORKLOADS and "agentic-responses" in orchestrate.SESSION_WORKLOADS
    assert prof["load"][-2:] == ["--api", "responses"]
    pool = ["127.0.0.1:1", "127.0.0.1:2"]

    def plugin(cfg: dict) -> dict:
        return json.loads(_plugin(cfg))

    one = plugin(orchestrate.envoy_config("prefix-router", pool, 1, 2, 3, prof["plugin"]))
    assert "/v1/responses" in one["inference_paths"]
    assert one["affinity"]["response_ids"] is True and one["gateways"] == 3
    # --affinity's settings join the workload's, not replace them.
    orchestrate.PLUGIN_EXTRA["affinity"] = {"key": orchestrate.AFFINITY_KEY, "clients_echo": True}
    try:
        both = plugin(orchestrate.envoy_config("prefix-router", pool, 1, 2, 3, prof["plugin"]))
    finally:
        orchestrate.PLUGIN_EXTRA.clear()
    assert both["affinity"] == {"key": orchestrate.AFFINITY_KEY, "response_ids": True, "clients_echo": True}


def test_the_committed_example_report_has_every_workload_and_every_router():
    # A workload added to `scripts/bench` stays in the report from then on,
    # the committed example included (README's tables come from it).
    results = json.loads((BENCH / "results" / "example" / "results.json").read_text())
    text = (BENCH / "results" / "example" / "report.md").read_text()
    for w in orchestrate.WORKLOADS:
        assert f"\n## {w} (" in text, w
        assert (BENCH / "results" / "example" / f"{w}-bars.png").is_file(), w
    for w in orchestrate.WORKLOADS:
        routers = {r["router"] for r in results["workloads"][w]["runs"]}
        assert routers == set(orchestrate.ALL_ROUTERS), (w, routers)


def test_the_report_names_the_command_its_seed_and_prefix_routers_added_plugin_keys():
    # Two reports of the same workloads with another seed or other --plugin
    # keys differ in every number: the report must say which it is.
    results = {"argv": ["--workload", "agentic", "--seed", "2", "--plugin", '{"weights": {"prefix": 2}}'],
               "seed": 2, "plugin_extra": {"weights": {"prefix": 2}}, "workloads": {}}
    md = report.render(results)
    assert "Command: `scripts/bench --workload agentic --seed 2 --plugin '{\"weights\": {\"prefix\": 2}}'`" in md
    assert "load generator seed 2" in md
    assert 'plugin keys added: `{"weights": {"prefix": 2}}`' in md
    # An older results.json (argv only) still shows its command line.
    assert "Command: `scripts/bench --workload all --seed 1`." in report.render(
        {"argv": ["--workload", "all", "--seed", "1"], "workloads": {}})
    # A mixed pool is named on its workload's line.
    md = report.render({"workloads": {"unique": {"setup": {"replicas": 4, "kv_fractions": "1,1,1,0.25"},
                                                 "runs": []}}})
    assert "shares by replica 1,1,1,0.25" in md
