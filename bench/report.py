"""Markdown report and PNG plots from a results.json written by orchestrate.py.

    python bench/report.py bench/results/<timestamp>      # re-render report.md (+ plots)

Plots need matplotlib; without it they are skipped with a message.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

WORKLOAD_TITLES = {
    "shared-prefix": "shared-prefix (groups of requests sharing a long prefix)",
    "multi-turn": "multi-turn (conversations resending their history)",
    "unique": "unique (no shared prefix: the control)",
    "long-preamble": "long-preamble (one long shared system prompt + tools, then one of many documents)",
    "agentic": "agentic (agent sessions: shared tools, growing tool-call history)",
    "agentic-responses": "agentic-responses (the agentic sessions over the Responses API: each turn "
                         "continues the stored response before it)",
    "agentic-messages": "agentic-messages (the agentic sessions over the Anthropic Messages API, as Claude Code "
                        "sends them: the whole history every turn, the cache breakpoint on the newest block)",
}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}"


def _distinct_content(data: dict) -> str | None:
    """How much shared (cacheable) prompt content the workload had, against
    one replica's KV cache and the pool's (from the upper bound's blocks)."""
    setup = data.get("setup", {})
    for r in data.get("runs", []):
        ub = r.get("upper_bound") or {}
        if r.get("skipped") or not ub.get("distinct_blocks"):
            continue
        bs = ub.get("block_size", 16)
        line = (f"Prompt content (as {r['router']} sent it): {ub.get('prompt_tokens', 0):,} prompt tokens "
                f"in {ub.get('requests', 0):,} requests, {ub['distinct_blocks'] * bs:,} distinct")
        shared = ub.get("shared_blocks")
        if shared is not None:
            line += f", of which {shared * bs:,} sent by more than one request (the content a cache can reuse)"
            kv = setup.get("kv_tokens")
            if kv:
                line += (f": {shared * bs / kv:.1f}x one replica's KV cache, "
                         f"{shared * bs / (kv * (setup.get('replicas') or 1)):.2f}x the pool's")
        return line + "."
    return None


def _instances(n) -> str:
    """`envoy_instances` as results.json holds it: a count, or a list of
    counts when one report covers several."""
    return ", ".join(map(str, n)) if isinstance(n, list) else str(n)


def gateways_table(runs: list[dict]) -> list[str]:
    """Each Envoy-based router run with several instance counts, against its
    own one-instance run: the many-gateways targets are ratios to it. The
    warm p95 (requests sent after the first quarter of the run) tells the
    steady state from the first seconds, when every instance places content
    it has not seen yet."""
    by_router: dict[str, dict[int, dict]] = {}
    for r in runs:
        if not r.get("skipped") and r.get("envoy_instances"):
            by_router.setdefault(r["router"], {})[r["envoy_instances"]] = r
    rows = []
    for router, by_n in by_router.items():
        one = by_n.get(1)
        if one is None or len(by_n) < 2:
            continue
        for n in sorted(by_n):
            r = by_n[n]
            hit = r.get("hit_rate")
            hit_ratio = f"{hit / one['hit_rate']:.3f}" if hit is not None and one.get("hit_rate") else "-"
            p95, p95_ratio = _with_ratio(r["ttft_ms"]["p95"], one["ttft_ms"]["p95"])
            warm, warm_ratio = _with_ratio(r.get("ttft_warm_p95_ms"), one.get("ttft_warm_p95_ms"))
            rows.append(f"| {r['label']} | {n} | {_pct(hit)} | {hit_ratio} | {p95} | {p95_ratio} "
                        f"| {warm} | {warm_ratio} | {r['share_max_over_mean']:.2f} |")
    if not rows:
        return []
    return ["Many gateways: each router with N independent Envoy instances against its own run with one "
            "(hit rate, TTFT p95, and the p95 of the requests sent after the first quarter of the run, "
            "as ratios to one instance's):", "",
            "| router | instances | hit rate | x one | TTFT p95 | x one | warm p95 | x one | share max/mean |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]


def _with_ratio(x, one) -> tuple[str, str]:
    """A latency and its ratio to the one-instance run's ("-" if unknown)."""
    if x is None:
        return "-", "-"
    return _ms(x), (f"{x / one:.2f}" if one else "-")


def _change(c: dict) -> str:
    """The run note for --replica-change."""
    side = "on it before" if c["change"] == "remove" else "on it after"
    return (f"; replica {c['change']} at {c['at_s']:.0f} s: {c['moved']} of {c['keys']} keys changed replica, "
            f"{c['moved_as_needed']} of them had to ({c['on_changed_before' if c['change'] == 'remove' else 'on_changed_after']} "
            f"{side}), {c['moved_otherwise']} others")


def _command(results: dict) -> str | None:
    """The command line the run was made with: the seed (the request stream
    every router is given), prefix-router's --plugin keys and the peers'
    arguments decide the numbers, and none of them is in a table. Older
    results.json files hold only `argv`; their seed is in it or the
    default."""
    argv = results.get("argv")
    if argv is None:
        return None
    line = f"Command: `{shlex.join(['scripts/bench', *argv])}`"
    extra = []
    if results.get("seed") is not None:
        extra.append(f"load generator seed {results['seed']}")
    if results.get("plugin_extra"):
        extra.append(f"prefix-router plugin keys added: `{json.dumps(results['plugin_extra'], sort_keys=True)}`")
    return line + (f" ({'; '.join(extra)})" if extra else "") + "."


def render(results: dict) -> str:
    out = ["# prefix-router benchmark", ""]
    out.append(
        f"Started {results.get('started', '?')}; Envoy `--concurrency {results.get('envoy_concurrency', 2)}`, "
        f"{_instances(results.get('envoy_instances', 1))} Envoy instance(s) per Envoy-based router "
        "(with several, each request goes to one of them at random). "
        "Latencies are in simulated milliseconds (real time / the simulator's time scale). "
        "Hit rate is the replicas' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` "
        "over the run (tokens, summed over replicas); the bound is the best any router could do "
        "(one cache that has seen every earlier request: each distinct 16-token prefix block computed once)."
    )
    out.append("")
    wasm = results.get("wasm") or {}
    if wasm.get("sha256"):
        out.append(f"prefix-router module: `{wasm['path']}` ({wasm['bytes']:,} bytes, sha256 {wasm['sha256']}..., "
                   f"built {wasm['mtime']} UTC).")
        out.append("")
    peers = [f"{kind}: {p['package']} {p['version']}" + (f" `{' '.join(p['args'])}`" if p["args"] else " (defaults)")
             for kind, p in (results.get("peers") or {}).items() if p.get("version")]
    if peers:
        out.append("Peers: " + "; ".join(peers) + ".")
        out.append("")
    if results.get("commands"):
        out.append("Merged from: " + "; ".join(f"`{c}`" for c in results["commands"]) + ".")
        out.append("")
    else:
        run_line = _command(results)
        if run_line:
            out.append(run_line)
            out.append("")
    for w, data in results.get("workloads", {}).items():
        setup = data.get("setup", {})
        out.append(f"## {WORKLOAD_TITLES.get(w, w)}")
        out.append("")
        mml = f", max model length {setup['max_model_len']}" if setup.get("max_model_len") else ""
        out.append(
            f"{setup.get('replicas')} replicas, preset `{setup.get('preset')}`, time scale "
            f"{setup.get('time_scale')}, KV cache {setup.get('kv_tokens') or 'preset default'} tokens per replica"
            + (f" (shares by replica {setup['kv_fractions']})" if setup.get("kv_fractions") else "")
            + f"{mml}; "
            f"load: `{' '.join(data.get('load_args', []))}`"
        )
        out.append("")
        distinct = _distinct_content(data)
        if distinct:
            out.append(distinct)
            out.append("")
        out.append(
            "| router | req/s | TTFT mean | TTFT p50 | TTFT p95 | TTFT p99 | ITL p50 | e2e p95 "
            "| hit rate | bound | share max/mean | peak waiting | errors |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        notes = []
        for r in data.get("runs", []):
            if r.get("skipped"):
                out.append(f"| {r['label']} | skipped: {r['skipped']} |" + " |" * 11)
                continue
            ub = r.get("upper_bound") or {}
            t, itl, e2e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
            out.append(
                f"| {r['label']} | {r['req_per_s']:.2f} | {_ms(t['mean'])} | {_ms(t['p50'])} | {_ms(t['p95'])} "
                f"| {_ms(t['p99'])} | {itl['p50']:.1f} | {_ms(e2e['p95'])} | {_pct(r['hit_rate'])} "
                f"| {_pct(ub.get('hit_rate'))} | {r['share_max_over_mean']:.2f} "
                f"| {r['peak_waiting_total']:.0f} | {r['errors']} |"
            )
            lg = r.get("loadgen", {})
            notes.append(
                f"{r['label']}: {r['ok']}/{r['requests']} ok in {r['wall_s']:.0f} s real; "
                f"load generator {lg.get('cpu_s', 0):.2f} CPU s ({100 * lg.get('cpu_util', 0):.0f}% of a core), "
                f"router {r.get('router_cpu_s', 0):.2f} CPU s"
                + (f"; {100 * r['key_affinity']:.0f}% of requests on their key's usual replica"
                   if r.get("key_affinity") is not None else "")
                + (f"; errors: {r['error_kinds']}" if r.get("error_kinds") else "")
                + (_change(r["replica_change"]) if r.get("replica_change") else "")
                + (
                    "; filter decisions: "
                    + ", ".join(
                        f"{k.split('.', 1)[1]} {v}"
                        for k, v in sorted(r["filter_stats"].items())
                        if k.startswith("decision.")
                    )
                    if r.get("filter_stats")
                    else ""
                )
            )
        out.append("")
        out.extend(gateways_table(data.get("runs", [])))
        later = [(r["label"], r["ttft_later_turns_ms"]) for r in data.get("runs", [])
                 if not r.get("skipped") and r.get("ttft_later_turns_ms")]
        if later:
            out.append("Turns 2 and later only (the first turn of a conversation or session is a cold "
                       "prefill for every router; these are the requests routing decides):")
            out.append("")
            out.append("| router | requests | TTFT mean | TTFT p50 | TTFT p95 |")
            out.append("|---|---:|---:|---:|---:|")
            for label, t in later:
                out.append(f"| {label} | {t['n']} | {_ms(t['mean'])} | {_ms(t['p50'])} | {_ms(t['p95'])} |")
            out.append("")
        warm = [(r["label"], r["ttft_warm_ms"]) for r in data.get("runs", [])
                if not r.get("skipped") and r.get("ttft_warm_ms")]
        if warm:
            after = warm[0][1].get("after_s", 0)
            out.append(f"Warm only: requests sent after the first quarter of the run ({after:,.0f} simulated s: "
                       "every replica has prefilled the preamble and worked off the start-up backlog):")
            out.append("")
            out.append("| router | requests | TTFT mean | TTFT p50 | TTFT p95 | TTFT p99 |")
            out.append("|---|---:|---:|---:|---:|---:|")
            for label, t in warm:
                out.append(f"| {label} | {t['n']} | {_ms(t['mean'])} | {_ms(t['p50'])} | {_ms(t['p95'])} "
                           f"| {_ms(t['p99'])} |")
            out.append("")
        if notes:
            out.append("<details><summary>run notes</summary>")
            out.append("")
            out.extend(f"- {n}" for n in notes)
            out.append("")
            out.append("</details>")
            out.append("")
    out.append(
        "Columns: req/s = completed requests per simulated second; ITL = gap between streamed "
        "tokens; share max/mean = the busiest replica's request count over the mean (1.00 = even); "
        "peak waiting = highest sum over replicas of `vllm:num_requests_waiting`, polled every 0.2 s."
    )
    out.append("")
    return "\n".join(out)


def plots(results: dict, outdir: Path) -> list[str]:
    """TTFT CDF per router, and hit rate / p95 TTFT bars, per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib not installed, no plots", file=sys.stderr)
        return []
    made = []
    for w, data in results.get("workloads", {}).items():
        runs = [r for r in data.get("runs", []) if not r.get("skipped")]
        if not runs:
            continue
        scale = data.get("setup", {}).get("time_scale") or 1.0
        fig, ax = plt.subplots(figsize=(7, 4.2))
        curves = 0
        for r in runs:
            path = outdir / r["records_file"]
            try:
                recs = json.loads(path.read_text()).get("records") or []
            except (OSError, ValueError):
                continue
            ttft = sorted(x["ttft_ms"] / scale / 1000 for x in recs if x.get("ok") and x.get("ttft_ms") is not None)
            if not ttft:
                continue
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.step(ttft, ys, where="post", label=r["label"])
            curves += 1
        # Without per-request records (e.g. the committed example) keep
        # whatever CDF plot is already there.
        if curves:
            ax.set_xscale("log")
            ax.set_xlabel("time to first token (simulated s, log)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"TTFT CDF: {w}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
            fig.tight_layout()
            name = f"{w}-ttft-cdf.png"
            fig.savefig(outdir / name, dpi=110)
            made.append(name)
        plt.close(fig)

        labels = [r["router"] + (f" x{r['envoy_instances']}" if r.get("envoy_instances", 1) > 1 else "")
                  for r in runs]
        hit = [100 * (r["hit_rate"] or 0) for r in runs]
        p95 = [r["ttft_ms"]["p95"] / 1000 for r in runs]
        bound = next((r["upper_bound"]["hit_rate"] for r in runs if (r.get("upper_bound") or {}).get("hit_rate") is not None), None)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
        a1.bar_label(a1.bar(labels, hit, color="tab:green"), fmt="%.0f%%", fontsize=7)
        if bound is not None:
            a1.axhline(100 * bound, color="k", ls="--", lw=1, label=f"upper bound {100 * bound:.0f}%")
            a1.legend(fontsize=8)
        a1.set_ylabel("prefix-cache hit rate (%)")
        a1.set_ylim(0, 100)
        a1.set_title(f"hit rate: {w}")
        a2.bar_label(a2.bar(labels, p95, color="tab:red"), fmt="%.2f", fontsize=7)
        a2.set_ylabel("TTFT p95 (simulated s)")
        a2.set_title(f"TTFT p95: {w}")
        for a in (a1, a2):
            a.tick_params(axis="x", rotation=30, labelsize=8)
            for lab in a.get_xticklabels():
                lab.set_horizontalalignment("right")
        fig.tight_layout()
        name = f"{w}-bars.png"
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    outdir = Path(argv[0])
    results = json.loads((outdir / "results.json").read_text())
    md = render(results)
    (outdir / "report.md").write_text(md)
    plots(results, outdir)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
