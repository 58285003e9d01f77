"""The main job, small: Envoy + prefix-router in front of four replicas.

Sends three groups of requests that share a long prefix (like RAG over three
documents) and prints which replica served each and why.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testkit.harness import Envoy, backends, completion, free_port, render_config, request  # noqa: E402


def main() -> int:
    with backends(4) as bs:
        pool = [b.addr for b in bs]
        plugin = {"endpoints": pool, "debug_header": True}
        cfg = render_config("override_host", plugin, pool, free_port(), free_port())
        with Envoy(cfg, concurrency=2) as envoy:
            print(f"envoy on 127.0.0.1:{envoy.port}, replicas {', '.join(pool)}\n")
            print(f"{'request':<28} {'served by':<18} decision")
            for turn in range(4):
                for doc in ("refund-policy", "api-reference", "onboarding"):
                    prompt = f"[{doc}] " + f"Section text of {doc}. " * 40 + f"Question {turn}?"
                    status, headers, _ = request(envoy.port, body=completion(prompt))
                    debug = dict(
                        kv.split("=", 1) for kv in headers["x-prefix-router-debug"].split("; ")[:3]
                    )
                    print(
                        f"{doc + ' q' + str(turn):<28} {debug['replica']:<18} "
                        f"{debug['reason']} (matched {debug['matched']} blocks)  [{status}]"
                    )
            routed = envoy.stat("prefix_router.requests_total")
            hits = envoy.stat("prefix_router.decision.prefix_hit")
            print(f"\n{routed} requests routed, {hits} sent to the replica holding their prefix.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
