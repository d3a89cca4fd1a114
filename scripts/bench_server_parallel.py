"""`dflash serve --parallel P` against one slot, under C clients asking at once: the bundled prompts split
among the clients, each client's requests one after another, greedy. Two servers run side by side and
take turns round by round: one slot with --threads threads, and P slots with --slot-threads each (by
default the same cores split among the slots). Prints the requests' wall time (prefill included; the
time a request waits for a slot counts), the clients' total tokens per second, and how many answers are
the Python API's.

    .venv/bin/python scripts/bench_server_parallel.py [--parallel 2] [--clients 2] [--rounds 2] [-n 64]
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time

from bench_common import TINY, pair_parser

from dflash_gguf import SpeculativeLlama
from dflash_gguf.server import serving


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def one_round(port: int, prompts: list[str], clients: int, kw: dict) -> tuple[float, list[float], dict[int, str], int]:
    """(wall time, per-request times, answers by prompt index, tokens generated) of the clients working
    through the prompts."""
    times: list[float] = []
    answers: dict[int, str] = {}
    tokens = [0]

    def client(k: int) -> None:
        for i in range(k, len(prompts), clients):
            t0 = time.perf_counter()
            out = post(port, {"prompt": prompts[i], **kw})
            times.append(time.perf_counter() - t0)
            answers[i] = out["choices"][0]["text"]
            tokens[0] += out["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, times, answers, tokens[0]


def main() -> int:
    ap = pair_parser(__doc__)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the one slot's threads")
    ap.add_argument("--slot-threads", type=int, default=0, help="each of the P slots' [default: threads / P]")
    args = ap.parse_args()
    slot_threads = args.slot_threads or max(1, args.threads // args.parallel)
    prompts = [json.loads(line)["text"] for line in (TINY / "prompts.jsonl").read_text().splitlines() if line]
    kw = {"max_tokens": args.n, "temperature": 0.0}
    one = SpeculativeLlama(args.target, args.draft, n_ctx=1024, n_threads=args.threads)
    many = SpeculativeLlama(args.target, args.draft, n_ctx=1024, n_threads=slot_threads)
    want = {i: one.create_completion(p, **kw)["choices"][0]["text"] for i, p in enumerate(prompts)}
    setups = {
        f"1 slot x {args.threads} threads": (one, 1),
        f"{args.parallel} slots x {slot_threads}": (many, args.parallel),
    }
    wall: dict[str, list[float]] = {name: [] for name in setups}
    per_request: dict[str, list[float]] = {name: [] for name in setups}
    same = dict.fromkeys(setups, 0)  # answers identical to the Python API's (greedy: a near-tie of a quantized
    # target's logits may go the other way with another prefill split)
    with serving(one, "one", parallel=1) as p1, serving(many, "many", parallel=args.parallel) as p2:
        ports = dict(zip(setups, (p1, p2)))
        for name, port in ports.items():  # warm-up: every slot's calibration
            one_round(port, prompts[: args.parallel], args.parallel, kw)
        for rnd in range(args.rounds):
            for name in list(ports)[rnd % 2 :] + list(ports)[: rnd % 2]:
                t, times, answers, tokens = one_round(ports[name], prompts, args.clients, kw)
                same[name] += sum(answers[i] == want[i] for i in want)
                wall[name].append(t)
                per_request[name].extend(times)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.n} tokens, greedy, {args.clients} clients at once")
    base = sum(wall[next(iter(setups))])
    for name in setups:
        t = per_request[name]
        q = statistics.quantiles(t, n=10)
        print(
            f"{name:>20}: {tokens * args.rounds / sum(wall[name]):7.1f} tok/s over all clients, request median "
            f"{statistics.median(t) * 1e3:6.0f} ms, p90 {q[-1] * 1e3:6.0f} ms; wall {sum(wall[name]) / base:.3f}x "
            f"the one slot's; {same[name]}/{len(prompts) * args.rounds} answers the Python API's"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
