#!/usr/bin/env python3
"""Load for an OpenAI-compatible server (baton serve, llama-server): the requests of a JSONL file
(batch's format: "prompt", "max_tokens", "temperature") sent as chat completions by CONCURRENCY
clients at once, each client sending its next request when its reply is in. Prints one line:
requests, generated tokens (the replies' usage), wall time from the first request sent to the last
reply, generated tokens/s over that time, and the mean and worst request latency.

Usage: bench_serve.py URL PROMPTS.jsonl CONCURRENCY
"""
import json
import sys
import threading
import time
import urllib.request


def main():
    url, path, concurrency = sys.argv[1].rstrip("/"), sys.argv[2], int(sys.argv[3])
    with open(path) as f:
        todo = [json.loads(line) for line in f if line.strip()]
    lock = threading.Lock()
    latencies, tokens, errors = [], [0], []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                req = todo.pop(0)
            body = {"messages": [{"role": "user", "content": req["prompt"]}], "max_tokens": req["max_tokens"],
                    "temperature": req.get("temperature", 0), "ignore_eos": True}
            t0 = time.monotonic()
            try:
                r = urllib.request.urlopen(urllib.request.Request(
                    url + "/v1/chat/completions", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}), timeout=600)
                reply = json.load(r)
            except Exception as e:  # a refused request is counted, not fatal
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                latencies.append(time.monotonic() - t0)
                tokens[0] += reply["usage"]["completion_tokens"]

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    n = len(latencies)
    print(f"{n} ok, {len(errors)} failed | {tokens[0]} generated tokens | {wall:.2f} s | "
          f"{tokens[0] / wall:.1f} generated tok/s | latency mean {sum(latencies) / max(n, 1):.2f} s, "
          f"max {max(latencies, default=0):.2f} s")
    if errors:
        print("first error:", errors[0], file=sys.stderr)


if __name__ == "__main__":
    main()
