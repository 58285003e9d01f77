"""Benchmark orchestrator: simulated replicas, each router in turn, the load
generator, replica metrics, then the report.

For every workload: start one `replica-sim` process (N replicas), then for
every router: start it (Envoy + prefix-router, Envoy's own policies, or a
peer router from PyPI), `POST /reset` every replica, snapshot the replicas'
metrics, run `prefix-bench` against the router while polling the replicas'
queue depth, snapshot again, stop the router. Results go to
bench/results/<timestamp>/: results.json (every number), report.md, one
JSON per run with per-request records, and PNG plots when matplotlib is
installed.

Every process started here is killed by pid when its run ends, and again at
exit (atexit, SIGTERM/SIGINT), pass or fail. Every run is bounded in time.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.metadata
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from testkit import harness  # noqa: E402  (render_config, Envoy, free_port)

SIM_BIN = ROOT / "target" / "release" / "replica-sim"
BENCH_BIN = ROOT / "target" / "release" / "prefix-bench"
SESSION_HEADER = "x-session-id"

ALL_ROUTERS = [
    "prefix-router",
    "prefix-router-odst",
    "round-robin",
    "least-request",
    "ring-hash",
    "sglang-router",
    "vllm-router",
]
ROUTER_LABELS = {
    "prefix-router": "Envoy + prefix-router (override_host)",
    "prefix-router-odst": "Envoy + prefix-router (original_dst)",
    "round-robin": "Envoy ROUND_ROBIN",
    "least-request": "Envoy LEAST_REQUEST",
    "ring-hash": f"Envoy RING_HASH on {SESSION_HEADER}",
    "sglang-router": "sglang-router / smg (cache_aware)",
    "vllm-router": "vllm-router (cache_aware)",
}


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Process ownership: everything we start is killed by pid.

_OWNED: list[subprocess.Popen] = []


def own(p: subprocess.Popen) -> subprocess.Popen:
    _OWNED.append(p)
    return p


def kill(p: subprocess.Popen | None, grace: float = 5.0) -> None:
    if p is None or p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
    except ProcessLookupError:
        pass


@atexit.register
def _kill_all() -> None:
    for p in reversed(_OWNED):
        kill(p, grace=2.0)


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _on_signal)


def cpu_seconds(pid: int) -> float:
    try:
        after = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# --------------------------------------------------------------------------
# Replicas


class Sim:
    """One replica-sim process serving N replicas on free ports."""

    def __init__(self, replicas: int, preset: str, time_scale: float, kv_tokens: int | None,
                 max_model_len: int | None = None, port: int = 0, kv_fractions: str | None = None):
        # Port 0: free ports. A fixed first port pins every replica's address
        # (`port`..`port + replicas - 1`), and with it the rendezvous draw.
        self.args = [
            str(SIM_BIN), "--port", str(port), "--replicas", str(replicas),
            "--preset", preset, "--time-scale", str(time_scale),
        ]
        if kv_tokens:
            self.args += ["--kv-tokens", str(kv_tokens)]
        if kv_fractions:
            # Mixed cards: replica i keeps this share of the KV cache.
            self.args += ["--kv-fractions", kv_fractions]
        if max_model_len:
            # replica-sim clamps it to the KV capacity.
            self.args += ["--max-model-len", str(max_model_len)]
        self.replicas = replicas
        self.proc: subprocess.Popen | None = None
        self.addrs: list[str] = []

    # How long replica-sim may take to announce every replica.
    START_TIMEOUT_S = 30.0

    def __enter__(self):
        if not SIM_BIN.exists():
            raise RuntimeError(f"{SIM_BIN} missing: cargo build --release -p replica-sim")
        self.proc = own(subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        # stdout is read in a thread (which keeps draining it, so the child
        # never blocks on a full pipe): a readline() here would wait past
        # the deadline for a replica-sim that prints nothing.
        announced: queue.Queue[str | None] = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                if line.startswith("replica-sim listening on "):
                    announced.put(line.split()[-1])
            announced.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.START_TIMEOUT_S
        try:
            while len(self.addrs) < self.replicas:
                try:
                    addr = announced.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(
                        f"replica-sim did not announce all replicas in {self.START_TIMEOUT_S:.0f} s"
                    ) from None
                if addr is None:
                    raise RuntimeError(f"replica-sim exited: {self.proc.stderr.read()[-2000:]}")
                self.addrs.append(addr)
        except BaseException:
            # `with` calls __exit__ only after __enter__ returned.
            kill(self.proc)
            raise
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        return self

    def __exit__(self, *exc):
        kill(self.proc)

    def reset(self, timeout_s: float = 60.0) -> None:
        """Empty every replica's cache and counters. A replica still
        serving the last run's requests keeps their blocks (they'd be
        cached for the next router): wait until it has none in flight."""
        deadline = time.time() + timeout_s
        for a in self.addrs:
            while True:
                answer = json.loads(http("POST", f"http://{a}/reset", b"{}", timeout=30))
                if answer.get("in_flight", 0) == 0 and answer.get("cache_cleared", True):
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"replica {a} still has requests in flight after {timeout_s:.0f} s: {answer}")
                time.sleep(0.5)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {a: prom_sums(http("GET", f"http://{a}/metrics", timeout=5)) for a in self.addrs}

    def fault(self, addr: str, mode: str) -> None:
        """Set a replica's /metrics fault: `error` takes it out of
        prefix-router's pool within a few scrapes, `ok` brings it back."""
        http("POST", f"http://{addr}/admin/metrics-fault", json.dumps({"mode": mode}).encode())


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> str:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values by nearest rank, as the load
    generator computes its own (bench/src/stats.rs), so the report's
    columns agree."""
    rank = math.ceil(q * len(ordered))
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def prom_sums(text: str) -> dict[str, float]:
    """Prometheus text -> value summed over label sets, by metric name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class Poller(threading.Thread):
    """Polls every replica's `vllm:num_requests_waiting` during a run."""

    def __init__(self, sim: Sim, interval: float = 0.2):
        super().__init__(daemon=True)
        self.sim, self.interval = sim, interval
        self.stop_ev = threading.Event()
        self.peak_total = 0.0
        self.peak_replica = 0.0
        self.samples: list[tuple[float, float]] = []

    def run(self):
        t0 = time.time()
        while not self.stop_ev.is_set():
            total = 0.0
            for a in self.sim.addrs:
                try:
                    w = prom_sums(http("GET", f"http://{a}/metrics", timeout=2)).get(
                        "vllm:num_requests_waiting", 0.0)
                except OSError:
                    continue
                total += w
                self.peak_replica = max(self.peak_replica, w)
            self.peak_total = max(self.peak_total, total)
            self.samples.append((round(time.time() - t0, 2), total))
            self.stop_ev.wait(self.interval)

    def stop(self):
        self.stop_ev.set()
        self.join(timeout=5)


