"""Process handling of the shared harness (testkit/harness.py) and the
benchmark orchestrator: a process that starts but never becomes ready is
killed by pid, and waiting for it is bounded in time. Fake executables
stand in for Envoy and replica-sim; no Envoy, no simulator."""
from __future__ import annotations

import os
import signal
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


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie is left."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_envoy_matrix_kills_its_pytest_run_when_interrupted(tmp_path, monkeypatch):
    """The pytest run is its own session (so a timeout can kill its whole
    group): a Ctrl-C at the terminal does not reach it, so scripts/envoy-matrix
    must kill it when it is interrupted, or it runs on with its Envoys."""
    import _thread

    sys.path.insert(0, str(BENCH.parent / "scripts"))
    import envoy_matrix

    pidfile = tmp_path / "pytest.pid"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 300\n")
    fake_python.chmod(0o755)
    fake_envoy = tmp_path / "envoy"
    fake_envoy.write_text("#!/bin/sh\nexit 0\n")
    fake_envoy.chmod(0o755)
    monkeypatch.setattr(envoy_matrix, "PY", fake_python)
    monkeypatch.setattr(envoy_matrix, "WORK", tmp_path / "work")
    monkeypatch.setattr(envoy_matrix, "wasm_runtimes", lambda _: ["envoy.wasm.runtime.v8"])
    monkeypatch.setattr(envoy_matrix, "collect", lambda _: ["tests/e2e/test_x.py::test_y"])

    def interrupt_once_started():
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            threading.Event().wait(0.05)
        _thread.interrupt_main()

    # A shell ignores SIGINT for the jobs it starts in the background (CI
    # does so), and then Python leaves it ignored and interrupt_main does
    # nothing: the test sets the handler a terminal's Ctrl-C would meet.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Thread(target=interrupt_once_started, daemon=True)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            envoy_matrix.run_version("1.40", "1.40.0", fake_envoy, timeout=60)
        timer.join(timeout=10)
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = int(pidfile.read_text())
    try:
        assert process_gone(pid), "the interrupted run's pytest is still running"
    finally:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_echo_backend_that_never_announces_is_given_up_on(tmp_path, monkeypatch):
    import overhead

    monkeypatch.setattr(overhead, "TOOL", silent_process(tmp_path))
    monkeypatch.setattr(overhead, "ECHO_START_TIMEOUT_S", 0.5, raising=False)
    raised: list[BaseException] = []

    def start():
        try:
            with overhead.echo_backend():
                pass
        except BaseException as e:  # noqa: BLE001  (what the test checks)
            raised.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(timeout=15)
    if t.is_alive():
        # Unblock it: the only `sleep 300` this test started.
        for pid in os.listdir("/proc"):
            if pid.isdigit() and os.getppid() != int(pid):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError):
                    continue
                if ppid == os.getpid() and cmd.startswith(b"sleep\x00300"):
                    os.kill(int(pid), signal.SIGKILL)
        t.join(timeout=10)
        pytest.fail("echo_backend start-up waited past its deadline")
    assert raised and isinstance(raised[0], RuntimeError), raised


def test_a_backend_never_started_stops_at_once():
    """stop() (what `with` and a test's `finally` call) on a Backend whose
    thread never ran returns instead of waiting forever on serve_forever."""
    be = harness.Backend()
    t = threading.Thread(target=be.stop, daemon=True)
    t.start()
    t.join(timeout=5)
    if t.is_alive():
        # Unblock it: start the loop its shutdown() waits for.
        be.thread.start()
        t.join(timeout=5)
        pytest.fail("Backend.stop() waited forever for a server loop that never ran")
