"""Coding agents over the Anthropic Messages API (`/v1/messages`), through
a real Envoy in front of simulated replicas that serve it as vLLM does:
each session's turns stay on the replica that holds its history, and the
replica's cache holds the whole previous turn though Claude Code moves its
cache breakpoint to the newest message every turn."""
from __future__ import annotations

import itertools
import json
from collections import defaultdict

from harness import filter_envoy, request
from test_lora import SIM, replica_sim

CC = {"type": "ephemeral"}

# Claude Code's attribution block's `cch`: another value every request.
CCH = itertools.count(0x1A2B3)

# The sims' `fast` preset: 16-token blocks.
BLOCK_TOKENS = 16


def tools() -> list[dict]:
    # About 20 KB of tool definitions, shared by every session.
    return [
        {
            "name": f"tool_{i}",
            "description": f"Runs step {i} of the build and returns its log as text.",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
            **({"cache_control": CC} if i == 99 else {}),
        }
        for i in range(100)
    ]


def body(session: int, history: list[dict], stream: bool) -> dict:
    """One turn as Claude Code sends it: tools, system blocks (the first
    its per-request attribution, which vLLM drops), the whole history, and
    a breakpoint on the newest message's last block only."""
    messages = json.loads(json.dumps(history))
    messages[-1]["content"][-1]["cache_control"] = CC
    return {
        "model": "m",
        "max_tokens": 8,
        "stream": stream,
        "tools": tools(),
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.42.834; cc_entrypoint=cli; cch={next(CCH):05x};"},
            {"type": "text", "text": "You are a coding agent. Use the tools; never guess."},
            {"type": "text", "text": f"Working directory: /src/project-{session}", "cache_control": CC},
        ],
        "messages": messages,
    }


def test_agent_sessions_over_the_messages_api_keep_their_replica_and_its_cache():
    assert SIM.exists(), "build replica-sim first (scripts/build)"
    # Agent sessions grow past the `fast` preset's 4k-token context.
    with replica_sim(4, "--max-model-len", "65536", "--kv-tokens", "262144") as pool, filter_envoy(pool, {"debug_header": True}, concurrency=2) as envoy:
        # A first turn as Claude Code's: the task with the project's
        # context (~2 KB), past a checkpoint below the shared part.
        histories = {
            s: [{"role": "user", "content": [{"type": "text", "text": f"Task {s}: fix the failing test.\n"
                 + "".join(f"src/module_{s}_{i}.rs: 120 lines\n" for i in range(60))}]}]
            for s in range(4)
        }
        homes = defaultdict(list)
        last: dict[int, int] = {}  # each session's last known prompt length
        for turn in range(6):
            for s, history in histories.items():
                stream = turn == 3
                status, headers, data = request(
                    envoy.port, path="/v1/messages", body=body(s, history, stream)
                )
                assert status == 200, data
                homes[s].append(headers["x-served-by"])
                if turn > 0:
                    # The replica of the session's first turn holds the
                    # most of it: what the filter found there.
                    debug = headers["x-prefix-router-debug"]
                    held = dict(m.split("=") for m in debug.split("cost/matched: ")[1].split())
                    matched = sorted((int(v.split("/")[1]), a) for a, v in held.items())
                    assert matched[-1][1] == homes[s][0] and matched[-2][0] < matched[-1][0], (s, turn, debug)
                if stream:
                    assert b"event: message_stop" in data, data[-200:]
                    last.pop(s, None)
                else:
                    usage = json.loads(data)["usage"]
                    if s in last:
                        # The whole previous prompt was read from the cache
                        # (up to its last partial block).
                        assert usage["cache_read_input_tokens"] >= last[s] - BLOCK_TOKENS, (s, turn, usage)
                    last[s] = usage["input_tokens"]
                # The agent calls a tool and sends its result back.
                call = f"toolu_{s}_{turn}"
                history.append({"role": "assistant", "content": [
                    {"type": "text", "text": "Running the build."},
                    {"type": "tool_use", "id": call, "name": f"tool_{turn}", "input": {"path": f"src/{s}.rs"}},
                ]})
                history.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call,
                     "content": f"log of step {turn} for session {s}\n" + "ok: compiled unit\n" * 200},
                ]})
        for s, served in homes.items():
            assert len(set(served)) == 1, (s, served)
        # New sessions below the shared tools and system prompt spread.
        assert len({served[0] for served in homes.values()}) >= 3, dict(homes)
        assert envoy.stat("prefix_router.parse_errors") == 0