# --------------------------------------------------------------------------
# Routers


def venv_tool(name: str) -> str | None:
    for d in (Path(sys.executable).parent, ROOT / ".venv-bench" / "bin", ROOT / ".venv" / "bin"):
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


# Session-affinity token header (--affinity) and cookie (--affinity-cookie).
AFFINITY_HEADER = "x-prefix-router-affinity"
# The affinity key every instance shares (--affinity, --affinity-cookie,
# the agentic-responses workload's response names).
AFFINITY_KEY = "prefix-bench-affinity-key-0123456789abcdef"
AFFINITY_COOKIE = "prefix-router"
# Extra prefix-router plugin keys from --plugin (tuning experiments).
PLUGIN_EXTRA: dict = {}
# Extra command-line arguments per peer router (`--sglang-args`,
# `--vllm-router-args`): their cache_aware thresholds, say, tuned as their
# docs advise for the workload.
PEER_ARGS: dict[str, list[str]] = {"sglang-router": [], "vllm-router": []}
# The wasm module under test (--wasm; default: scripts/build's).
WASM_PATH: list[Path] = [harness.WASM]
# Envoy's per-connection buffer limit (listener). The filter buffers the
# whole request body, so this is the largest prompt it can route; the
# agentic workload sends bodies of 200+ KB. Set here, not left to the dev
# configs.
BUFFER_LIMIT = 16 * 1024 * 1024


def envoy_config(kind: str, pool: list[str], port: int, admin: int, instances: int = 1,
                 workload_plugin: dict | None = None) -> dict:
    """Envoy config for one router kind, rendered from envoy/*.yaml.

    prefix-router runs as recommended: metrics scraping on (`cluster`),
    told how many independent gateways there are (`gateways`, see README,
    Many gateways), with what the workload needs (its profile's `plugin`:
    the Responses API's path and response naming), plus whatever --plugin
    adds (which may override it; an `affinity` object is merged)."""
    limits = {"buffer_limit": BUFFER_LIMIT, "wasm_path": WASM_PATH[0]}
    gateways = {"gateways": instances} if instances > 1 else {}
    extra = dict(workload_plugin or {})
    for k, v in PLUGIN_EXTRA.items():
        both = isinstance(v, dict) and isinstance(extra.get(k), dict)
        extra[k] = {**extra[k], **v} if both else v
    if kind == "prefix-router":
        plugin = {"endpoints": pool, "cluster": "pool", "max_fallbacks": 1, **gateways, **extra}
        return harness.render_config("override_host", plugin, pool, port, admin, **limits)
    if kind == "prefix-router-odst":
        plugin = {"endpoints": pool, "cluster": "pool", **gateways, **extra}
        return harness.render_config("original_dst", plugin, pool, port, admin, **limits)
    # Envoy's own policies: the override_host config without the wasm filter
    # and with a plain lb_policy.
    cfg = harness.render_config("override_host", {"endpoints": pool}, pool, port, admin, **limits)
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.wasm"]
    cluster = cfg["static_resources"]["clusters"][0]
    cluster.pop("load_balancing_policy", None)
    cluster["lb_policy"] = {"round-robin": "ROUND_ROBIN", "least-request": "LEAST_REQUEST",
                            "ring-hash": "RING_HASH"}[kind]
    if kind == "ring-hash":
        route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        route["hash_policy"] = [{"header": {"header_name": SESSION_HEADER}}]
    return cfg


# Workloads of conversations / sessions: TTFT over turns 2+ is reported too.
SESSION_WORKLOADS = ("multi-turn", "agentic", "agentic-responses", "agentic-messages")


