#!/usr/bin/env bash
# Duet's engine beside llama.cpp on the same GGUF and thread counts, rounds interleaved.
#
#   benches/engine_vs_llamacpp.sh [THREADS] [ROUNDS]      (default 1,2 and 3)
#
# KEEP=DIR keeps each round's raw figures there (duet.jsonl, llamacpp.jsonl); every round's
# figures are also printed after the ranges, so a range's ends can be traced to their rounds.
#
# Builds llama-cpp-python 0.3.36 from PyPI into .bench-venv/ on first use (about 4 minutes on
# two cores; CPU only, native instructions). Each round runs llama.cpp, then Duet, each in a
# fresh process; the table gives, per metric, the range of each engine over the rounds and the
# range of the ratio within a round (a noisy neighbour moves both engines of a round, so the
# per-round ratio is the figure to quote, with its spread).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-1,2}
rounds=${2:-3}
venv=.bench-venv
# AMX off: on a Sapphire Rapids guest the native build's AMX path crashed in its first
# prompt (segmentation fault in decode); every other native instruction set stays on.
amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null ||
  [ "$(cat "$venv/.build-flags" 2>/dev/null)" != "$amx" ]; then
  python3 -m venv "$venv"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DCMAKE_C_FLAGS='$amx' -DCMAKE_CXX_FLAGS='$amx'" \
    "$venv/bin/pip" install --quiet --force-reinstall --no-cache-dir llama-cpp-python==0.3.36
  echo "$amx" > "$venv/.build-flags"
fi
model=$(cargo run --release --quiet -- fetch-model | awk '{print $1}')
cargo bench --quiet -p duet-engine --bench throughput --no-run
out=$(mktemp -d)
trap 'if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$out"/*.jsonl "$KEEP"/; fi; rm -rf "$out"' EXIT
for r in $(seq "$rounds"); do
  echo "== round $r/$rounds: llama.cpp" >&2
  "$venv/bin/python" benches/llamacpp_bench.py "$model" "$threads" |
    sed "s/^{/{\"round\": $r, /" >> "$out/llamacpp.jsonl"
  echo "== round $r/$rounds: duet" >&2
  DUET_MODEL="$model" cargo bench --quiet -p duet-engine --bench throughput -- --threads "$threads" --json |
    sed "s/^{/{\"round\": $r, /" >> "$out/duet.jsonl"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ll = [json.loads(l) for l in open(f"{out}/llamacpp.jsonl")]
du = [json.loads(l) for l in open(f"{out}/duet.jsonl")]
rng = lambda xs: f"{min(xs):7.1f}-{max(xs):7.1f}"
print(f"\n{len({r['round'] for r in du})} rounds, interleaved")
print("threads  metric                        duet tok/s       llama.cpp tok/s  duet/llama.cpp per round")
for t in sorted({r["threads"] for r in du}):
    d = {r["round"]: r for r in du if r["threads"] == t}
    l = {r["round"]: r for r in ll if r["threads"] == t}
    for key in ["prefill_tok_s", "decode_b1_tok_s", "decode_b1_after_512_tok_s"]:
        rounds = sorted(set(d) & set(l))
        ratios = [d[r][key] / l[r][key] for r in rounds]
        print(f"{t:>7}  {key:<28} {rng([d[r][key] for r in rounds])}  {rng([l[r][key] for r in rounds])}"
              f"  {min(ratios):.2f}-{max(ratios):.2f}x")
    b32 = [d[r]["decode_b32_tok_s"] for r in d]
    frac = [d[r]["b32_gmac_s"] / d[r]["fma_peak_gmac_s"] for r in d]
    print(f"{t:>7}  decode batch 32               {rng(b32)}  = {100*min(frac):.0f}-{100*max(frac):.0f} % of the f32 FMA peak measured in the run")
    bw = [d[r]["b1_weight_gb_s"] / d[r]["memory_read_gb_s"] for r in d]
    print(f"{t:>7}  decode batch 1 reads its weights at {100*min(bw):.0f}-{100*max(bw):.0f} % of what {t} core(s) read cycling through as many bytes (measured in the run)")
one = {r["round"]: r for r in du if r["threads"] == 1}
two = {r["round"]: r for r in du if r["threads"] == 2}
if one and two:
    for key in ["prefill_tok_s", "decode_b1_tok_s", "decode_b32_tok_s"]:
        s = [two[r][key] / one[r][key] for r in sorted(set(one) & set(two))]
        print(f"   2 vs 1 thread, {key:<24} {min(s):.2f}-{max(s):.2f}x (same process, per round)")
print("\nper round (tok/s: duet / llama.cpp = ratio; batch 32: duet, % of the peak measured in the run)")
for r in sorted({r["round"] for r in du}):
    for t in sorted({x["threads"] for x in du}):
        d = next((x for x in du if x["round"] == r and x["threads"] == t), None)
        l = next((x for x in ll if x["round"] == r and x["threads"] == t), None)
        if d is None or l is None:
            continue
        cells = [f"{k.replace('_tok_s', '')} {d[k]:.1f} / {l[k]:.1f} = {d[k] / l[k]:.2f}x"
                 for k in ["prefill_tok_s", "decode_b1_tok_s", "decode_b1_after_512_tok_s"]]
        cells.append(f"b32 {d['decode_b32_tok_s']:.1f}, {100 * d['b32_gmac_s'] / d['fma_peak_gmac_s']:.0f} %")
        print(f"  round {r}, {t} thread(s): " + "; ".join(cells))
PY
