#!/usr/bin/env bash
# Duet's engine beside llama.cpp on the same GGUF and thread counts, in one run.
#
#   benches/engine_vs_llamacpp.sh [THREADS]      (default 1,2)
#
# Builds llama-cpp-python 0.3.36 from PyPI into .bench-venv/ on first use (about 4 minutes on
# two cores; CPU only, native instructions), then runs both benchmarks and prints the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-1,2}
venv=.bench-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF" \
    "$venv/bin/pip" install --quiet llama-cpp-python==0.3.36
fi
model=$(cargo run --release --quiet -- fetch-model | awk '{print $1}')
echo "== llama.cpp"
"$venv/bin/python" benches/llamacpp_bench.py "$model" "$threads" | tee /tmp/duet-llamacpp.jsonl
echo "== duet"
cargo bench --quiet -p duet-engine --bench throughput -- --threads "$threads" --json | tee /tmp/duet-engine.jsonl
python3 - <<'PY'
import json
ll = {r["threads"]: r for r in map(json.loads, open("/tmp/duet-llamacpp.jsonl"))}
du = {r["threads"]: r for r in map(json.loads, open("/tmp/duet-engine.jsonl"))}
print("\nthreads  metric                       duet      llama.cpp  ratio")
for t in sorted(du):
    d, l = du[t], ll.get(t, {})
    for key in ["prefill_tok_s", "decode_b1_tok_s", "decode_b1_after_512_tok_s"]:
        if key in l:
            print(f"{t:>7}  {key:<26} {d[key]:>9.1f}  {l[key]:>9.1f}  {d[key] / l[key]:>5.2f}x")
    print(f"{t:>7}  decode batch 8 / 32 tok/s     {d['decode_b8_tok_s']:>9.1f} / {d['decode_b32_tok_s']:.1f}"
          f"  (batch 32 = {d['decode_b32_tok_s'] / d['decode_b1_tok_s']:.1f}x batch 1)")
    print(f"{t:>7}  resident memory after load   {d['rss_after_load_mb']:.0f} MB (GGUF {d['gguf_mb']:.0f} MB, KV pool {d['kv_pool_mb']:.0f} MB)")
PY
