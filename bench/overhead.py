"""What the router itself costs: latency added and proxy CPU per request.

Same instant backend (`overhead echo`), same chat bodies (16 KiB and 256 KiB,
64 distinct documents; `--shapes agent`: an agent's turn, ~20 KB of tools,
then tool calls and JSON tool results full of escapes), closed loop at
concurrency 1 and 16, side by side in one run: direct to the backend, Envoy
without the filter, Envoy with the body floor (examples/body_floor.rs: a
wasm filter that holds the request,
reads its body once and writes the destination header, deciding nothing),
Envoy with prefix-router, and sglang-router (`smg launch --policy
cache_aware`) when installed. Envoy runs with --concurrency 2 (`--workers`:
the decision reads state every worker shares, so its cost can depend on
it). All proxies
run at once and their reps take turns, so a slow minute lands on all of
them; each cell is the median of `--reps` runs; proxy CPU comes from
/proc/<pid>/stat (user + system, all threads) over the run.

    scripts/bench-overhead [--seconds 5] [--reps 3] [--sizes 16384,262144] [--shapes chat,agent,anthropic]
        [--routers ...] [--before OLD.wasm] [--module NAME=PATH ...] [--workers 2] [--cookie]

`--cookie` adds `prefix-router-cookie`: the same module with session
affinity in a cookie (`affinity.cookie`), whose load client keeps the
cookie and sends it back as a client's jar does.

`--shapes responses` posts the chat document as a Responses API request to
`/v1/responses` (every prefix-router reads that path); `--responses` adds
`prefix-router-named`: the same module naming each stored response after
its replica (`affinity.response_ids`: the body copied and rewritten).

`--shapes anthropic` posts the agent's turn to `/v1/messages` as a coding
agent (Claude Code) sends it over the Anthropic Messages API, to the same
size: tools with `input_schema`, `system` as text blocks, each call a
`tool_use` block, each result a `tool_result` block, `cache_control`
breakpoints on the system, the last tool and the last block of the last
message. The backend answers it with an Anthropic message.

Each filter row checks that prefix-router read every request's prompt
(its `requests_total` less `decision.no_prompt`, against the requests
sent); a row where it routed some unread says so.

A router that served none of a cell's requests (a path it doesn't route,
a model it doesn't know) gets a row saying what it answered instead of
latency. The backend lists model `m`, the one every body names (smg
routes only to a worker that lists the request's model).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import orchestrate  # noqa: E402
from testkit import harness  # noqa: E402

TOOL = ROOT / "target" / "release" / "overhead"
# What any body-routing wasm filter pays (examples/body_floor.rs).
FLOOR = ROOT / "target" / "body-floor" / "wasm32-wasip1" / "release" / "examples" / "body_floor.wasm"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# How long the echo backend may take to say it is listening.
ECHO_START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def echo_backend():
    port = harness.free_port()
    proc = subprocess.Popen([str(TOOL), "echo", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        # Read in a thread (which then keeps draining the pipe): a plain
        # readline() waits forever for a backend that prints nothing.
        first: queue.Queue[str] = queue.Queue()

        def pump():
            for line in proc.stdout:
                first.put(line)
            first.put("")

        threading.Thread(target=pump, daemon=True).start()
        try:
            line = first.get(timeout=ECHO_START_TIMEOUT_S)
        except queue.Empty:
            line = f"nothing in {ECHO_START_TIMEOUT_S:.0f} s"
        if "listening" not in line:
            raise RuntimeError(f"echo backend did not start: {line!r}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


# Router name -> wasm module, for the Envoy + prefix-router kinds.
MODULES: dict[str, Path] = {}
# Envoy's --concurrency for every Envoy-based router.
WORKERS = 2
# Plugin settings beyond the endpoints, by router name; and the cookie its
# load client keeps (`--cookie`).
PLUGINS: dict[str, dict] = {}
COOKIES: dict[str, str] = {}


@contextlib.contextmanager
def proxy(kind: str, backend: str):
    """Yields (target host:port, pid of the proxy or None, a function that
    reads how many prompts prefix-router read in that proxy, or None when
    it runs none)."""
    if kind == "direct":
        yield backend, None, None
        return
    if kind in MODULES:
        # Scraping off: the echo backend has no metrics page.
        # Every prefix-router reads every shape's path (PATHS): the
        # filter's default paths and the Responses API's.
        paths = {"inference_paths": ["/v1/completions", *dict.fromkeys(PATHS.values())]}
        cfg = harness.render_config(
            "override_host", {"endpoints": [backend], **paths, **PLUGINS.get(kind, {})}, [backend],
            harness.free_port(), harness.free_port(), wasm_path=MODULES[kind],
        )
        with harness.Envoy(cfg, concurrency=WORKERS) as env:

            def prompts() -> int | None:
                # None for a module without prefix-router's counters
                # (the body floor).
                stats = env.stats()
                got = {c: sum(v for k, v in stats.items() if k.endswith(c))
                       for c in (DECISIONS, NO_PROMPT) if any(k.endswith(c) for k in stats)}
                return got[DECISIONS] - got.get(NO_PROMPT, 0) if DECISIONS in got else None

            yield f"127.0.0.1:{env.port}", env.proc.pid, prompts
        return
    router = orchestrate.Router(kind, [backend], WORKERS, 1)
    why = router.unavailable()
    if why:
        raise LookupError(why)
    with router:
        pid = router.envoys[0].proc.pid if router.envoys else router.proc.pid
        yield router.targets[0], pid, None


# The path each body shape is posted to.
PATHS = {"chat": "/v1/chat/completions", "agent": "/v1/chat/completions", "responses": "/v1/responses",
         "anthropic": "/v1/messages"}


def run_load(target: str, concurrency: int, size: int, seconds: float, shape: str = "chat",
             cookie: str = "") -> dict:
    path = PATHS[shape]
    out = subprocess.run(
        [str(TOOL), "load", "--target", f"http://{target}{path}",
         "--concurrency", str(concurrency), "--body-bytes", str(size), "--seconds", str(seconds),
         "--reconnect-every", "50", "--shape", shape, "--cookie", cookie],
        capture_output=True, text=True, timeout=seconds + 60, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="16384,262144")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--shapes", default="chat",
                    help="request bodies: chat (one plain document), agent (tools, tool calls, JSON results), "
                         "responses (the chat document as a Responses API request), "
                         "anthropic (the agent's turn as an Anthropic Messages request, /v1/messages)")
    ap.add_argument("--routers", default="direct,round-robin,body-floor,prefix-router,sglang-router")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--wasm", type=Path, default=harness.WASM, help="the prefix-router module to measure")
    ap.add_argument("--before", type=Path, default=None,
                    help="another build, measured side by side as `prefix-router-before`")
    ap.add_argument("--module", action="append", default=[], metavar="NAME=PATH",
                    help="any other proxy-wasm module, loaded the same way and measured as NAME")
    ap.add_argument("--workers", type=int, default=2, help="Envoy's --concurrency (worker threads)")
    ap.add_argument("--cookie", action="store_true",
                    help="also measure prefix-router-cookie: session affinity in a cookie, sent back")
    ap.add_argument("--responses", action="store_true",
                    help="also measure prefix-router-named: stored responses named after their replica "
                         "(and prefix-router-before-named with --before)")
    a = ap.parse_args(argv)
    global WORKERS
    WORKERS = a.workers
    MODULES["prefix-router"] = a.wasm
    MODULES["body-floor"] = FLOOR
    extra = dict(m.split("=", 1) for m in a.module)
    if a.before:
        extra["prefix-router-before"] = a.before
    if a.cookie:
        extra["prefix-router-cookie"] = a.wasm
        PLUGINS["prefix-router-cookie"] = {"affinity": {
            "key": "bench-overhead-affinity-key-0123456789", "cookie": "prefix-router"}}
        COOKIES["prefix-router-cookie"] = "prefix-router"
    if a.responses:
        named = {"affinity": {"key": "bench-overhead-affinity-key-0123456789", "response_ids": True}}
        extra["prefix-router-named"] = a.wasm
        PLUGINS["prefix-router-named"] = named
        if a.before:
            # The other build's naming, side by side.
            extra["prefix-router-before-named"] = a.before
            PLUGINS["prefix-router-before-named"] = named
    for name, path in extra.items():
        MODULES[name] = Path(path)
        if name not in a.routers.split(","):
            a.routers += f",{name}"
    sizes = [int(s) for s in a.sizes.split(",")]
    concs = [int(c) for c in a.concurrency.split(",")]
    results = []
    with echo_backend() as backend, contextlib.ExitStack() as stack:
        # Every proxy stays up for the whole run and the reps take turns, so
        # a slow minute on this machine lands on every router alike.
        up = {}
        for kind in a.routers.split(","):
            try:
                up[kind] = stack.enter_context(proxy(kind, backend))
            except LookupError as e:
                print(f"overhead: skipping {kind}: {e}", file=sys.stderr)
        for target, _, _ in up.values():
            run_load(target, 4, sizes[0], 1.0)  # warm-up
        for shape, size, conc in itertools.product(a.shapes.split(","), sizes, concs):
            reps = {kind: [] for kind in up}
            for _ in range(a.reps):
                for kind, (target, pid, prompts) in up.items():
                    c0 = cpu_seconds(pid) if pid else 0.0
                    d0 = prompts() if prompts else None
                    r = run_load(target, conc, size, a.seconds, shape, COOKIES.get(kind, ""))
                    r["proxy_cpu_us_per_req"] = (
                        (cpu_seconds(pid) - c0) * 1e6 / max(r["requests"], 1) if pid else 0.0
                    )
                    # How many of the requests the filter read the prompt of
                    # (1.0), not routed on load alone with the body unread
                    # (a path not in its inference_paths costs next to
                    # nothing: not its cost).
                    r["read_per_req"] = (
                        (prompts() - d0) / max(r["requests"] + r["errors"], 1) if d0 is not None else None
                    )
                    reps[kind].append(r)
            for kind, rs in reps.items():
                med = summary(rs)
                med.update(router=kind, size=size, shape=shape, concurrency=conc)
                results.append(med)
                if med["unserved"]:
                    print(f"{kind:14} {shape:9} {size:>7} B  c={conc:<3} {med['unserved']}", file=sys.stderr)
                    continue
                print(f"{kind:14} {shape:9} {size:>7} B  c={conc:<3} p50 {med['p50_us']:>7.0f} us  "
                      f"p99 {med['p99_us']:>7.0f} us  {med['rps']:>7.0f} req/s  "
                      f"cpu {med['proxy_cpu_us_per_req']:>6.0f} us/req", file=sys.stderr)
    report = table(results)
    print(report)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "overhead.json").write_text(json.dumps(results, indent=1))
        (a.out / "overhead.md").write_text(report)
    return 0


# prefix-router's counters of requests it routed, and of those it routed
# without a prompt (the body unread: not an inference path), in Envoy's
# stats.
DECISIONS = "prefix_router.requests_total"
NO_PROMPT = "prefix_router.decision.no_prompt"
METRICS = ("rps", "p50_us", "p90_us", "p99_us", "proxy_cpu_us_per_req")


def summary(rs: list[dict]) -> dict:
    """One cell from its reps: the medians, and the errors. A router that
    answered none of a rep's requests (one that doesn't serve the shape's
    path: smg or vllm-router without the route) has no latency to show:
    its metrics are None and `unserved` says what it answered."""
    out = {"errors": sum(x["errors"] for x in rs), "reps": len(rs), "unserved": None, "read_per_req": None}
    failed = [x for x in rs if x["requests"] == 0]
    if failed:
        why = next((x.get("first_error") for x in failed if x.get("first_error")), None) or "no answer"
        out["unserved"] = f"no request served in {len(failed)} of {len(rs)} reps: {why}"
        out.update(dict.fromkeys(METRICS))
        return out
    out.update({k: statistics.median(x[k] for x in rs) for k in METRICS})
    read = [x.get("read_per_req") for x in rs]
    out["read_per_req"] = None if None in read else min(read)
    return out


def table(results: list[dict]) -> str:
    def key(r: dict, router: str) -> tuple:
        return router, r["shape"], r["size"], r["concurrency"]

    by = {key(r, r["router"]): r for r in results}
    lines = [
        "| router | body | conc | p50 µs | p99 µs | added p50 vs Envoy µs | over body-floor µs | req/s "
        "| proxy CPU µs/req | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.get("unserved"):
            # Errors are not latency: the row says what the router answered.
            why = r["unserved"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['router']} | {r['size'] // 1024} KiB {r['shape']} | {r['concurrency']} "
                         f"| {PATHS[r['shape']]} not served: {why} | | | | | | {r['errors']} |")
            continue
        base = by.get(key(r, "round-robin"))
        if base and base.get("unserved"):
            base = None
        added = "" if not base or r["router"] in ("direct", "round-robin") else f"{r['p50_us'] - base['p50_us']:+.0f}"
        floor = by.get(key(r, "body-floor"))
        if floor and floor.get("unserved"):
            floor = None
        over = f"{r['p50_us'] - floor['p50_us']:+.0f}" if floor and r["router"] in MODULES and r is not floor else ""
        cpu = "" if r["router"] == "direct" else f"{r['proxy_cpu_us_per_req']:.0f}"
        name = r["router"]
        if r.get("read_per_req") is not None and r["read_per_req"] < 0.99:
            # The filter routed these requests without reading them: not
            # its cost.
            name += f" (read {r['read_per_req']:.0%} of the prompts)"
        lines.append(
            f"| {name} | {r['size'] // 1024} KiB {r['shape']} | {r['concurrency']} | {r['p50_us']:.0f} | "
            f"{r['p99_us']:.0f} | {added} | {over} | {r['rps']:.0f} | {cpu} | {r['errors']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
