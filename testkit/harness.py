"""Process and HTTP helpers shared by the Envoy end-to-end tests
(tests/e2e, which import it as `harness`), the benchmark (bench/) and the
demo (scripts/demo.py): Envoy rendered from envoy/*.yaml and run as a
process, fake OpenAI-shaped backends, a small HTTP client.

Everything started here is owned by a context manager that kills it by pid
on exit, pass or fail. Only loopback addresses are used, on free ports.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "prefix_router.wasm"
# The same module built with the test-only `fault-injection` feature
# (`debug_trap_on_request`), for failure-policy tests; scripts/build makes it.
WASM_FAULT = (
    ROOT / "target" / "fault-injection" / "wasm32-wasip1" / "release" / "prefix_router.wasm"
)
ENVOY_DIR = ROOT / "envoy"
HEADER = "x-gateway-destination-endpoint"


# The Envoy binary under test. Default: the project venv's (scripts/setup);
# PREFIX_ROUTER_ENVOY=/path/to/envoy runs the same tests against another
# build (scripts/envoy-matrix uses it for each supported Envoy line).
ENVOY_ENV = "PREFIX_ROUTER_ENVOY"


def envoy_bin() -> str:
    override = os.environ.get(ENVOY_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise RuntimeError(f"{ENVOY_ENV}={override} is not an executable file")
        return str(path)
    venv = ROOT / ".venv" / "bin" / "envoy"
    return str(venv) if venv.exists() else "envoy"


def envoy_version() -> str:
    """`1.40.0`: the version of envoy_bin(), from `envoy --version`."""
    out = subprocess.run([envoy_bin(), "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else "unknown"


# Ports handed out by free_port() in this process.
_ISSUED: set[int] = set()


def _ephemeral_range() -> range:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(lo), int(hi) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port() -> int:
    """A loopback port nothing is bound to, never handed out twice in this
    process. It is drawn outside the kernel's ephemeral range: a port from
    `bind(0)` is free only until the probe socket closes, and the kernel
    hands the same ports to later `bind(0)` probes and to outgoing
    connections (Envoy's own upstream connections, the tests' clients), so
    two listeners of one Envoy could get the same port and Envoy would exit
    at start-up."""
    ephemeral = _ephemeral_range()
    rng = random.Random()
    for _ in range(10_000):
        port = rng.randrange(10_000, 65_536)
        if port in ephemeral or port in _ISSUED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED.add(port)
        return port
    raise RuntimeError("no free loopback port outside the ephemeral range")


# --------------------------------------------------------------------------
# Backends: tiny OpenAI-shaped servers that say who served.


class Backend:
    """A loopback HTTP server in a thread, recording what it received."""

    def __init__(self, delay_s: float = 0.0, port: int = 0, metrics: str | bytes | None = None):
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        # /metrics: the page served (None: 404), an extra delay, a hit count.
        self.metrics = metrics
        self.metrics_delay_s = 0.0
        self.metrics_hits = 0
        # down: every request gets a 503 (a replica that is up but broken).
        self.down = False
        self.conns: set = set()
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                with backend.lock:
                    backend.conns.add(self.connection)

            def finish(self):
                with backend.lock:
                    backend.conns.discard(self.connection)
                super().finish()

            def _reply(self, status, payload: bytes, ctype="text/plain"):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("x-served-by", str(backend.port))
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _serve(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                if backend.down:
                    return self._reply(503, b"down")
                if self.path == "/metrics":
                    with backend.lock:
                        backend.metrics_hits += 1
                    if backend.metrics_delay_s:
                        time.sleep(backend.metrics_delay_s)
                    page = backend.metrics
                    if page is None:
                        return self._reply(404, b"no metrics")
                    return self._reply(200, page.encode() if isinstance(page, str) else page)
                with backend.lock:
                    backend.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "dest": self.headers.get_all(HEADER) or [],
                            "body_len": len(body),
                            # Its ends, for tests of a body the filter rewrote.
                            "body_ends": (body[:128], body[-64:]),
                        }
                    )
                # A refusal the request asks for (a 429, a 400): nothing ran.
                refusal = int(self.headers.get("x-test-status") or 0)
                if refusal:
                    return self._reply(refusal, b"refused")
                delay = backend.delay_s + int(self.headers.get("x-test-delay-ms") or 0) / 1000
                if delay:
                    time.sleep(delay)
                stream = b'"stream": true' in body or b'"stream":true' in body
                if stream:
                    chunks = [
                        "data: " + json.dumps({"choices": [{"index": 0, "text": t}]}) + "\n\n"
                        for t in ("a", "b")
                    ]
                    payload = ("".join(chunks) + "data: [DONE]\n\n").encode()
                    ctype = "text/event-stream"
                else:
                    payload = json.dumps({"served_by": backend.port, "len": len(body)}).encode()
                    ctype = "application/json"
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("x-served-by", str(backend.port))
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        """Die like a killed process: refuse new connections and reset the
        open ones (Envoy's pooled keep-alive connections included)."""
        if self.server is not None:
            # shutdown() waits for serve_forever to end: forever if it never
            # ran (stopped before __enter__, or __enter__ failed).
            if self.thread.ident is not None:
                self.server.shutdown()
            self.server.server_close()
            self.server = None
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.requests)


