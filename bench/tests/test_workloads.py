"""The long-preamble and agentic workloads as `scripts/bench` runs them by
default, checked against the simulator's own tokenizer and limits before
any router is involved: `prefix-bench --dry-run` writes the planned
requests, one `replica-sim` process (the profile's preset, KV size and max
model length, 1 replica) tokenizes them.

- long-preamble: the shared preamble is longer than a 16 KiB window; the
  documents together don't fit one replica's KV cache but do fit the pool;
  every prompt fits max_model_len.
- agentic: sessions of 10-30 turns grow past 100 KB; their histories
  together exceed one replica's KV cache; the longest fits max_model_len;
  Envoy's buffer limit in the rendered bench configs exceeds every body.

No Envoy, no routers; about 5-10 s. The workloads' structure (roles, tool
ids, growth by appending, determinism by seed) is unit-tested in Rust:
`cargo test -p prefix-bench`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import orchestrate  # noqa: E402
import report  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def binaries():
    if not (orchestrate.SIM_BIN.exists() and orchestrate.BENCH_BIN.exists()):
        subprocess.run(
            ["cargo", "build", "--release", "-p", "replica-sim", "-p", "prefix-bench"],
            cwd=ROOT, check=True, timeout=900,
        )


def profile(name: str) -> dict:
    return orchestrate.profiles(orchestrate.parser().parse_args([]))[name]


def plan(prof: dict, tmp_path: Path) -> list[dict]:
    """The profile's requests, planned by prefix-bench (nothing sent)."""
    out = tmp_path / "plan.jsonl"
    subprocess.run(
        [str(orchestrate.BENCH_BIN), "--target", "127.0.0.1:9", "--dry-run", "--out", str(out),
         *prof["load"]],
        check=True, timeout=120, capture_output=True,
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


def tokenize(addr: str, body: dict) -> tuple[int, int]:
    """(prompt tokens, the replica's max_model_len) from /tokenize."""
    q = {"messages": body["messages"]}
    if "tools" in body:
        q["tools"] = body["tools"]
    req = urllib.request.Request(f"http://{addr}/tokenize", data=json.dumps(q).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        v = json.load(r)
    return v["count"], v["max_model_len"]


def text_tokens(addr: str, text: str) -> int:
    req = urllib.request.Request(f"http://{addr}/tokenize", data=json.dumps({"prompt": text}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["count"]


def sim_for(prof: dict) -> orchestrate.Sim:
    return orchestrate.Sim(1, prof["preset"], prof["time_scale"], prof["kv_tokens"], prof.get("max_model_len"))


def test_all_runs_the_new_workloads():
    assert {"long-preamble", "agentic"} <= set(orchestrate.WORKLOADS)
    profs = orchestrate.profiles(orchestrate.parser().parse_args([]))
    assert {"long-preamble", "agentic"} <= set(profs)


def test_long_preamble_shape_against_the_kv_cache(tmp_path):
    prof = profile("long-preamble")
    reqs = plan(prof, tmp_path)
    assert len(reqs) >= 1000
    preamble = reqs[0]["body"]["messages"][0]["content"]
    assert 24_000 <= len(preamble) <= 64_000
    assert len(preamble.encode()) > 16 * 1024, "must be longer than a 16 KiB hashing window"
    docs: dict[str, str] = {}
    for r in reqs:
        assert r["body"]["messages"][0]["content"] == preamble
        user = r["body"]["messages"][1]["content"]
        docs.setdefault(r["session_id"], user[: user.index("</document>")])
    kv, replicas = prof["kv_tokens"], prof["replicas"]
    with sim_for(prof) as sim:
        addr = sim.addrs[0]
        pre_tokens = text_tokens(addr, preamble)
        doc_tokens = {k: text_tokens(addr, d) for k, d in docs.items()}
        longest = max(reqs, key=lambda r: len(json.dumps(r["body"])))
        prompt, max_model_len = tokenize(addr, longest["body"])
    assert all(900 <= t <= 2_300 for t in doc_tokens.values()), sorted(doc_tokens.values())[:3]
    total_docs = sum(doc_tokens.values())
    # No single replica can cache every document next to the preamble...
    assert pre_tokens + total_docs > 1.5 * kv, (pre_tokens, total_docs, kv)
    # ...but the pool can (each replica also holds the preamble).
    assert total_docs < replicas * (kv - pre_tokens) * 0.9, (pre_tokens, total_docs, kv)
    assert prompt + 64 <= max_model_len


def test_agentic_shape_against_the_kv_cache_and_envoy_limits(tmp_path):
    prof = profile("agentic")
    reqs = plan(prof, tmp_path)
    last: dict[str, dict] = {}
    for r in reqs:
        if r["session_id"] not in last or r["turn"] > last[r["session_id"]]["turn"]:
            last[r["session_id"]] = r
    assert len(last) >= 4
    assert all(10 <= r["turn"] + 1 <= 30 for r in last.values())
    sizes = {k: len(json.dumps(r["body"])) for k, r in last.items()}
    assert max(sizes.values()) > 150_000
    assert sum(s > 100_000 for s in sizes.values()) >= len(sizes) // 2, sizes
    first = next(r for r in reqs if r["turn"] == 0)
    shared = len(json.dumps(first["body"]["tools"])) + len(first["body"]["messages"][0]["content"])
    assert 30_000 <= shared <= 60_000
    kv = prof["kv_tokens"]
    with sim_for(prof) as sim:
        addr = sim.addrs[0]
        finals = {k: tokenize(addr, r["body"]) for k, r in last.items()}
        shared_tokens, _ = tokenize(addr, {"messages": first["body"]["messages"][:1], "tools": first["body"]["tools"]})
    max_model_len = next(iter(finals.values()))[1]
    assert max(t for t, _ in finals.values()) + 64 <= max_model_len
    # Every session's history, once: well beyond one replica's cache.
    distinct = shared_tokens + sum(t - shared_tokens for t, _ in finals.values())
    assert distinct > 2 * kv, (distinct, kv)
    # The filter buffers the whole body: Envoy must accept the largest.
    biggest = max(len(json.dumps(r["body"]).encode()) for r in reqs)
    pool = ["127.0.0.1:1", "127.0.0.1:2"]
    for kind in ("prefix-router", "prefix-router-odst", "round-robin"):
        cfg = orchestrate.envoy_config(kind, pool, 1, 2)
        limit = cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"]
        assert limit >= 8 * biggest, (kind, limit, biggest)


def test_report_has_later_turns_for_agentic():
    run = {
        "router": "round-robin", "label": "Envoy ROUND_ROBIN", "req_per_s": 1.0, "ok": 2, "requests": 2,
        "errors": 0, "wall_s": 1.0, "ttft_ms": dict(mean=1, p50=1, p95=1, p99=1),
        "itl_ms": dict(p50=1.0), "e2e_ms": dict(p95=1), "hit_rate": 0.5, "share_max_over_mean": 1.0,
        "peak_waiting_total": 0, "upper_bound": {"hit_rate": 0.9, "distinct_blocks": 100, "shared_blocks": 80,
                                                 "block_size": 16, "prompt_tokens": 5000, "requests": 2},
        "ttft_later_turns_ms": {"n": 1, "mean": 2.0, "p50": 2.0, "p95": 2.0},
    }
    md = report.render({"workloads": {"agentic": {"setup": {"replicas": 4, "kv_tokens": 1000},
                                                  "runs": [run]}}})
    assert "agentic (agent sessions" in md
    assert "Turns 2 and later only" in md
    assert "1,280 sent by more than one request" in md and "1.3x one replica's KV cache" in md


def test_turns_without_a_first_token_open_their_key_but_have_no_ttft():
    recs = [
        {"key": "s1", "ok": True, "start_s": 0.0, "ttft_ms": None},
        {"key": "s1", "ok": True, "start_s": 1.0, "ttft_ms": 100.0},
        {"key": "s2", "ok": True, "start_s": 2.0, "ttft_ms": 50.0},
        {"key": "s2", "ok": False, "start_s": 3.0, "ttft_ms": None},
    ]
    first, later = orchestrate.turns_ttft({"records": recs}, 0.25)
    assert (first, later) == ([200.0], [400.0])
    assert orchestrate.later_turns_ttft({"records": recs}, 0.25)["n"] == 1


def test_warm_ttft_skips_the_first_quarter():
    recs = [{"ok": True, "start_s": float(i), "ttft_ms": (1000.0 if i < 25 else 10.0)} for i in range(100)]
    recs.append({"ok": False, "start_s": 99.0, "ttft_ms": None})
    w = orchestrate.warm_ttft({"records": recs}, time_scale=0.5)
    assert w["n"] == 75  # sent at 24.75 s or later: i = 25..99
    assert w["p99"] == 20.0 and w["after_s"] == 24.75 / 0.5
    run = {"label": "x", "ttft_warm_ms": w}
    md = report.render({"workloads": {"long-preamble": {"setup": {}, "runs": [
        {**run, "router": "x", "req_per_s": 1.0, "ok": 1, "requests": 1, "errors": 0, "wall_s": 1.0,
         "ttft_ms": dict(mean=1, p50=1, p95=1, p99=1), "itl_ms": dict(p50=1.0), "e2e_ms": dict(p95=1),
         "hit_rate": 0.5, "share_max_over_mean": 1.0, "peak_waiting_total": 0}]}}})
    assert "Warm only" in md and "| x | 75 |" in md


def test_percentiles_are_by_nearest_rank_as_the_load_generator_reports():
    ordered = [float(v) for v in range(1, 21)]  # 1..20
    assert orchestrate.nearest_rank(ordered, 0.95) == 19.0  # ceil(0.95 * 20) = 19th
    assert orchestrate.nearest_rank(ordered, 0.5) == 10.0
    assert orchestrate.nearest_rank(ordered, 0.0) == 1.0 and orchestrate.nearest_rank(ordered, 1.0) == 20.0
    assert orchestrate.nearest_rank([7.0], 0.99) == 7.0


def test_session_floor_counts_as_many_cold_first_turns_as_replicas():
    import session_floor

    def rec(key, t, ms, r):
        return {"ok": True, "key": key, "start_s": t, "ttft_ms": ms, "served_by": r}

    # Eight sessions, a replica each: first turns 1,600 real ms (cold),
    # then 10 later turns of 100..109 ms each; time scale 0.25.
    recs = []
    for s in range(8):
        recs.append(rec(f"s{s}", s, 1600.0, f"r{s}"))
        recs += [rec(f"s{s}", 10 + t, 100.0 + t, f"r{s}") for t in range(10)]
    out = session_floor.session_floor({"records": recs}, 0.25, 4)
    # 88 requests, the p95 is the 84th: on 4 replicas 4 free first turns
    # and 80 later turns (up to 436 ms) come before the 4 cold ones.
    assert (out["requests"], out["later_max_ms"]) == (88, 436.0)
    assert out["p95_floor_ms"] == 436.0
    # On 8 replicas all eight first turns are cold and the 84th is one.
    assert session_floor.session_floor({"records": recs}, 0.25, 8)["p95_floor_ms"] == 6400.0
    # Cold first turns that differ: a floor charges the cheapest, not the
    # slowest measured (a first turn of 1,000 real ms, not 3,000).
    two = [rec("a", 0, 3000.0, "r0"), rec("b", 1, 1000.0, "r1")]
    assert session_floor.session_floor({"records": two}, 0.25, 1)["p95_floor_ms"] == 4000.0
    # A replica that served two sessions: refused, its turns could have waited.
    recs.append(rec("s1", 99, 100.0, "r0"))
    with pytest.raises(ValueError, match="r0"):
        session_floor.session_floor({"records": recs}, 0.25, 4)


def test_key_affinity():
    recs = [{"ok": True, "key": "a", "served_by": "r1"}] * 3 + [{"ok": True, "key": "a", "served_by": "r2"},
                                                                {"ok": True, "key": "b", "served_by": "r2"},
                                                                {"ok": False, "key": "b", "served_by": "r1"}]
    assert orchestrate.key_affinity({"records": recs}) == 4 / 5
    assert orchestrate.key_affinity({"records": []}) is None


def test_placement_moves_counts_forced_and_other_moves():
    def rec(key, t, r):
        return {"ok": True, "key": key, "start_s": t, "served_by": r}
    recs = [rec("a", 1, "r1"), rec("a", 9, "r2"),   # on the removed replica: must move
            rec("b", 1, "r2"), rec("b", 9, "r3"),   # moved without need
            rec("c", 1, "r3"), rec("c", 9, "r3"),   # stayed
            rec("d", 1, "r2"), rec("d", 5.5, "r1"),  # after the change but inside the settling second
            rec("d", 9, "r2")]
    m = orchestrate.placement_moves({"records": recs}, "r1", "remove", 5.0)
    assert (m["keys"], m["moved"], m["moved_as_needed"], m["moved_otherwise"]) == (4, 2, 1, 1)
    assert m["on_changed_before"] == 1 and m["on_changed_after"] == 0
    # A replica that joins: moving onto it is needed, elsewhere is not.
    m = orchestrate.placement_moves({"records": recs}, "r3", "add", 5.0)
    assert (m["moved"], m["moved_as_needed"], m["moved_otherwise"]) == (2, 1, 1)
    assert "1 of them had to" in report._change(m)
