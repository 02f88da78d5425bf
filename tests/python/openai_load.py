"""Concurrency and cancellation with the official `openai` client.

Usage: openai_load.py BASE_URL MODEL
1. 32 concurrent streaming requests (8 prompts, 4 copies each) all complete, and each greedy
   output equals the output of the same request sent alone.
2. A client that disconnects mid-stream (the caller then checks the workers' pools).
"""

import sys
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
prompts = [f"Write a short note about the number {i}." for i in range(8)]


def stream(prompt):
    out = []
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0, stream=True
    ):
        for c in chunk.choices:
            out.append(c.delta.content or "")
    return "".join(out)


alone = {p: stream(p) for p in prompts}
with ThreadPoolExecutor(max_workers=32) as pool:
    jobs = [(p, pool.submit(stream, p)) for p in prompts * 4]
    results = [(p, j.result()) for p, j in jobs]
assert len(results) == 32
for p, text in results:
    assert text == alone[p], (p, text, alone[p])
print("32 concurrent streams match their single runs")

# Disconnect mid-stream: read two chunks, then close the connection.
# Long enough (2000 tokens, EOS ignored) that it would still be running when the caller checks
# the pools, had the disconnect not cancelled it; short enough for the test's KV pool (2560
# tokens: a longer sequence is refused up front, since it could never finish).
s = client.completions.create(
    model=model, prompt="Count slowly: one, two,", max_tokens=2000, temperature=0, stream=True,
    extra_body={"ignore_eos": True, "min_tokens": 2000},
)
it = iter(s)
next(it)
next(it)
s.response.close()
print("disconnected mid-stream")
