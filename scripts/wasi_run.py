"""Run a wasm32-wasip1 test binary under wasmtime (cargo's target runner).

cargo calls: wasi_run.py <module.wasm> [test args...]. The module gets the
arguments, stdout/stderr and the environment; its exit code is ours.
"""
import sys

import wasmtime


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
    store.set_wasi(wasi)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    module = wasmtime.Module.from_file(engine, path)
    instance = linker.instantiate(store, module)
    start = instance.exports(store)["_start"]
    try:
        start(store)
    except wasmtime.ExitTrap as e:
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