@contextlib.contextmanager
def backends(n: int, **kw):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(Backend(**kw)) for _ in range(n)]


def vllm_metrics(waiting: float = 0, running: float = 0, kv: float = 0.0,
                 cache: tuple[float, float] | None = None) -> str:
    """A metrics page shaped like vLLM's; `cache` = the prefix cache's
    (queried, hit) token counters."""
    m = 'model_name="m",engine="0"'
    page = (
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{m}}} {waiting}\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{m}}} {running}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{m}}} {kv}\n"
    )
    if cache is not None:
        page += (
            "# TYPE vllm:prefix_cache_queries counter\n"
            f"vllm:prefix_cache_queries_total{{{m}}} {cache[0]}\n"
            "# TYPE vllm:prefix_cache_hits counter\n"
            f"vllm:prefix_cache_hits_total{{{m}}} {cache[1]}\n"
        )
    return page


# --------------------------------------------------------------------------
# Envoy


def render_config(
    mode: str,
    plugin: dict | str,
    pool: list[str],
    listen_port: int,
    admin_port: int,
    buffer_limit: int | None = None,
    wasm_path: Path = WASM,
) -> dict:
    """Load envoy/<mode>.yaml and point it at our ports, module and pool."""
    name = {"original_dst": "envoy.yaml", "override_host": "envoy-override-host.yaml"}[mode]
    cfg = yaml.safe_load((ENVOY_DIR / name).read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    if buffer_limit:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    # The shipped configs remove a client's destination header with Envoy's
    # header_mutation filter ahead of the wasm filter. Left out here, so that
    # the client's header reaches the filter and the tests of the filter's
    # own strip (test_foundation, test_hardening) test it; shipped_config()
    # keeps the chain as shipped (test_strip.py).
    hcm["http_filters"] = [f for f in hcm["http_filters"] if not strips_destination(f)]
    wasm = wasm_http_filter(hcm)["typed_config"]["config"]
    wasm["vm_config"]["code"]["local"]["filename"] = str(wasm_path)
    wasm["configuration"]["value"] = plugin if isinstance(plugin, str) else json.dumps(plugin)
    cluster = cfg["static_resources"]["clusters"][0]
    if mode == "override_host":
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {
                "endpoint": {
                    "address": {
                        "socket_address": {
                            "address": a.rsplit(":", 1)[0].strip("[]"),
                            "port_value": int(a.rsplit(":", 1)[1]),
                        }
                    }
                }
            }
            for a in pool
        ]
    return cfg


def filter_envoy(
    pool: list[str],
    plugin: dict | None = None,
    envoy_mode: str = "override_host",
    concurrency: int = 2,
    buffer_limit: int | None = None,
    failure_policy: str | None = None,
    wasm_path: Path = WASM,
) -> "Envoy":
    """Envoy with prefix-router in front of `pool`, on free ports. The
    plugin config is `{"endpoints": pool, **plugin}`; ORIGINAL_DST gets
    `max_fallbacks: 0` unless set (it takes one address only)."""
    plugin = {"endpoints": pool, **(plugin or {})}
    if envoy_mode == "original_dst":
        plugin.setdefault("max_fallbacks", 0)
    cfg = render_config(
        envoy_mode, plugin, pool, free_port(), free_port(), buffer_limit=buffer_limit, wasm_path=wasm_path
    )
    if failure_policy:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        wasm = wasm_http_filter(hcm)["typed_config"]["config"]
        wasm["failure_policy"] = failure_policy
        if failure_policy == "FAIL_RELOAD":
            # Reload quickly for tests (the default backoff is 1 s).
            wasm["reload_config"] = {"backoff": {"base_interval": "0.1s", "max_interval": "0.2s"}}
    return Envoy(cfg, concurrency=concurrency)


