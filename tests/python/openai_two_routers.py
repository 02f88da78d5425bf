"""Streams through two routers with the official `openai` client and its default retries.

Usage: openai_two_routers.py BASE_URL_A BASE_URL_B MODEL SECONDS STOP_FILE
Two clients per router send streaming completions one after another until SECONDS pass or
STOP_FILE exists. Prints one JSON line: per router, the requests that completed, that failed
before their first chunk (what the client's retries must hide), and that failed mid-stream
(allowed when the router serving them dies), with the errors seen.
"""

import json
import os
import sys
import threading
import time

from openai import OpenAI

base_a, base_b, model, seconds, stop_file = sys.argv[1:6]
deadline = time.time() + float(seconds)
report = {}
lock = threading.Lock()


def client_loop(name, base, k):
    # The client's defaults: 2 retries with backoff on connection errors, 429 and 5xx.
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
    i = k
    while time.time() < deadline and not os.path.exists(stop_file):
        started = False
        try:
            stream = client.completions.create(
                model=model,
                prompt=f"two routers {i % 4}",
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            for _chunk in stream:
                started = True
            outcome = "completed"
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            outcome = "failed_mid_stream" if started else "failed_before_stream"
            with lock:
                report[name]["errors"].append(f"{type(e).__name__}: {e}"[:200])
        with lock:
            report[name][outcome] += 1
        i += 2


threads = []
for name, base in (("a", base_a), ("b", base_b)):
    report[name] = {"completed": 0, "failed_before_stream": 0, "failed_mid_stream": 0, "errors": []}
    for k in range(2):
        t = threading.Thread(target=client_loop, args=(name, base, k))
        t.start()
        threads.append(t)
for t in threads:
    t.join()
print(json.dumps(report))
