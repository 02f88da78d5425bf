#!/usr/bin/env bash
# Cache-aware routing against load-only routing on a shared-prefix workload, same machine,
# runs interleaved: a few system prompts, many users (each prompt = one of the system prompts
# + its own tokens). One router, one prefill worker, two decode workers, the real model.
#
#   benches/prefix_routing.sh [ROUNDS] [SECONDS]      (default 3 rounds of 40 s per policy)
#
# Prints, per run: requests, output tok/s, TTFT p50/p99, KV bytes moved (prefill's
# duet_kv_bytes_sent_total) per request, cache hits of the router's choices; then the spread.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-40}
bin=${DUET_BIN:-target/release/duet}
[ -x "$bin" ] || cargo build --release --quiet
model=$("$bin" fetch-model | awk '{print $1}')
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cluster() { # policy -> writes $work/$1/cluster.toml
    local dir="$work/$1"; mkdir -p "$dir"
    local http; http=$(port)
    {
        printf '[cluster]\nname = "bench-%s"\n[serving]\nmodel = "%s"\nhttp = "127.0.0.1:%s"\n' "$1" "$model" "$http"
        printf 'routing = "%s"\nkv_pages = 512\nmax_running = 16\n' "$1"
        for n in router:router p0:prefill d0:decode d1:decode; do
            printf '[[node]]\nname = "%s"\nrole = "%s"\naddress = "127.0.0.1:%s"\n' "${n%%:*}" "${n##*:}" "$(port)"
        done
    } > "$dir/cluster.toml"
    echo "$http"
}

metric() { # config node name labels -> value
    local cfg=$1 node=$2 name=$3 labels=${4:-}
    local addr; addr=$(awk -v n="$node" '$0 ~ "name = \""n"\"" {f=1} f && /address/ {gsub(/[" ]/,"",$3); print $3; exit}' "$cfg")
    local token; token=$(cat "$(dirname "$cfg")/.duet/token")
    curl -s -H "Authorization: Bearer $token" "http://$addr/metrics" \
        | awk -v n="$name" -v l="$labels" 'index($1, n) == 1 && index($0, l) {s += $NF} END {print s + 0}'
}

run_one() { # policy round
    local policy=$1 round=$2
    local http; http=$(cluster "$policy")
    local cfg="$work/$policy/cluster.toml"
    "$bin" up --config "$cfg" > "$work/$policy/up.log" 2>&1 &
    local up=$!
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$http/ready" 2>/dev/null | grep -q '"workers":3' && break
        sleep 0.2
    done
    "$bin" bench --url "http://127.0.0.1:$http" --concurrency 4 --shared-prefixes 4 \
        --prefix-len 384 --prompt-len 32..96 --output-len 32 --duration "$seconds" \
        --seed "$round" --json "$work/$policy-$round.json" > "$work/$policy-$round.txt"
    local bytes hits misses
    bytes=$(metric "$cfg" p0 duet_kv_bytes_sent_total)
    hits=$(metric "$cfg" router duet_router_cache_routes_total 'outcome="hit"')
    misses=$(metric "$cfg" router duet_router_cache_routes_total 'outcome="miss"')
    python3 - "$work/$policy-$round.json" "$policy" "$round" "$bytes" "$hits" "$misses" <<'P' | tee -a "$work/results.jsonl"
import json, sys
d = json.load(open(sys.argv[1]))["summary"]
policy, rnd, b, hits, misses = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
n = max(d["requests"], 1)
print(json.dumps({"policy": policy, "round": rnd, "requests": d["requests"], "failed": d["failed"],
    "tok_s": round(d["throughput_tok_s"], 1), "ttft_p50_ms": round(d["ttft_p50_ms"], 1),
    "ttft_p99_ms": round(d["ttft_p99_ms"], 1), "kv_mb_per_request": round(b / n / 1e6, 3),
    "router_hits": float(hits), "router_misses": float(misses)}))
P
    kill -TERM "$up"; wait "$up" 2>/dev/null || true
}

for r in $(seq 1 "$rounds"); do
    # Interleaved, alternating which goes first.
    if [ $((r % 2)) -eq 1 ]; then order="load cache_aware"; else order="cache_aware load"; fi
    for p in $order; do run_one "$p" "$r"; done
done
python3 - "$work/results.jsonl" <<'P'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\npolicy        runs  tok/s (min-max)      TTFT p50 ms (min-max)  TTFT p99 ms (min-max)  KV MB/request (min-max)")
for p in ["load", "cache_aware"]:
    rs = [r for r in rows if r["policy"] == p]
    def span(k): v = [r[k] for r in rs]; return f"{min(v):.1f}-{max(v):.1f}" if k != "kv_mb_per_request" else f"{min(v):.3f}-{max(v):.3f}"
    print(f"{p:<12} {len(rs):>5}  {span('tok_s'):<20} {span('ttft_p50_ms'):<22} {span('ttft_p99_ms'):<22} {span('kv_mb_per_request')}")
P