def turns_ttft(doc: dict, time_scale: float) -> tuple[list[float], list[float]]:
    """TTFTs (simulated ms) of the successful requests, split into each
    conversation's or session's first turn and its later turns."""
    recs = sorted((r for r in doc.get("records", []) if r.get("ok")), key=lambda r: r["start_s"])
    seen, first, later = set(), [], []
    for r in recs:
        # A turn without a first token (none asked for) still opens its key.
        if r.get("ttft_ms") is not None:
            (later if r.get("key") in seen else first).append(r["ttft_ms"] / time_scale)
        seen.add(r.get("key"))
    return first, later


def later_turns_ttft(doc: dict, time_scale: float) -> dict | None:
    """TTFT percentiles (simulated ms) over turns 2+ of every conversation
    or agent session: the first turn is a cold prefill for any router, so
    this is the part routing decides."""
    _, later = turns_ttft(doc, time_scale)
    if not later:
        return None
    later.sort()
    pick = lambda q: nearest_rank(later, q)  # noqa: E731
    return {"n": len(later), "mean": sum(later) / len(later), "p50": pick(0.5), "p95": pick(0.95)}


# Open-loop workloads whose cold start (a long preamble prefilled on every
# replica, a backlog behind it) is a large part of a short run: TTFT over the
# requests sent after the first quarter of the run gets its own table. Every
# run records that p95 (`ttft_warm_p95_ms`) for the many-gateways table.
WARM_WORKLOADS = ("long-preamble",)


def warm_ttft(doc: dict, time_scale: float, skip: float = 0.25) -> dict | None:
    """TTFT percentiles (simulated ms) over the requests sent after the
    first `skip` of the sending period: caches warm, start-up backlog gone."""
    recs = [r for r in doc.get("records", []) if r.get("ok") and r.get("ttft_ms") is not None]
    if not recs:
        return None
    t0 = min(r["start_s"] for r in recs)
    t1 = max(r["start_s"] for r in recs)
    cut = t0 + skip * (t1 - t0)
    warm = sorted(r["ttft_ms"] / time_scale for r in recs if r["start_s"] >= cut)
    if not warm:
        return None
    pick = lambda q: nearest_rank(warm, q)  # noqa: E731
    return {"n": len(warm), "skip": skip, "after_s": (cut - t0) / time_scale,
            "mean": sum(warm) / len(warm), "p50": pick(0.5), "p95": pick(0.95), "p99": pick(0.99)}


def key_affinity(doc: dict) -> float | None:
    """Share of requests served by the replica that served their key (group,
    document, conversation, session) most often: 1.0 = every key sticks to
    one replica; about 1/replicas = no affinity."""
    by_key: dict[str, dict[str, int]] = {}
    for r in doc.get("records", []):
        if r.get("ok") and r.get("served_by"):
            counts = by_key.setdefault(r.get("key", ""), {})
            counts[r["served_by"]] = counts.get(r["served_by"], 0) + 1
    total = sum(sum(c.values()) for c in by_key.values())
    return sum(max(c.values()) for c in by_key.values()) / total if total else None


def placement_moves(doc: dict, changed: str, change: str, at_s: float) -> dict:
    """How many keys (groups, documents, conversations) changed replica
    when one replica left (`remove`) or joined (`add`) the pool `at_s`
    seconds into the run: each key's usual replica before, and after (from
    one second later, once the filter has seen the change). Consistent
    placement moves only the keys that must move: those on the replica
    that left, or about 1/N of them to the one that joined."""
    def usual(records) -> dict[str, str]:
        by_key: dict[str, dict[str, int]] = {}
        for r in records:
            c = by_key.setdefault(r.get("key", ""), {})
            c[r["served_by"]] = c.get(r["served_by"], 0) + 1
        return {k: max(c, key=c.get) for k, c in by_key.items()}

    ok = [r for r in doc.get("records", []) if r.get("ok") and r.get("served_by")]
    before = usual(r for r in ok if r["start_s"] < at_s)
    after = usual(r for r in ok if r["start_s"] >= at_s + 1.0)
    both = [k for k in before if k in after]
    moved = [k for k in both if before[k] != after[k]]
    forced = [k for k in moved if (before[k] == changed if change == "remove" else after[k] == changed)]
    return {"change": change, "replica": changed, "at_s": at_s, "keys": len(both),
            "moved": len(moved), "moved_as_needed": len(forced), "moved_otherwise": len(moved) - len(forced),
            "on_changed_before": sum(1 for k in both if before[k] == changed),
            "on_changed_after": sum(1 for k in both if after[k] == changed)}


ENVOY_ROUTERS = ("prefix-router", "prefix-router-odst", "round-robin", "least-request", "ring-hash")


def is_envoy(kind: str) -> bool:
    return kind in ENVOY_ROUTERS


def run_plan(routers: list[str], instances: list[int]) -> list[tuple[str, int]]:
    """(router, Envoy instances) for every run, in order: each Envoy-based
    router once per instance count, a peer router (one process of its own)
    once."""
    return [(r, n) for r in routers for n in (instances if is_envoy(r) else [1])]