class Envoy:
    """A real Envoy process; killed by pid on exit."""

    def __init__(self, config: dict, concurrency: int = 2, expect_start: bool = True):
        self.config = config
        self.concurrency = concurrency
        self.expect_start = expect_start
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        self.port = config["static_resources"]["listeners"][0]["address"]["socket_address"][
            "port_value"
        ]
        self.dir = tempfile.TemporaryDirectory(prefix="prefix-router-e2e-")
        self.log_path = Path(self.dir.name) / "envoy.log"
        self.stderr_path = Path(self.dir.name) / "envoy.stderr"
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        cfg_path = Path(self.dir.name) / "envoy.yaml"
        cfg_path.write_text(yaml.safe_dump(self.config))
        # What Envoy prints before its log file is open (a bad flag, a crash
        # at start-up) goes to stderr; failures quote it.
        with self.stderr_path.open("wb") as stderr:
            self.proc = self._spawn(cfg_path, stderr)
        if self.expect_start:
            try:
                self._wait_ready()
            except BaseException:
                # `with` calls __exit__ only after __enter__ returned: an
                # Envoy that never got ready (or a Ctrl-C while waiting)
                # would outlive the test. The error quotes its log.
                self.__exit__()
                raise
        return self

    def _spawn(self, cfg_path: Path, stderr) -> subprocess.Popen:
        return subprocess.Popen(
            [
                envoy_bin(),
                "-c",
                str(cfg_path),
                "--concurrency",
                str(self.concurrency),
                "--disable-hot-restart",
                "-l",
                "info",
                "--log-path",
                str(self.log_path),
                # The log reaches the file within 100 ms, not 10 s: tests
                # read what the filter logged while Envoy runs.
                "--file-flush-interval-msec",
                "100",
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=ROOT,
        )

    def _wait_ready(self, timeout: float = 30.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"envoy exited {self.proc.returncode}:\n{self.log()[-4000:]}{self.stderr()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                            return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready after {timeout}s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.dir.cleanup()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr(self) -> str:
        """The tail of Envoy's stderr, labelled, or "" when it is empty."""
        try:
            text = self.stderr_path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"\n-- stderr:\n{text[-2000:]}" if text else ""

    def stats(self) -> dict[str, int]:
        """Counters and gauges from the admin endpoint, by name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(": ")
                if value.strip().lstrip("-").isdigit():
                    out[name] = int(value)
            return out

    def stat(self, suffix: str) -> int:
        """Sum of the stats whose name ends with `suffix`."""
        return sum(v for k, v in self.stats().items() if k.endswith(suffix))


# --------------------------------------------------------------------------
# Small helpers


def wait_until(pred, timeout: float = 10.0, step: float = 0.05) -> bool:
    """Poll `pred` until it holds or `timeout` passes; its last answer."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def stat_label(addr: str) -> str:
    """A replica address as the filter spells it in stat names, like
    `Endpoint::stat_label` (127.0.0.1:8001 -> 127_0_0_1_8001)."""
    return re.sub(r"[^A-Za-z0-9]", "_", addr).strip("_")


# --------------------------------------------------------------------------
# Client


def request(
    port: int,
    method: str = "POST",
    path: str = "/v1/completions",
    body: bytes | dict | None = None,
    headers: list[tuple[str, str]] | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict, bytes]:
    """One request on a fresh connection (so connections spread over workers)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers or []:
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("content-type", "application/json")
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def completion(prompt: str, stream: bool = False, model: str = "m") -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream}


def chat(messages: list[tuple[str, str]], stream: bool = False, model: str = "m") -> dict:
    return {
        "model": model,
        "messages": [{"role": r, "content": c} for r, c in messages],
        "max_tokens": 4,
        "stream": stream,
    }


# --------------------------------------------------------------------------
# The filter chain: the wasm filter and the destination-header strip


WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
HEADER_MUTATION_TYPE = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
DEV_CONFIGS = {"original_dst": "envoy.yaml", "override_host": "envoy-override-host.yaml"}


def is_wasm_filter(f: dict) -> bool:
    """An HTTP filter entry that is Envoy's wasm filter, typed directly or
    wrapped in a TypedStruct (as the Istio EnvoyFilters do)."""
    tc = f.get("typed_config") or {}
    return tc.get("@type") == WASM_TYPE or tc.get("type_url") == WASM_TYPE


def wasm_http_filter(hcm: dict) -> dict:
    """The (one) wasm filter of a connection manager's http_filters."""
    (f,) = [f for f in hcm["http_filters"] if is_wasm_filter(f)]
    return f


def stripped_headers(f: dict) -> set[str]:
    """Request headers an HTTP filter entry removes (header_mutation)."""
    tc = f.get("typed_config") or {}
    if f.get("disabled") or tc.get("@type") != HEADER_MUTATION_TYPE:
        return set()
    mutations = (tc.get("mutations") or {}).get("request_mutations") or []
    return {m["remove"].lower() for m in mutations if "remove" in m}


def strips_destination(f: dict, header: str = HEADER) -> bool:
    return header in stripped_headers(f)


def shipped_config(
    mode: str,
    plugin: dict | str,
    pool: list[str],
    listen_port: int,
    admin_port: int,
    wasm_path: Path = WASM,
) -> dict:
    """render_config() with the HTTP filter chain exactly as shipped in
    envoy/<mode>.yaml (render_config leaves out the strip filter)."""
    cfg = render_config(mode, plugin, pool, listen_port, admin_port, wasm_path=wasm_path)
    shipped = yaml.safe_load((ENVOY_DIR / DEV_CONFIGS[mode]).read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ours = wasm_http_filter(hcm)
    chain = shipped["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [ours if is_wasm_filter(f) else f for f in chain["http_filters"]]
    return cfg
