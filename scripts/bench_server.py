"""What `dflash serve` costs over the Python API: the bundled prompts completed directly, over HTTP, and
over HTTP streamed (server-sent events), interleaved prompt by prompt on one SpeculativeLlama, greedy.

    .venv/bin/python scripts/bench_server.py [--rounds 2] [-n 128]
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import time

from bench_common import TINY, pair_parser

from dflash_gguf import SpeculativeLlama
from dflash_gguf.server import serving


def post(port: int, body: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    data = conn.getresponse().read()
    conn.close()
    return data


def main() -> int:
    ap = pair_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompts = [json.loads(line)["text"] for line in (TINY / "prompts.jsonl").read_text().splitlines() if line]
    llm = SpeculativeLlama(args.target, args.draft, n_ctx=1024, n_threads=args.threads)
    with serving(llm, "bench") as port:
        kw = {"max_tokens": args.n, "temperature": 0.0}
        llm.create_completion(prompts[0], **kw)  # warm-up (the controller's calibration)
        times: dict[str, list[float]] = {"direct": [], "http": [], "http stream": []}
        tokens = 0
        for _ in range(args.rounds):
            for p in prompts:
                t0 = time.perf_counter()
                direct = llm.create_completion(p, **kw)
                times["direct"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                over_http = json.loads(post(port, {"prompt": p, **kw}))
                times["http"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                post(port, {"prompt": p, "stream": True, **kw})
                times["http stream"].append(time.perf_counter() - t0)
                assert over_http["choices"][0]["text"] == direct["choices"][0]["text"]
                tokens += direct["usage"]["completion_tokens"]
    base = sum(times["direct"])
    print(
        f"{len(prompts)} prompts x {args.rounds} rounds, {args.n} tokens, greedy; wall time per request "
        f"(prefill included)"
    )
    for name, t in times.items():
        print(
            f"{name:>12}: {tokens / sum(t):7.1f} tok/s, median {statistics.median(t) * 1e3:6.1f} ms/request, "
            f"{sum(t) / base:.3f}x the direct time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
