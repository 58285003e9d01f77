"""Run a wasm32-wasip1 test binary under wasmtime (cargo's target runner).

cargo calls: wasi_run.py <module.wasm> [test args...]. The module gets the
arguments, stdout/stderr and the environment; its exit code is ours.
"""
import sys
from pathlib import Path

import wasmtime

# Tests read fixtures by their absolute build-time path
# (CARGO_MANIFEST_DIR): expose the repository, read-only, at that path.
ROOT = str(Path(__file__).resolve().parents[1])


def main() -> int:
    path, args = sys.argv[1], sys.argv[1:]
    cfg = wasmtime.Config()
    engine = wasmtime.Engine(cfg)
    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.argv = args
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    wasi.inherit_env()
    wasi.preopen_dir(ROOT, ROOT, fs_mutable=False)
    store.set_wasi(wasi)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    module = wasmtime.Module.from_file(engine, path)
    # Integration-test binaries link the whole cdylib, proxy-wasm imports
    # included; they are never called outside Envoy, so traps suffice.
    linker.define_unknown_imports_as_traps(module)
    instance = linker.instantiate(store, module)
    start = instance.exports(store)["_start"]
    try:
        start(store)
    except wasmtime.ExitTrap as e:
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
