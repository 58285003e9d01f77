"""The overhead benchmark's parts: the body-floor reference module does the
routing chores it claims to (so its row is a real floor, not a filter that
crashed and was bypassed), a tiny run reports every router it was
asked for, with the floor column; the anthropic shape goes to
/v1/messages and the filter reads every prompt; a router that serves none of a
cell's requests gets a row saying so.

Needs scripts/build (the modules, the `overhead` tool) and Envoy. ~25 s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import overhead  # noqa: E402
from testkit import harness  # noqa: E402


def _need(path: Path):
    if not path.exists():
        pytest.fail(f"{path} not built: run scripts/build first")


def test_body_floor_strips_holds_reads_and_writes_the_destination():
    _need(overhead.FLOOR)
    with harness.Backend() as be:
        cfg = harness.render_config(
            "override_host", {"endpoints": [be.addr]}, [be.addr], harness.free_port(), harness.free_port(),
            wasm_path=overhead.FLOOR,
        )
        with harness.Envoy(cfg) as env:
            # Several body chunks: the floor must wait for the last one.
            body = harness.completion("a document line\n" * 8192)
            status, _, _ = harness.request(env.port, body=body, headers=[(harness.HEADER, "10.9.9.9:80")])
            assert status == 200
            assert len(be.requests) == 1
            got = be.requests[0]
            assert got["dest"] == [be.addr], "the client's header is replaced by the floor's own"
            assert got["body_len"] == len(json.dumps(body).encode())
            assert "panicked" not in env.log()


def test_a_small_run_reports_each_router_and_the_floor_column(tmp_path):
    for p in (overhead.FLOOR, overhead.TOOL, harness.WASM):
        _need(p)
    rc = overhead.main([
        "--routers", "round-robin,body-floor,prefix-router", "--sizes", "16384", "--concurrency", "1",
        "--reps", "2", "--seconds", "0.5", "--shapes", "chat,agent", "--out", str(tmp_path),
    ])
    assert rc == 0
    rows = json.loads((tmp_path / "overhead.json").read_text())
    assert sorted((r["router"], r["shape"]) for r in rows) == [
        (router, shape) for router in ("body-floor", "prefix-router", "round-robin") for shape in ("agent", "chat")
    ]
    for r in rows:
        assert r["errors"] == 0, r
        assert r["rps"] > 0 and r["reps"] == 2, r
    table = (tmp_path / "overhead.md").read_text()
    assert "over body-floor" in table
    prs = [line for line in table.splitlines() if line.startswith("| prefix-router |")]
    assert [pr.split("|")[2].strip() for pr in prs] == ["16 KiB chat", "16 KiB agent"]
    # Added vs Envoy and over the floor are both filled in for the filter.
    for pr in prs:
        assert pr.split("|")[6].strip().startswith(("+", "-")) and pr.split("|")[7].strip().startswith(("+", "-"))


def test_the_anthropic_shape_goes_to_v1_messages_and_the_filter_reads_every_prompt(tmp_path):
    for p in (overhead.FLOOR, overhead.TOOL, harness.WASM):
        _need(p)
    # The load tool posts the agent's turn to /v1/messages, in content
    # blocks, about the size asked.
    with harness.Backend() as be:
        r = overhead.run_load(be.addr, 1, 65536, 0.3, "anthropic")
        assert r["requests"] > 0 and r["errors"] == 0, r
        assert {(q["method"], q["path"]) for q in be.requests} == {("POST", "/v1/messages")}
        assert all(60_000 < q["body_len"] < 70_000 for q in be.requests)
        head, tail = be.requests[0]["body_ends"]
        # (serde_json writes keys in order: the task's text block first,
        # the tools, ending with the last one, at the end.)
        assert head.startswith(b'{"max_tokens":1,"messages":[{"content":[{"text":"Task '), head
        assert tail.endswith(b'"type":"object"},"name":"inventory_47"}]}'), tail
    # In Envoy, prefix-router reads that path (the config overhead.py
    # passes lists it): it read every prompt, so its row is its cost.
    rc = overhead.main([
        "--routers", "round-robin,body-floor,prefix-router", "--sizes", "65536", "--concurrency", "1",
        "--reps", "2", "--seconds", "0.5", "--shapes", "agent,anthropic", "--out", str(tmp_path),
    ])
    assert rc == 0
    rows = {(r["router"], r["shape"]): r for r in json.loads((tmp_path / "overhead.json").read_text())}
    assert sorted(rows) == [
        (router, shape) for router in ("body-floor", "prefix-router", "round-robin") for shape in ("agent", "anthropic")
    ]
    for r in rows.values():
        assert r["errors"] == 0 and r["unserved"] is None and r["rps"] > 0, r
    for shape in ("agent", "anthropic"):
        assert rows["prefix-router", shape]["read_per_req"] >= 0.99, rows["prefix-router", shape]
        assert rows["body-floor", shape]["read_per_req"] is None
    table = (tmp_path / "overhead.md").read_text()
    (pr,) = [line for line in table.splitlines() if line.startswith("| prefix-router | 64 KiB anthropic |")]
    assert pr.split("|")[6].strip().startswith(("+", "-")) and pr.split("|")[7].strip().startswith(("+", "-"))


def test_a_router_that_serves_none_of_a_cell_gets_a_row_saying_so_not_a_latency():
    _need(overhead.TOOL)
    # The load tool says what a router answered when it refused.
    with harness.Backend() as be:
        be.down = True
        r = overhead.run_load(be.addr, 1, 16384, 0.3, "anthropic")
    assert r["requests"] == 0 and r["errors"] > 0
    assert r["first_error"] == "HTTP 503: down"
    served = {"requests": 100, "errors": 0, "rps": 200.0, "p50_us": 400, "p90_us": 450, "p99_us": 600,
              "proxy_cpu_us_per_req": 300.0, "read_per_req": None}
    cells = [
        {**overhead.summary([served, served]), "router": "round-robin"},
        {**overhead.summary([served, r]), "router": "sglang-router"},
    ]
    for c in cells:
        c.update(shape="anthropic", size=262144, concurrency=1)
    assert cells[0]["unserved"] is None and cells[0]["p50_us"] == 400
    assert cells[1]["p50_us"] is None and "HTTP 503: down" in cells[1]["unserved"]
    (row,) = [line for line in overhead.table(cells).splitlines() if line.startswith("| sglang-router |")]
    cols = [c.strip() for c in row.split("|")[1:-1]]
    assert cols[2] == "1" and cols[3].startswith("/v1/messages not served: ") and "HTTP 503: down" in cols[3]
    assert cols[4:9] == [""] * 5 and cols[9] == str(r["errors"])
