"""The overhead benchmark's parts: the body-floor reference module does the
routing chores it claims to (so its row is a real floor, not a filter that
crashed and was bypassed), and a tiny run reports every router it was
asked for, with the floor column.

Needs scripts/build (the modules, the `overhead` tool) and Envoy. ~15 s.
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
