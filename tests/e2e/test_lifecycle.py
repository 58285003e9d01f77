"""The plugin's lifecycle in a real Envoy: a configuration pushed over LDS
starts new root contexts beside the old ones, which live on until the old
listener has drained (`--drain-time-s`, 600 s by default)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from harness import (
    Envoy,
    backends,
    free_port,
    render_config,
    stat_label,
    vllm_metrics,
    wait_until,
)


def write_lds(path: Path, listener: dict):
    """Replace the LDS file atomically (Envoy watches for the move)."""
    doc = {"resources": [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


def with_plugin(listener: dict, plugin: dict) -> dict:
    """`listener` with the wasm filter's configuration set to `plugin`."""
    listener = json.loads(json.dumps(listener))
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.wasm":
            f["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin)
    return listener


def test_a_pushed_configuration_scrapes_at_once_not_after_the_old_one_drains():
    with backends(2, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        # Same pool, so the same shared-data scope: only the path changes,
        # the fix of a misspelt `metrics_path`.
        plugin = {"endpoints": pool, "cluster": "pool", "scrape_interval_ms": 100, "max_fallbacks": 1}
        wrong = {**plugin, "metrics_path": "/wrong"}
        cfg = render_config("override_host", wrong, pool, free_port(), free_port())
        listener = cfg["static_resources"]["listeners"][0]
        envoy = Envoy(cfg, concurrency=2)
        # The listener comes from a file over LDS, so that it can be updated.
        lds = Path(envoy.dir.name) / "lds.yaml"
        write_lds(lds, listener)
        envoy.config = {
            **cfg,
            "node": {"id": "e2e", "cluster": "e2e"},
            "static_resources": {"clusters": cfg["static_resources"]["clusters"]},
            "dynamic_resources": {
                "lds_config": {"resource_api_version": "V3", "path_config_source": {"path": str(lds)}}
            },
        }
        with envoy:
            labels = [stat_label(a) for a in pool]
            failed = lambda: sum(envoy.stat(f"{l}.scrapes_failed") for l in labels)
            ok = lambda: sum(envoy.stat(f"{l}.scrapes_ok") for l in labels)
            assert wait_until(lambda: failed() >= 6, timeout=10), failed()
            assert ok() == 0
            write_lds(lds, with_plugin(listener, plugin))
            assert wait_until(lambda: envoy.stat("listener_manager.lds.update_success") >= 2, timeout=10)
            # The new configuration's scraper takes over within a few rounds
            # (the old root context still ticks while its listener drains).
            assert wait_until(lambda: ok() >= 4, timeout=5), (ok(), failed())
