"""Sends N concurrent non-streaming chat requests; prints one line per result ("ok" or the error).

Usage: openai_burst.py BASE_URL MODEL N
"""

import sys
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

base, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def one(i):
    try:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
        )
        return "ok" if r.usage.completion_tokens == 24 else f"short {r.usage.completion_tokens}"
    except Exception as e:  # reported, counted by the caller
        return f"error {type(e).__name__}: {e}"


with ThreadPoolExecutor(max_workers=n) as pool:
    for line in pool.map(one, range(n)):
        print(line, flush=True)