def instance_counts(text: str) -> list[int]:
    """`--envoy-instances`: one count or a comma-separated list (1,2,3,4)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or a list of counts: {text!r}") from None
    if not counts or any(not 1 <= n <= 16 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"want distinct counts from 1 to 16: {text!r}")
    return counts


class Router:
    """Starts one router (maybe several Envoy instances); `targets` are the
    host:port addresses the load generator uses."""

    def __init__(self, kind: str, pool: list[str], envoy_concurrency: int, envoy_instances: int,
                 plugin: dict | None = None):
        self.kind, self.pool, self.plugin = kind, pool, plugin
        self.envoy_concurrency, self.envoy_instances = envoy_concurrency, envoy_instances
        self.targets: list[str] = []
        self.envoys: list[harness.Envoy] = []
        self.proc: subprocess.Popen | None = None
        self.logfile = None
        self.stack = contextlib.ExitStack()

    @property
    def is_envoy(self) -> bool:
        return is_envoy(self.kind)

    def unavailable(self) -> str | None:
        if self.is_envoy:
            if not Path(harness.envoy_bin()).exists() and not shutil.which(harness.envoy_bin()):
                return "envoy not found (run scripts/setup)"
            if self.kind.startswith("prefix-router") and not WASM_PATH[0].exists():
                return f"{WASM_PATH[0]} missing (run scripts/build)"
            return None
        tool = {"sglang-router": "smg", "vllm-router": "vllm-router"}[self.kind]
        if venv_tool(tool) is None and not (self.kind == "sglang-router" and venv_tool("sglang-router")):
            return f"`{tool}` not installed (scripts/bench installs it into .venv-bench from PyPI)"
        return None

    def __enter__(self):
        try:
            if self.is_envoy:
                for _ in range(self.envoy_instances):
                    cfg = envoy_config(self.kind, self.pool, harness.free_port(), harness.free_port(),
                                       self.envoy_instances, self.plugin)
                    env = harness.Envoy(cfg, concurrency=self.envoy_concurrency)
                    # An Envoy that fails to become ready is killed there.
                    env.__enter__()
                    own(env.proc)
                    self.stack.push(env.__exit__)
                    self.envoys.append(env)
                    self.targets.append(f"127.0.0.1:{env.port}")
            else:
                self._start_peer()
        except BaseException:
            self.stack.close()
            raise
        return self

    def _start_peer(self):
        port, prom = harness.free_port(), harness.free_port()
        urls = [f"http://{a}" for a in self.pool]
        if self.kind == "sglang-router":
            smg = venv_tool("smg")
            cmd = [smg, "launch"] if smg else [venv_tool("sglang-router")]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                    "--worker-urls", *urls, "--prometheus-port", str(prom),
                    "--prometheus-host", "127.0.0.1", "--log-level", "warn",
                    "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1"]
        else:
            cmd = [venv_tool("vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                   "--policy", "cache_aware", "--worker-urls", *urls,
                   "--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1",
                   "--log-level", "warning", "--worker-startup-timeout-secs", "30",
                   "--worker-startup-check-interval", "1"]
        cmd += PEER_ARGS[self.kind]
        self.logfile = tempfile.NamedTemporaryFile(prefix=f"bench-{self.kind}-", suffix=".log", delete=False)
        self.proc = own(subprocess.Popen(cmd, stdout=self.logfile, stderr=subprocess.STDOUT, cwd=ROOT))
        self.stack.callback(kill, self.proc)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited {self.proc.returncode}: {self.log_tail()}")
            try:
                http("GET", f"http://127.0.0.1:{port}/health", timeout=1)
                # Routed end to end (the router knows its workers)?
                http("GET", f"http://127.0.0.1:{port}/v1/models", timeout=2)
                self.targets = [f"127.0.0.1:{port}"]
                return
            except (OSError, urllib.error.HTTPError):
                time.sleep(0.3)
        raise RuntimeError(f"{self.kind} not ready in 60 s: {self.log_tail()}")

    def log_tail(self) -> str:
        if self.envoys:
            return self.envoys[0].log()[-2000:]
        if self.logfile:
            with contextlib.suppress(OSError):
                return Path(self.logfile.name).read_text(errors="replace")[-2000:]
        return ""

    def pids(self) -> list[int]:
        if self.envoys:
            return [e.proc.pid for e in self.envoys]
        return [self.proc.pid] if self.proc else []

    def filter_stats(self) -> dict[str, int]:
        """prefix-router's own counters, summed over Envoy instances."""
        out: dict[str, int] = {}
        for e in self.envoys:
            with contextlib.suppress(OSError):
                for k, v in e.stats().items():
                    if "prefix_router." in k and ".replica." not in k:
                        short = k.split("prefix_router.", 1)[1]
                        out[short] = out.get(short, 0) + v
        return out

    def __exit__(self, *exc):
        self.stack.close()
        if self.logfile:
            self.logfile.close()
            with contextlib.suppress(OSError):
                os.unlink(self.logfile.name)


# --------------------------------------------------------------------------
# Workloads


