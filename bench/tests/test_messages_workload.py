"""The agentic-messages workload: the agentic sessions over the Anthropic
Messages API (`/v1/messages`), as Claude Code sends them to a self-hosted
vLLM, through the harness on simulated replicas that serve the API as vLLM
does (converted into the equivalent chat request).

Checks the workload's plumbing end to end, for Envoy + prefix-router and
Envoy round robin: every turn is answered; the load generator reads the
Anthropic event stream (text, TTFT, usage with the cached tokens, the
end), so the client's hit rate is the replicas' own; and the cache-hit
bound is computed from what the replicas rendered (its prompt tokens are
exactly the usage the replicas reported). Also: a peer router that
doesn't serve the API is reported as skipped, with the reason, instead of
being measured.

Needs: target/release/{replica-sim,prefix-bench} (built here if missing),
the wasm module (scripts/build) and Envoy (scripts/setup). About 40-60 s;
the probe tests are pure Python.
"""
from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import orchestrate  # noqa: E402
import report  # noqa: E402
from test_bench_smoke import _need_binaries  # noqa: E402

STREAM = ("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n"
          "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")


@pytest.fixture
def fake_router():
    """A local HTTP server answering POSTs with (status, content type,
    body) from `answer`; its address. Shut down after the test."""
    answer = {"status": 404, "type": "application/json", "body": '{"error":"Not Found"}'}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = answer["body"].encode()
            self.send_response(answer["status"])
            self.send_header("content-type", answer["type"])
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_probe_tells_a_router_without_the_api_from_one_with_it(fake_router):
    addr, answer = fake_router
    path, body = orchestrate.profiles(orchestrate.parser().parse_args([]))["agentic-messages"]["probe"]
    assert path == "/v1/messages"
    why = orchestrate.probe(addr, path, body)
    assert why is not None and why.startswith("does not serve /v1/messages: HTTP 404"), why
    # A 200 that is no event stream (a router that answered for itself).
    answer.update(status=200, body='{"ok": true}')
    why = orchestrate.probe(addr, path, body)
    assert why is not None and "not a complete event stream" in why, why
    answer.update(status=200, type="text/event-stream", body=STREAM)
    assert orchestrate.probe(addr, path, body) is None


def test_the_profile_is_agentics_sessions_over_the_messages_api():
    profiles = orchestrate.profiles(orchestrate.parser().parse_args([]))
    agentic, messages = profiles["agentic"], profiles["agentic-messages"]
    assert messages["load"] == [*agentic["load"], "--api", "messages"]
    assert "/v1/messages" in messages["plugin"]["inference_paths"]
    assert {k: messages[k] for k in ("replicas", "preset", "time_scale", "kv_tokens", "max_model_len")} == \
        {k: agentic[k] for k in ("replicas", "preset", "time_scale", "kv_tokens", "max_model_len")}
    assert "agentic-messages" in orchestrate.WORKLOADS and "agentic-messages" in orchestrate.SESSION_WORKLOADS
    assert orchestrate.parser().parse_args(["--workload", "agentic-messages"]).workload == "agentic-messages"
    # A skipped peer's reason is in its row of the report.
    results = {"workloads": {"agentic-messages": {"setup": {}, "runs": [
        {"label": "vllm-router (cache_aware)", "skipped": "does not serve /v1/messages: HTTP 404"}]}}}
    md = report.render(results)
    assert "| vllm-router (cache_aware) | skipped: does not serve /v1/messages: HTTP 404 |" in md
    assert report.WORKLOAD_TITLES["agentic-messages"] in md


def test_every_turn_is_served_and_measured_from_the_anthropic_stream(tmp_path):
    _need_binaries()
    out = tmp_path / "results"
    rc = orchestrate.main([
        "--workload", "agentic-messages",
        "--routers", "prefix-router,round-robin",
        "--sessions", "3",
        "--agent-think", "0.5",
        "--time-scale", "0.1",
        "--max-run-seconds", "40",
        "--drain-seconds", "20",
        "--no-plots",
        "--out", str(out),
    ])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    runs = {r["router"]: r for r in results["workloads"]["agentic-messages"]["runs"]}
    assert set(runs) == {"prefix-router", "round-robin"}
    for kind, r in runs.items():
        assert not r.get("skipped"), (kind, r.get("skipped"))
        # Every session's turns were sent to /v1/messages and answered.
        assert r["errors"] == 0, (kind, r["error_kinds"])
        assert r["requests"] >= 3 * 10, kind
        records = json.loads((out / r["records_file"]).read_text())["records"]
        assert all(x["ttft_ms"] is not None and x["chunks"] > 0 for x in records), kind
        # The usage the event stream carried: the client's hit rate is the
        # replicas' own (cache_read_input_tokens / input_tokens).
        assert r["client_hit_rate"] is not None and r["hit_rate"] is not None, kind
        assert abs(r["client_hit_rate"] - r["hit_rate"]) < 0.01, (kind, r["client_hit_rate"], r["hit_rate"])
        # The bound from what the replicas rendered (the chat request each
        # Messages body converts to): the same prompt tokens they reported.
        ub = r["upper_bound"]
        assert ub["requests"] == r["requests"], kind
        assert ub["prompt_tokens"] == sum(x["prompt_tokens"] for x in records), kind
        assert ub["prompt_tokens"] > 3 * 10 * 10_000, kind
        assert r["ttft_later_turns_ms"]["n"] == r["requests"] - 3, kind
    # Sessions resend a long shared history: any router's replicas reuse
    # some of it (the shared tools and system prompt at least).
    assert runs["round-robin"]["hit_rate"] > 0.3
