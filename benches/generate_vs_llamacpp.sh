#!/usr/bin/env bash
# The engine the way a user runs it: `duet generate` as a whole process, pinned, beside
# llama.cpp (llama-cpp-python's create_completion) pinned the same way, on the same GGUF and
# the same 512 prompt tokens, 128 tokens generated greedily past end-of-sequence.
#
#   benches/generate_vs_llamacpp.sh [THREADS] [ROUNDS]      (default 1,2 and 3)
#
# THREADS n runs on cores 0..n-1 (taskset). Per round and thread count: llama.cpp, then Duet,
# each a fresh process. Reports time to first token (prefill of 512 plus the first token),
# decode tok/s over the 127 tokens after it, and the process's wall time with model load; the
# ratios are taken within a round. Uses .bench-venv from benches/engine_vs_llamacpp.sh.
# KEEP=DIR keeps each round's raw figures there (rows.jsonl); every round's figures are also
# printed after the ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-1,2}
rounds=${2:-3}
venv=.bench-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "run benches/engine_vs_llamacpp.sh once first: it builds llama-cpp-python into $venv" >&2
  exit 2
fi
model=$(cargo run --release --quiet -- fetch-model | awk '{print $1}')
cargo build --release --quiet
out=$(mktemp -d)
trap 'if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$out/rows.jsonl" "$KEEP"/ 2>/dev/null; fi; rm -rf "$out"' EXIT
# The prompt: llama.cpp's tokens of the engine benchmark's text, first 512.
ids=$("$venv/bin/python" - "$model" <<'PY'
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
text = "The quick brown fox jumps over the lazy dog. " * 60
print(",".join(str(t) for t in llm.tokenize(text.encode(), add_bos=False)[:512]))
PY
)
for r in $(seq "$rounds"); do
  for t in ${threads//,/ }; do
    cores="0-$((t - 1))"
    echo "== round $r/$rounds, $t thread(s): llama.cpp" >&2
    start=$(date +%s.%N)
    taskset -c "$cores" "$venv/bin/python" - "$model" "$t" "$ids" > "$out/l.json" <<'PY'
import json, sys, time
from llama_cpp import Llama
model, t, ids = sys.argv[1], int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
llm = Llama(model_path=model, n_ctx=1024, n_threads=t, n_threads_batch=t, n_batch=512,
            n_ubatch=512, verbose=False)
eos = llm.token_eos()
t0 = time.perf_counter()
first = None
n = 0
for _ in llm.create_completion(prompt=ids, max_tokens=128, temperature=0.0, stream=True,
                               logit_bias={eos: -1e9}):
    n += 1
    if first is None:
        first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({"ttft_ms": (first - t0) * 1e3, "completion_tokens": n,
                  "decode_tokens_per_s": (n - 1) / (end - first)}))
PY
    lwall=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$start" "$(date +%s.%N)")
    echo "== round $r/$rounds, $t thread(s): duet" >&2
    start=$(date +%s.%N)
    taskset -c "$cores" target/release/duet generate --model "$model" --prompt-ids "$ids" \
      --max-tokens 128 --ignore-eos --threads "$t" --json > "$out/d.json"
    dwall=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$start" "$(date +%s.%N)")
    python3 - "$out" "$r" "$t" "$lwall" "$dwall" >> "$out/rows.jsonl" <<'PY'
import json, sys
out, r, t, lwall, dwall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
l = json.load(open(f"{out}/l.json"))
d = json.load(open(f"{out}/d.json"))
print(json.dumps({"round": r, "threads": t, "llama": l, "duet": {
    "ttft_ms": d["ttft_ms"], "decode_tokens_per_s": d["decode_tokens_per_s"],
    "completion_tokens": d["completion_tokens"]}, "llama_wall_s": lwall, "duet_wall_s": dwall}))
PY
  done
done
python3 - "$out/rows.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rng = lambda xs: f"{min(xs):8.1f}-{max(xs):8.1f}"
print(f"\n{len({r['round'] for r in rows})} rounds, interleaved, whole processes, pinned")
print("threads  metric                     duet              llama.cpp         duet advantage per round")
for t in sorted({r["threads"] for r in rows}):
    rs = [r for r in rows if r["threads"] == t]
    d = [r["duet"]["ttft_ms"] for r in rs]; l = [r["llama"]["ttft_ms"] for r in rs]
    print(f"{t:>7}  time to first token (ms)   {rng(d)}  {rng(l)}  "
          f"{min(b / a for a, b in zip(d, l)):.2f}-{max(b / a for a, b in zip(d, l)):.2f}x")
    d = [r["duet"]["decode_tokens_per_s"] for r in rs]; l = [r["llama"]["decode_tokens_per_s"] for r in rs]
    print(f"{t:>7}  decode (tok/s)             {rng(d)}  {rng(l)}  "
          f"{min(a / b for a, b in zip(d, l)):.2f}-{max(a / b for a, b in zip(d, l)):.2f}x")
    d = [r["duet_wall_s"] for r in rs]; l = [r["llama_wall_s"] for r in rs]
    print(f"{t:>7}  process wall time (s)      {rng(d)}  {rng(l)}  "
          f"{min(b / a for a, b in zip(d, l)):.2f}-{max(b / a for a, b in zip(d, l)):.2f}x")
print("\nper round (duet / llama.cpp)")
for r in rows:
    d, l = r["duet"], r["llama"]
    print(f"  round {r['round']}, {r['threads']} thread(s): TTFT {d['ttft_ms']:.0f} / {l['ttft_ms']:.0f} ms, "
          f"decode {d['decode_tokens_per_s']:.1f} / {l['decode_tokens_per_s']:.1f} tok/s, "
          f"wall {r['duet_wall_s']:.2f} / {r['llama_wall_s']:.2f} s")
PY