def profiles(a) -> dict[str, dict]:
    """Per workload: replica set-up and load generator arguments."""
    kv_scaled = max(4096, int(100_000 * a.scale))
    out = {
        # The published shape: 150 groups x 2,048-token prefixes, 9,000
        # prompts, 8 replicas. --scale shrinks groups, prompts and each
        # replica's KV cache together, so round robin still has ~3x more
        # distinct prefix per replica than fits and a prefix-aware router
        # still fits its share.
        "shared-prefix": dict(
            replicas=a.replicas or 8, preset=a.preset or "a10g-7b",
            time_scale=a.time_scale or 0.25, kv_tokens=a.kv_tokens or kv_scaled,
            load=["--mode", "open", "--rate", str(a.rate or 12.0), "--scale", str(a.scale),
                  "--max-tokens", str(a.max_tokens or 32),
                  "shared-prefix", "--groups", str(a.groups), "--prompts", str(a.prompts),
                  "--prefix-tokens", str(a.prefix_tokens), "--question-tokens", "32"],
        ),
        # The published multi-turn test: 11 conversations x 10 turns, 4 L4
        # replicas; already small, so --scale doesn't shrink it.
        "multi-turn": dict(
            replicas=a.replicas or 4, preset=a.preset or "l4-7b",
            time_scale=a.time_scale or 0.1, kv_tokens=a.kv_tokens,
            load=["--max-tokens", str(a.max_tokens or 64),
                  "multi-turn", "--conversations", str(a.conversations), "--turns", str(a.turns),
                  "--think", str(a.think)],
        ),
        # A recorded trace (JSONL, see `prefix-bench replay --help`).
        "replay": dict(
            replicas=a.replicas or 8, preset=a.preset or "a10g-7b",
            time_scale=a.time_scale or 0.25, kv_tokens=a.kv_tokens,
            load=["--max-tokens", str(a.max_tokens or 32),
                  "replay", str(a.trace), "--speedup", str(a.speedup)],
        ),
        "unique": dict(
            replicas=a.replicas or 8, preset=a.preset or "a10g-7b",
            time_scale=a.time_scale or 0.25, kv_tokens=a.kv_tokens or kv_scaled,
            load=["--mode", "open", "--rate", str(a.rate or 12.0), "--scale", str(a.scale),
                  "--max-tokens", str(a.max_tokens or 32),
                  "unique", "--prompts", "2000", "--prompt-tokens", "256"],
        ),
        # One ~40 KB shared system message (instructions + JSON tools, about
        # 13.6k tokens: longer than any fixed hashing window), then one of
        # 64 documents (1-2k tokens, Zipf 0.8) and a question. 48k tokens of
        # KV per replica: the preamble plus about 20 documents, so one
        # replica holds under a third of the 103k tokens of documents while
        # the pool of 4 holds them all. Sized for this machine: --scale
        # doesn't change it.
        "long-preamble": dict(
            replicas=a.replicas or 4, preset=a.preset or "a10g-7b",
            time_scale=a.time_scale or 0.25, kv_tokens=a.kv_tokens or 48_000,
            load=["--mode", "open", "--rate", str(a.rate or 8.0),
                  "--max-tokens", str(a.max_tokens or 32),
                  "long-preamble", "--prompts", str(a.lp_prompts), "--documents", str(a.documents),
                  "--preamble-bytes", "40000", "--zipf", str(a.zipf)],
        ),
        # 8 agent sessions (closed loop each) sharing ~40 KB of tools +
        # system prompt (~15.5k tokens); 10-30 turns, each adding a tool call
        # and a 2-8 KB tool result, up to ~75k tokens (200 KB) a session.
        # 128k tokens of KV per replica (a larger card than the preset's
        # 100k): two sessions' histories fit, all eight (~430k tokens) don't.
        "agentic": dict(
            replicas=a.replicas or 4, preset=a.preset or "a10g-7b",
            time_scale=a.time_scale or 0.25, kv_tokens=a.kv_tokens or 128_000,
            max_model_len=131_072,
            load=["--max-tokens", str(a.max_tokens or 32),
                  "agentic", "--sessions", str(a.sessions), "--min-turns", "10", "--max-turns", "30",
                  "--shared-bytes", "40000", "--think", str(a.agent_think)],
        ),
    }
    # The agentic sessions over the Responses API with stored responses
    # (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1): each turn names the
    # last (`previous_response_id`) and sends only the new tool output, so
    # only the replica that stored the last response can serve it; any
    # other answers 404 and the agent stops. prefix-router runs as its
    # README advises for this API: the path parsed, responses named after
    # their replica (`affinity.response_ids`, one key on every instance).
    out["agentic-responses"] = {
        **out["agentic"],
        "load": [*out["agentic"]["load"], "--api", "responses"],
        "plugin": {"inference_paths": ["/v1/completions", "/v1/chat/completions", "/v1/responses"],
                   "affinity": {"key": AFFINITY_KEY, "response_ids": True}},
    }
    # The agentic sessions over the Anthropic Messages API, as Claude Code
    # sends them to a self-hosted vLLM (`/v1/messages`): the whole history
    # every turn, tool calls as `tool_use` blocks, results as `tool_result`
    # blocks, `cache_control` breakpoints moving to the newest block. The
    # replicas render each as the chat request vLLM converts it to, so the
    # sessions cost what `agentic`'s do. prefix-router parses the path; a
    # peer router that doesn't serve it is reported as such (`probe`).
    out["agentic-messages"] = {
        **out["agentic"],
        "load": [*out["agentic"]["load"], "--api", "messages"],
        "plugin": {"inference_paths": ["/v1/completions", "/v1/chat/completions", "/v1/messages"]},
        "probe": ("/v1/messages", {"model": "sim-model", "max_tokens": 1, "stream": True,
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "ping"}]}]}),
    }
    return out


