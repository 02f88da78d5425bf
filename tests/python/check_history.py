#!/usr/bin/env python3
"""An independent checker of Duet's transfer history (written apart from the Rust code).

Reads every DIR/*.jsonl a cluster wrote with DUET_HISTORY_DIR=DIR and checks, per transfer
attempt (decode node, decode worker incarnation, attempt key):

- no page is written after its attempt released it (closed or published), except by a TCP
  write to a receiver decode had already stopped (it cannot land: the receiver's listener
  is closed and every connection thread of it joined);
- every write is settled (landed: a shm write's end; or fenced; or its connection dropped;
  or its sender thread stopped; or, for a TCP write, the receiver it went to stopped) before
  the attempt's pages are released;
- an attempt's pages are released once (one `close` or one `publish`);
- nothing is published unless prefill fenced the attempt's writes first;
- a write touches only pages its attempt reserved;
- no page is reserved by a second attempt while the first still holds it.

Prints a JSON summary; exits 1 if any rule is broken.
"""

import json
import pathlib
import sys
from collections import defaultdict


def load(folder):
    events = []
    for path in sorted(pathlib.Path(folder).glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON: {e}")
    events.sort(key=lambda e: e["t"])
    return events


def check(events):
    key = lambda e: (e["decode"], e["inc"], e["attempt"])
    opened, ends, writes, settles = {}, defaultdict(list), defaultdict(list), defaultdict(list)
    fenced = defaultdict(list)
    stopped = {}
    # (decode, inc, receiver address) -> when decode stopped that TCP receiver
    receiver_stops = {}

    def dead_receiver(w, at):
        # A TCP write's receiver was stopped at or before `at`.
        stop = receiver_stops.get((w["decode"], w["inc"], w.get("via")))
        return w.get("backend") == "tcp" and stop is not None and stop <= at
    violations = []
    held = defaultdict(dict)  # (decode, inc) -> page -> attempt key
    for e in events:
        ev = e["event"]
        if ev == "open":
            k = key(e)
            pool = (e["decode"], e["inc"])
            for p in e["pages"]:
                if p in held[pool]:
                    violations.append(
                        f"page {p} of {pool} reserved by attempt {k[2]} while attempt "
                        f"{held[pool][p][2]} still held it")
                held[pool][p] = k
            opened[k] = e
        elif ev in ("close", "publish"):
            k = key(e)
            ends[k].append(e)
            if len(ends[k]) > 1:
                violations.append(f"attempt {k} released twice ({[x['event'] for x in ends[k]]})")
            if ev == "publish" and not any(f["t"] <= e["t"] for f in fenced[k]):
                violations.append(f"attempt {k} published before prefill fenced its writes")
            pool = (e["decode"], e["inc"])
            for p in opened.get(k, {}).get("pages", []):
                if held[pool].get(p) == k:
                    del held[pool][p]
        elif ev == "write_begin":
            k = key(e)
            if dead_receiver(e, e["t"]):
                continue  # into a closed connection: nothing of it can land
            writes[k].append(e)
            if ends[k]:
                violations.append(f"attempt {k} wrote pages {e['pages']} after its release")
            if k in opened and not set(e["pages"]) <= set(opened[k]["pages"]):
                violations.append(f"attempt {k} wrote pages outside its reservation: {e['pages']}")
        elif ev in ("write_end", "fenced", "dropped"):
            settles[key(e)].append(e)
            if ev == "fenced":
                fenced[key(e)].append(e)
        elif ev == "sender_stopped":
            stopped[e["sender"]] = e["t"]
        elif ev == "receiver_stopped":
            receiver_stops[(e["decode"], e["inc"], e.get("via"))] = e["t"]
    # Every write settled before the release that followed it.
    for k, ws in writes.items():
        if not ends[k]:
            continue
        end = ends[k][0]["t"]
        for w in ws:
            if w["t"] > end:
                continue
            settled = any(
                w["t"] <= s["t"] <= end
                and (s["event"] != "write_end" or w.get("backend") == "shm")
                for s in settles[k]
            ) or (w["sender"] in stopped and w["t"] <= stopped[w["sender"]] <= end) or (
                dead_receiver(w, end)  # every thread that could land it was joined
            )
            if not settled:
                violations.append(f"attempt {k}: a write was not settled before its release")
    return {
        "events": len(events),
        "attempts": len(opened),
        "published": sum(1 for k in ends if ends[k] and ends[k][0]["event"] == "publish"),
        "closed": sum(1 for k in ends if ends[k] and ends[k][0]["event"] == "close"),
        "writes": sum(len(w) for w in writes.values()),
        "receiver_stops": len(receiver_stops),
        "violations": violations,
    }


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: check_history.py DIR")
    report = check(load(sys.argv[1]))
    print(json.dumps(report))
    sys.exit(1 if report["violations"] else 0)


if __name__ == "__main__":
    main()
