"""Process handling of the shared harness (testkit/harness.py) and the
benchmark orchestrator: a process that starts but never becomes ready is
killed by pid, and waiting for it is bounded in time. Fake executables
stand in for Envoy and replica-sim; no Envoy, no simulator."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import orchestrate  # noqa: E402
from testkit import harness  # noqa: E402


def silent_process(tmp_path: Path) -> Path:
    """An executable that starts, prints nothing and never gets ready."""
    exe = tmp_path / "hangs"
    exe.write_text("#!/bin/sh\nexec sleep 300\n")
    exe.chmod(0o755)
    return exe


def reap(proc) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def test_an_envoy_that_never_gets_ready_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv(harness.ENVOY_ENV, str(silent_process(tmp_path)))
    wait_ready = harness.Envoy._wait_ready
    monkeypatch.setattr(harness.Envoy, "_wait_ready", lambda self, timeout=30.0: wait_ready(self, 0.5))
    cfg = {
        "admin": {"address": {"socket_address": {"port_value": harness.free_port()}}},
        "static_resources": {
            "listeners": [{"address": {"socket_address": {"port_value": harness.free_port()}}}]
        },
    }
    env = harness.Envoy(cfg)
    try:
        with pytest.raises(RuntimeError, match="not ready"):
            with env:
                pass
        assert env.proc.poll() is not None, "the Envoy that failed to start is still running"
    finally:
        reap(env.proc)


def test_a_replica_sim_that_never_announces_is_given_up_on_and_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrate, "SIM_BIN", silent_process(tmp_path))
    monkeypatch.setattr(orchestrate.Sim, "START_TIMEOUT_S", 0.5, raising=False)
    sim = orchestrate.Sim(2, "fast", 1.0, None)
    raised: list[BaseException] = []

    def start():
        try:
            sim.__enter__()
        except BaseException as e:  # noqa: BLE001  (what the test checks)
            raised.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(timeout=15)
    try:
        assert not t.is_alive(), "Sim start-up waited past its deadline"
        assert raised and isinstance(raised[0], RuntimeError), raised
        assert sim.proc.poll() is not None, "the replica-sim that failed to start is still running"
    finally:
        reap(sim.proc)
        t.join(timeout=10)
