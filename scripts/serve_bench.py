#!/usr/bin/env python3
"""Serving benchmark for an OpenAI-compatible server (moelora serve, vLLM, SGLang).

In the spirit of SGLang's bench_serving: sends --num-prompts streamed completion requests of random
token-id prompts (--input-len tokens) with ignore_eos and a fixed --output-len, at most
--concurrency at a time, spread round-robin over the --model names (base model and adapters), and
reports request throughput, output token throughput, time to first token (TTFT), inter-token
latency (ITL, between consecutive streamed chunks with text; a chunk can hold more than one
token when the server holds back an incomplete UTF-8 character) and end-to-end latency percentiles.

    .deps/pyclient/bin/python scripts/serve_bench.py --base-url http://127.0.0.1:8000 \\
        --model model,sql --num-prompts 200 --concurrency 16 --input-len 128 --output-len 64

Uses only the standard library (urllib, threads), so it runs in the .deps/pyclient environment
that scripts/setup creates or any other Python 3.8+.
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def percentile(values, p):
    """Linear-interpolated percentile of a list (p in [0, 100]); None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def one_request(args, model, prompt):
    """Streams one completion; returns a dict with timings (seconds) or an error."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    req = urllib.request.Request(args.base_url.rstrip("/") + "/v1/completions",
                                 data=json.dumps(body).encode(), headers=headers)
    start = time.perf_counter()
    chunk_times = []  # arrival of each token chunk
    output_tokens = None
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    raise RuntimeError(event["error"].get("message", str(event["error"])))
                # A token chunk: the server sends one per generated token (its text may be
                # empty, e.g. part of a character, or an id outside a test tokenizer's vocabulary);
                # the final chunk carries the finish_reason instead.
                choice = event["choices"][0] if event.get("choices") else None
                if choice is not None and "text" in choice and choice.get("finish_reason") is None:
                    chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    output_tokens = event["usage"].get("completion_tokens")
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"}
    except Exception as e:  # noqa: BLE001 - any failure counts as an error of this request
        return {"error": repr(e)[:200]}
    end = time.perf_counter()
    if not chunk_times:
        return {"error": "no tokens streamed"}
    return {
        "ttft": chunk_times[0] - start,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "e2e": end - start,
        "output_tokens": output_tokens if output_tokens is not None else len(chunk_times),
        "input_tokens": len(prompt),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True,
                        help="comma-separated model/adapter names; requests go round-robin")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="arrivals per second (Poisson, seeded); inf = all at once, bounded "
                             "by --concurrency")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens (ignore_eos)")
    parser.add_argument("--vocab-size", type=int, default=500,
                        help="prompt ids are drawn from [10, VOCAB); 500 fits every model, "
                             "including the synthetic test models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()

    models = [m for m in args.model.split(",") if m]
    rng = random.Random(args.seed)
    vocab = args.vocab_size
    work = [(models[i % len(models)], [rng.randrange(10, vocab) for _ in range(args.input_len)])
            for i in range(args.num_prompts)]

    results = [None] * len(work)
    done = [0]
    lock = threading.Lock()

    # Arrival times: a Poisson process at --request-rate (exponential gaps), or all at t = 0.
    arrivals = [0.0] * len(work)
    if args.request_rate != float("inf"):
        t = 0.0
        for i in range(len(work)):
            t += rng.expovariate(args.request_rate)
            arrivals[i] = t

    def run(i):
        delay = wall_start + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        results[i] = one_request(args, *work[i])
        with lock:
            done[0] += 1
            if sys.stderr.isatty():
                print(f"\r{done[0]}/{len(work)}", end="", file=sys.stderr, flush=True)

    wall_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(run, range(len(work))))
    wall = time.perf_counter() - wall_start
    if sys.stderr.isatty():
        print(file=sys.stderr)

    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["input_tokens"] for r in ok)
    ms = lambda x: None if x is None else x * 1000.0  # noqa: E731
    summary = {
        "base_url": args.base_url, "models": models, "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len, "duration_s": wall, "completed": len(ok),
        "errors": len(errors), "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "ttft_ms": {f"p{p}": ms(percentile(ttft, p)) for p in (50, 90, 99)},
        "itl_ms": {f"p{p}": ms(percentile(itl, p)) for p in (50, 90, 99)},
        "e2e_ms": {f"p{p}": ms(percentile(e2e, p)) for p in (50, 99)},
        "ttft_ms_mean": ms(sum(ttft) / len(ttft)) if ttft else None,
        "itl_ms_mean": ms(sum(itl) / len(itl)) if itl else None,
        "first_errors": errors[:5],
    }

    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    rows = [
        ("Models", ",".join(models)),
        ("Prompts / concurrency", f"{args.num_prompts} / {args.concurrency}"),
        ("Request rate (req/s)", "inf" if args.request_rate == float("inf") else fmt(args.request_rate)),
        ("Input / output len", f"{args.input_len} / {args.output_len}"),
        ("Successful requests", str(len(ok))),
        ("Errors", str(len(errors))),
        ("Benchmark duration (s)", fmt(wall)),
        ("Total output tokens", str(out_tokens)),
        ("Request throughput (req/s)", fmt(summary["request_throughput"])),
        ("Output token throughput (tok/s)", fmt(summary["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(summary["total_token_throughput"])),
        ("TTFT mean (ms)", fmt(summary["ttft_ms_mean"])),
    ]
    rows += [(f"TTFT {k} (ms)", fmt(v)) for k, v in summary["ttft_ms"].items()]
    rows += [("ITL mean (ms)", fmt(summary["itl_ms_mean"]))]
    rows += [(f"ITL {k} (ms)", fmt(v)) for k, v in summary["itl_ms"].items()]
    rows += [(f"E2E {k} (ms)", fmt(v)) for k, v in summary["e2e_ms"].items()]
    width = max(len(k) for k, _ in rows)
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for k, v in rows:
        print(f"{k:<{width}}  {v:>20}")
    print("=" * 66)
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