def probe(target: str, path: str, body: dict, timeout: float = 30.0) -> str | None:
    """Why a router can't serve the workload's API, or None: one small
    streamed request on `path` must answer 2xx with a complete event
    stream (a router without the route answers 404 or 405, or passes a
    body the replicas refuse)."""
    req = urllib.request.Request(f"http://{target}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()[:200]
        return f"does not serve {path}: HTTP {e.code}" + (f" {detail}" if detail else "")
    except OSError as e:
        return f"does not serve {path}: {e}"
    if "message_stop" not in text and "[DONE]" not in text:
        return f"does not serve {path}: the answer is not a complete event stream: {text[:200]!r}"
    return None


def run_loadgen(targets: list[str], prof: dict, sim: Sim, out: Path, a) -> dict:
    cmd = [str(BENCH_BIN), "--target", ",".join(targets), "--time-scale", str(prof["time_scale"]),
           *(["--random-target"] if len(targets) > 1 else []),
           "--seed", str(a.seed), "--replicas", str(len(sim.addrs)), "--tokenize", sim.addrs[0],
           "--session-header", SESSION_HEADER, "--max-duration", str(a.max_run_seconds),
           *(["--affinity-header", AFFINITY_HEADER] if a.affinity else []),
           *(["--prompt-cache-key"] if a.prompt_cache_key else []),
           *(["--affinity-cookie", AFFINITY_COOKIE, "--cookie-jars", a.affinity_cookie]
             if a.affinity_cookie else []),
           "--drain", str(a.drain_seconds), "--out", str(out), *prof["load"]]
    p = own(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        _, err = p.communicate(timeout=a.max_run_seconds + a.drain_seconds + 120)
    finally:
        kill(p)
    for line in (err or "").splitlines():
        log(f"  {line}")
    if p.returncode != 0:
        raise RuntimeError(f"prefix-bench failed ({p.returncode}): {(err or '')[-1500:]}")
    return json.loads(out.read_text())


def one_run(workload: str, kind: str, sim: Sim, prof: dict, a, outdir: Path, instances: int = 1) -> dict:
    label = ROUTER_LABELS[kind]
    if is_envoy(kind):
        label += f" x{instances}" if instances > 1 else ""
        label += f" (c={a.envoy_concurrency})" if a.envoy_concurrency != 2 else ""
    if kind.startswith("prefix-router") and a.affinity:
        label += " +affinity"
    if kind.startswith("prefix-router") and a.affinity_cookie:
        label += f" +cookie ({'one jar' if a.affinity_cookie == 'shared' else 'a jar per session'})"
    row = {"workload": workload, "router": kind, "label": label, "envoy_instances": instances}
    records = f"runs/{workload}--{kind}" + (f"--x{instances}" if instances > 1 else "") + ".json"
    router = Router(kind, sim.addrs, a.envoy_concurrency, instances, prof.get("plugin"))
    why = router.unavailable()
    if why:
        log(f"[{workload}] {label}: skipped: {why}")
        return {**row, "skipped": why}
    log(f"[{workload}] {label}: starting")
    try:
        with router:
            # A peer router may not have the workload's API at all: say so
            # instead of measuring its errors. (Envoy forwards any path.)
            if prof.get("probe") and not router.is_envoy:
                why = probe(router.targets[0], *prof["probe"])
                if why:
                    log(f"[{workload}] {label}: skipped: {why}")
                    return {**row, "skipped": why}
            sim.reset()
            before = sim.metrics()
            cpu0 = {pid: cpu_seconds(pid) for pid in router.pids()}
            poller = Poller(sim)
            poller.start()
            change = a.replica_change if kind.startswith("prefix-router") else None
            changed = sim.addrs[-1]
            if change == "add":
                # Out of the pool from the start (its scrapes fail).
                sim.fault(changed, "error")
                time.sleep(1.0)
            timer = threading.Timer(a.change_after, sim.fault,
                                    (changed, "error" if change == "remove" else "ok"))
            if change:
                timer.start()
            t0 = time.time()
            try:
                doc = run_loadgen(router.targets, prof, sim, outdir / records, a)
            finally:
                poller.stop()
                timer.cancel()
                if change:
                    sim.fault(changed, "ok")
            wall = time.time() - t0
            after = sim.metrics()
            router_cpu = sum(cpu_seconds(pid) - c for pid, c in cpu0.items())
            fstats = router.filter_stats()
    except Exception as e:  # a router that can't run is reported, not fatal
        log(f"[{workload}] {label}: FAILED: {e}")
        return {**row, "skipped": f"failed: {str(e)[:300]}"}

    def delta(name: str) -> float:
        return sum(after[r].get(name, 0.0) - before[r].get(name, 0.0) for r in sim.addrs)

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    s = doc["summary"]
    counts = [s["served_by"].get(r, 0) for r in sim.addrs]
    warm = warm_ttft(doc, prof["time_scale"])
    row.update({
        "targets": router.targets,
        "requests": s["requests"], "ok": s["ok"], "errors": s["errors"],
        "error_kinds": s["error_kinds"],
        "req_per_s": s["req_per_s"],
        "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"], "e2e_ms": s["e2e_ms"],
        "hit_rate": hits / queries if queries else None,
        "hit_tokens": hits, "query_tokens": queries,
        "client_hit_rate": s["client_hit_rate"],
        "served_by": dict(zip(sim.addrs, counts)),
        "share_max_over_mean": s["share_max_over_mean"],
        "peak_waiting_total": poller.peak_total,
        "peak_waiting_replica": poller.peak_replica,
        "waiting_samples": poller.samples,
        "upper_bound": doc.get("upper_bound"),
        "loadgen": doc["loadgen"],
        "router_cpu_s": router_cpu,
        "wall_s": wall,
        "filter_stats": fstats,
        "ttft_later_turns_ms": (later_turns_ttft(doc, prof["time_scale"])
                                if workload in SESSION_WORKLOADS else None),
        "ttft_warm_ms": warm if workload in WARM_WORKLOADS else None,
        "ttft_warm_p95_ms": warm["p95"] if warm else None,
        "key_affinity": key_affinity(doc),
        "replica_change": (placement_moves(doc, changed, change, a.change_after) if change else None),
        "records_file": records,
    })
    log(f"[{workload}] {label}: hit rate {row['hit_rate'] or 0:.1%}, TTFT p95 "
        f"{s['ttft_ms']['p95']:.0f} ms, peak waiting {poller.peak_total:.0f}, errors {s['errors']}")
    return row


# What `--workload all` runs, in order.
WORKLOADS = ("shared-prefix", "multi-turn", "unique", "long-preamble", "agentic", "agentic-responses",
             "agentic-messages")


def module_info(path: Path) -> dict:
    """Which prefix-router build was measured: path, size, mtime, sha256."""
    import hashlib

    try:
        data = path.read_bytes()
    except OSError:
        return {"path": str(path), "missing": True}
    return {"path": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16],
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(path.stat().st_mtime))}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="shared-prefix",
                    help=f"{' | '.join(WORKLOADS)} | replay | all (comma-separated list allowed)")
    ap.add_argument("--routers", default=",".join(ALL_ROUTERS),
                    help=f"comma-separated, from: {', '.join(ALL_ROUTERS)}")
    ap.add_argument("--scale", type=float, default=0.1,
                    help="shrinks shared-prefix/unique counts and the KV cache together (1 = published size)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="default: 8 (shared-prefix, unique), 4 (multi-turn, long-preamble, agentic)")
    ap.add_argument("--preset", default=None, help="replica-sim preset: fast | a10g-7b | a10g-7b-ctx | l4-7b")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="replica-sim time scale (real s per simulated s); latencies are reported in simulated ms")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help="KV cache tokens per replica (default: 100k x scale; long-preamble 48k, agentic 128k)")
    ap.add_argument("--kv-fractions", default=None,
                    help="per-replica share of the KV cache, replica 0 first (e.g. 1,1,1,0.25: a pool "
                         "of mixed cards); replicas past the list keep all of it")
    ap.add_argument("--rate", type=float, default=None,
                    help="open-loop arrivals per simulated second (default 12; long-preamble 8)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--groups", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=9000)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--conversations", type=int, default=11)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--think", type=float, default=15.0, help="multi-turn mean think time, simulated s")
    ap.add_argument("--lp-prompts", type=int, default=2000, help="long-preamble requests")
    ap.add_argument("--documents", type=int, default=64, help="long-preamble documents")
    ap.add_argument("--zipf", type=float, default=0.8, help="long-preamble document popularity skew")
    ap.add_argument("--sessions", type=int, default=8, help="agentic sessions")
    ap.add_argument("--agent-think", type=float, default=5.0,
                    help="agentic mean think time (tool execution) between turns, simulated s")
    ap.add_argument("--trace", type=Path, default=None, help="JSONL trace for --workload replay")
    ap.add_argument("--speedup", type=float, default=1.0, help="replay speed-up")
    ap.add_argument("--envoy-concurrency", type=int, default=2)
    ap.add_argument("--envoy-instances", type=instance_counts, default=[1],
                    help="independent Envoy instances; each request goes to one at random. A list "
                         "(1,2,3,4) runs every Envoy-based router once per count, in one report")
    ap.add_argument("--affinity", action="store_true",
                    help="turn on prefix-router's session affinity and have conversations and agent "
                         "sessions echo its token (an opt-in client)")
    ap.add_argument("--affinity-cookie", nargs="?", const="shared", choices=("shared", "session"),
                    help="turn on prefix-router's session affinity with its cookie (no header is echoed). "
                         "shared (the default): one cookie jar for every request of the run, as one SDK "
                         "client shared by every conversation and session keeps it; clients_echo off. "
                         "session: a jar per conversation or session (a client each); clients_echo on")
    ap.add_argument("--prompt-cache-key", action="store_true",
                    help="conversations and agent sessions send their id as prompt_cache_key "
                         "(OpenAI's routing hint, as coding agents send it)")
    ap.add_argument("--replica-change", choices=("remove", "add"), default=None,
                    help="prefix-router runs only: one replica leaves (its /metrics starts failing) or "
                         "joins (starts failing, then recovers) --change-after real seconds into the run; "
                         "the report says how many keys changed replica")
    ap.add_argument("--change-after", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replica-port", type=int, default=0,
                    help="first replica port (replicas on PORT..PORT+N-1; default: free ports). Replica "
                         "addresses decide rendezvous placement, so which replicas get the most keys "
                         "changes from run to run; pinning them compares two builds or settings on the "
                         "same draw")
    ap.add_argument("--wasm", type=Path, default=None,
                    help=f"prefix-router module to run (default {harness.WASM.relative_to(ROOT)})")
    ap.add_argument("--plugin", default="{}",
                    help="JSON object of extra prefix-router plugin keys, e.g. '{\"bounded_load_factor\": 2}'")
    ap.add_argument("--sglang-args", default="",
                    help="extra arguments for sglang-router (smg), e.g. '--cache-threshold 0.8 --balance-abs-threshold 4'")
    ap.add_argument("--vllm-router-args", default="", help="extra arguments for vllm-router")
    ap.add_argument("--max-run-seconds", type=float, default=300.0, help="real seconds of sending per run")
    ap.add_argument("--drain-seconds", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/<timestamp>)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--demo", action="store_true",
                    help="short: prefix-router vs round robin on shared-prefix (~1 minute)")
    return ap


