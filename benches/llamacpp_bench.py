"""llama.cpp on the same GGUF, measured the way engine/benches/throughput.rs measures Duet.

Prints one JSON object per thread count: prefill tok/s for a 512-token prompt, and decode
tok/s at batch 1 after a 32-token and after a 512-token context.
Usage: python llamacpp_bench.py MODEL.gguf THREADS[,THREADS...]
"""

import json
import sys
import time

from llama_cpp import Llama

TEXT = "The quick brown fox jumps over the lazy dog. " * 60


def best_of(n, fn):
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    model, threads = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    for t in threads:
        llm = Llama(model_path=model, n_ctx=1024, n_threads=t, n_threads_batch=t,
                    n_batch=512, n_ubatch=512, verbose=False)
        tokens = llm.tokenize(TEXT.encode(), add_bos=False)[:512]

        def prefill():
            llm.reset()
            llm.eval(tokens)

        prefill_s = best_of(3, prefill)

        def decode_after(ctx, steps=64):
            llm.reset()
            llm.eval(tokens[:ctx])
            tok = tokens[40]
            t0 = time.perf_counter()
            for _ in range(steps):
                llm.eval([tok])
            return steps / (time.perf_counter() - t0)

        print(json.dumps({
            "engine": "llama.cpp",
            "threads": t,
            "prefill_tok_s": len(tokens) / prefill_s,
            "decode_b1_tok_s": max(decode_after(32) for _ in range(2)),
            "decode_b1_after_512_tok_s": decode_after(448),
        }), flush=True)


if __name__ == "__main__":
    main()
