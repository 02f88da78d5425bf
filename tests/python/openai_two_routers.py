"""Streams through one address that several routers share, with the official `openai` client
and its default retries.

Usage: openai_two_routers.py BASE_URL MODEL SECONDS STOP_FILE
Four clients send streaming completions one after another until SECONDS pass or STOP_FILE
exists. Prints one JSON line: the requests that completed, that failed before their first
chunk (what the client's retries must hide), and that failed mid-stream (allowed when the
router serving them dies), with the errors seen.
"""

import json
import os
import sys
import threading
import time

from openai import OpenAI

base, model, seconds, stop_file = sys.argv[1:5]
deadline = time.time() + float(seconds)
report = {"completed": 0, "failed_before_stream": 0, "failed_mid_stream": 0, "errors": []}
lock = threading.Lock()


def client_loop(k):
    # The client's defaults: 2 retries with backoff on connection errors, 429 and 5xx.
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
    i = k
    while time.time() < deadline and not os.path.exists(stop_file):
        phase = "create"
        try:
            stream = client.completions.create(
                model=model, prompt=f"two routers {i % 4}", max_tokens=8, temperature=0, stream=True
            )
            phase = "headers"
            for _chunk in stream:
                phase = "chunk"
            outcome = "completed"
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            outcome = "failed_mid_stream" if phase == "chunk" else "failed_before_stream"
            cause = e.__cause__ or e.__context__
            with lock:
                report["errors"].append(f"{phase}: {type(e).__name__}: {e} ({cause!r})"[:300])
        with lock:
            report[outcome] += 1
        i += 4


threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(report))