def peer_info() -> dict:
    """Each peer router's installed version and the extra arguments it
    runs with, for the report."""
    out = {}
    for kind, dist in (("sglang-router", "smg"), ("vllm-router", "vllm-router")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        out[kind] = {"package": dist, "version": version, "args": PEER_ARGS[kind]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    try:
        PLUGIN_EXTRA.clear()
        PLUGIN_EXTRA.update(json.loads(a.plugin))
    except (ValueError, TypeError) as e:
        ap.error(f"--plugin: not a JSON object: {e}")
    PEER_ARGS["sglang-router"] = shlex.split(a.sglang_args)
    PEER_ARGS["vllm-router"] = shlex.split(a.vllm_router_args)
    if a.affinity:
        # Every instance gets the same key, as an operator's secret store
        # would give it; the load generator's conversations and sessions
        # send the token back.
        PLUGIN_EXTRA.setdefault("affinity", {"key": AFFINITY_KEY,
                                             "header": AFFINITY_HEADER, "clients_echo": True})
    if a.affinity_cookie:
        # A jar several sessions share loses the newest entries of some
        # (responses race): with clients_echo, their next turns would be
        # placed anew.
        PLUGIN_EXTRA.setdefault("affinity", {"key": AFFINITY_KEY,
                                             "cookie": AFFINITY_COOKIE,
                                             "clients_echo": a.affinity_cookie == "session"})

    if a.demo:
        a.workload, a.routers = "shared-prefix", "prefix-router,round-robin"
        a.time_scale = a.time_scale or 0.2
        a.max_run_seconds = min(a.max_run_seconds, 60.0)
        a.drain_seconds = min(a.drain_seconds, 60.0)
    WASM_PATH[0] = (a.wasm or harness.WASM).resolve()
    workloads = list(WORKLOADS) if a.workload == "all" else [w.strip() for w in a.workload.split(",")]
    routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    for w in workloads:
        if w not in (*WORKLOADS, "replay"):
            ap.error(f"unknown workload {w}")
    if "replay" in workloads and not (a.trace and a.trace.exists()):
        ap.error("--workload replay needs --trace FILE (JSONL)")
    for r in routers:
        if r not in ALL_ROUTERS:
            ap.error(f"unknown router {r} (known: {', '.join(ALL_ROUTERS)})")
    for b in (SIM_BIN, BENCH_BIN):
        if not b.exists():
            log(f"{b} missing: run scripts/build and cargo build --release -p prefix-bench")
            return 2

    outdir = a.out or ROOT / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S")
    (outdir / "runs").mkdir(parents=True, exist_ok=True)
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:] if argv is None else argv,
               "envoy_concurrency": a.envoy_concurrency, "envoy_instances": a.envoy_instances,
               "wasm": module_info(WASM_PATH[0]), "peers": peer_info(),
               # The request stream every router gets, and what --plugin /
               # --affinity added to prefix-router's configuration: the
               # report names both.
               "seed": a.seed, "plugin_extra": dict(PLUGIN_EXTRA), "workloads": {}}
    t_start = time.time()
    for w in workloads:
        prof = profiles(a)[w]
        log(f"[{w}] {prof['replicas']} replicas, preset {prof['preset']}, time scale {prof['time_scale']}, "
            f"KV {prof['kv_tokens'] or 'preset'} tokens each"
            + (f", shares {a.kv_fractions}" if a.kv_fractions else ""))
        rows = []
        with Sim(prof["replicas"], prof["preset"], prof["time_scale"], prof["kv_tokens"],
                 prof.get("max_model_len"), a.replica_port, a.kv_fractions) as sim:
            for r, n in run_plan(routers, a.envoy_instances):
                rows.append(one_run(w, r, sim, prof, a, outdir, n))
        setup = {k: v for k, v in prof.items() if k not in ("load", "probe")}
        if a.kv_fractions:
            setup["kv_fractions"] = a.kv_fractions
        results["workloads"][w] = {"setup": setup,
                                   "load_args": prof["load"], "runs": rows}
        (outdir / "results.json").write_text(json.dumps(results, indent=1))
    results["elapsed_s"] = time.time() - t_start
    (outdir / "results.json").write_text(json.dumps(results, indent=1))
    md = report.render(results)
    (outdir / "report.md").write_text(md)
    if not a.no_plots:
        made = report.plots(results, outdir)
        if made:
            log(f"plots: {', '.join(made)}")
    print(md)
    log(f"results in {outdir} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
