#!/usr/bin/env python3
"""The TTFT p95 no router can beat on a session workload, from a run that
gave every session a replica to itself.

    scripts/bench --workload agentic --routers prefix-router --replicas 8 --seed S
    .venv/bin/python bench/session_floor.py bench/results/<time>/runs/agentic--prefix-router.json --replicas 4

With a replica per session no turn waits behind another session's, so a
later turn's TTFT is its own new tokens' prefill. On `--replicas` R
(fewer) replicas at least R first turns pay the shared prompt cold; the
floor counts the R fastest first turns as measured (the least any R
cold ones cost) and the others as free, and every later turn as measured. Refuses a run in which a replica
served more than one session (its turns could have waited).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import orchestrate


def session_floor(doc: dict, time_scale: float, replicas: int) -> dict:
    """Floor of the TTFT p95 (simulated ms) on `replicas` replicas, and
    the later turns' p95 and maximum it rests on."""
    sessions = defaultdict(set)
    for r in doc.get("records", []):
        if r.get("ok"):
            sessions[r["served_by"]].add(r["key"])
    if not sessions:
        raise ValueError("no successful requests in the run")
    shared = sorted(rep for rep, keys in sessions.items() if len(keys) > 1)
    if shared:
        raise ValueError(f"replicas served more than one session: {', '.join(shared)}")
    first, later = orchestrate.turns_ttft(doc, time_scale)
    cold = sorted(first)[:replicas]
    floor = sorted(later + cold + [0.0] * (len(first) - len(cold)))
    later.sort()
    return {
        "requests": len(floor),
        "p95_floor_ms": orchestrate.nearest_rank(floor, 0.95),
        "later_p95_ms": orchestrate.nearest_rank(later, 0.95) if later else None,
        "later_max_ms": later[-1] if later else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run's JSON (bench/results/<time>/runs/<workload>--<router>.json)")
    ap.add_argument("--replicas", type=int, default=4, help="the pool the floor is for (default 4)")
    args = ap.parse_args()
    with open(args.run) as f:
        doc = json.load(f)
    scale = doc.get("config", {}).get("time_scale") or 1.0
    try:
        out = session_floor(doc, scale, args.replicas)
    except ValueError as e:
        print(f"session_floor: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
