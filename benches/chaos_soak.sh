#!/usr/bin/env bash
# A long `duet chaos` soak with process faults, as issue 14 asks: a router + p0 + d0 cluster
# (release build, the real model) with a 3 s drain backstop, 16 streams, and every 2 s a fault
# dealt from a deck of the serving actors (duet kill), SIGSTOP of a worker process for 1 to
# 10 s, and SIGKILL of a worker process (duet up starts it again). Then the transfer history
# is checked by the independent checker.
#
#   benches/chaos_soak.sh [SECONDS] [KV_TRANSPORT]      (default 600 shm)
#
# Prints the chaos report and the checker's verdict; exits non-zero if either finds a problem
# or fewer than 99.5 % of the requests succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
transport=${2:-shm}
cargo build --release --quiet
duet=$PWD/target/release/duet
model=$("$duet" fetch-model | awk '{print $1}')
model=$(realpath "$model")
dir=$(mktemp -d)
trap 'kill "$up" 2>/dev/null; wait "$up" 2>/dev/null; rm -rf "$dir"' EXIT
read -r http r p d < <(python3 - <<'PY'
import socket
ports = []
socks = []
for _ in range(4):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1]); socks.append(s)
print(*ports)
PY
)
cat > "$dir/cluster.toml" <<EOF
[cluster]
name = "soak"

[serving]
model = "$model"
http = "127.0.0.1:$http"
kv_pages = 256
max_batch_tokens = 64
disagg_threshold = 16
request_timeout_secs = 60
bootstrap_timeout_secs = 10
transfer_timeout_secs = 15
kv_transport = "$transport"
drain_fence_secs = 1
drain_backstop_secs = 3

[supervision.default]
max_restarts = 1000
within_secs = 60

[supervision.node]
max_restarts = 1000
within_secs = 60

[[node]]
name = "router"
role = "router"
address = "127.0.0.1:$r"

[[node]]
name = "p0"
role = "prefill"
address = "127.0.0.1:$p"

[[node]]
name = "d0"
role = "decode"
address = "127.0.0.1:$d"
EOF
mkdir -p "$dir/history"
DUET_HISTORY_DIR=$dir/history DUET_LOG=warn "$duet" up --config "$dir/cluster.toml" \
  > "$dir/up.out" 2> "$dir/up.err" &
up=$!
for _ in $(seq 1 120); do grep -q '^ready' "$dir/up.out" 2>/dev/null && break; sleep 1; done
grep -q '^ready' "$dir/up.out" || { echo "the cluster did not start"; tail -20 "$dir/up.err"; exit 1; }
set +e
"$duet" chaos --config "$dir/cluster.toml" --duration "$secs" --kill-every 2 \
  --concurrency 16 --pause --pause-secs 1..10 --crash --json > "$dir/report.json"
chaos=$?
set -e
cat "$dir/report.json"
echo
python3 tests/python/check_history.py "$dir/history" | tee "$dir/history.json"
checker=${PIPESTATUS[0]}
python3 - "$dir/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"requests {r['requests']}, succeeded {r['succeeded']} ({100 * r['success_rate']:.2f} %), "
      f"failed {r['failed']}, unfinished {r['unfinished']}, corrupted {r['corrupted']}, "
      f"stranded pages {r['stranded_pages']}; kills {sum(r['kills'].values())}, "
      f"pauses {sum(r['pauses'].values())}, crashes {sum(r['crashes'].values())}")
sys.exit(0 if r["success_rate"] >= 0.995 else 1)
PY
rate=$?
[ "$chaos" -eq 0 ] && [ "$checker" -eq 0 ] && [ "$rate" -eq 0 ]
