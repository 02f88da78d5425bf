#!/usr/bin/env python3
"""An independent checker of Duet's transfer history (written apart from the Rust code).

Reads every DIR/*.jsonl a cluster wrote with DUET_HISTORY_DIR=DIR and checks, per transfer
attempt (decode node, decode worker incarnation, attempt key):

- no page is written after its attempt released it (closed or published);
- every write is settled before the attempt's pages are released;
- an attempt's pages are released once (one `close` or one `publish`);
- nothing is published unless prefill fenced the attempt's writes first;
- a write touches only pages its attempt reserved;
- no page is reserved by a second attempt while the first still holds it.

Where bytes land decides whose record counts as the write:

- shm and local: the writer copies into decode's pool itself, under its claim of the attempt's
  slot, and records `write_begin` once its claim held and `write_end` before letting it go. A
  write is settled by its `write_end` (or a later `fenced`, `dropped`, or its sender thread's
  `sender_stopped`), or by decode's `revoked`: decode took the attempt's claim slot back,
  which it can only while no writer holds it (a writer killed mid-copy records no end; its
  lock died with its process).
- tcp: bytes land only through decode's receiver, which records `land_begin` when a granted
  frame starts landing and `land_end` when its read ended (landed, or cut). A landing is
  settled by its `land_end`. Prefill's own tcp `write_begin` only says bytes were handed to a
  socket; what decode's receiver refused never landed, so those are checked against the
  reservation only.

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
    opened, ends = {}, defaultdict(list)
    # Per attempt: the writes that can touch its pages (shm/local write_begin, tcp land_begin),
    # and what settles them.
    writes, settles, fenced = defaultdict(list), defaultdict(list), defaultdict(list)
    stopped = {}
    receiver_stops = revokes = 0
    violations = []
    held = defaultdict(dict)  # (decode, inc) -> page -> attempt key

    def within_reservation(e, k):
        if k in opened and not set(e["pages"]) <= set(opened[k]["pages"]):
            violations.append(f"attempt {k} wrote pages outside its reservation: {e['pages']}")

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
        elif ev == "write_begin" and e.get("backend") == "tcp":
            within_reservation(e, key(e))  # lands, if at all, through decode's receiver
        elif ev in ("write_begin", "land_begin"):
            k = key(e)
            writes[k].append(e)
            if ends[k]:
                violations.append(f"attempt {k} wrote pages {e['pages']} after its release")
            within_reservation(e, k)
        elif ev in ("write_end", "fenced", "dropped", "land_end", "revoked"):
            settles[key(e)].append(e)
            if ev == "fenced":
                fenced[key(e)].append(e)
            revokes += ev == "revoked"
        elif ev == "sender_stopped":
            stopped[e["sender"]] = e["t"]
        elif ev == "receiver_stopped":
            receiver_stops += 1  # its threads were joined: each landing already ended

    def settled_by(w, s):
        # A tcp landing ends only by its own read's end (a revoke waits for it, then records).
        if w["event"] == "land_begin":
            return s["event"] == "land_end" and s.get("offset") == w.get("offset")
        return s["event"] != "land_end"

    # Every write settled before the release that followed it.
    for k, ws in writes.items():
        if not ends[k]:
            continue
        end = ends[k][0]["t"]
        for w in ws:
            if w["t"] > end:
                continue
            settled = any(
                w["t"] <= s["t"] <= end and settled_by(w, s) for s in settles[k]
            ) or (w.get("sender") in stopped and w["t"] <= stopped[w["sender"]] <= end)
            if not settled:
                violations.append(f"attempt {k}: a write was not settled before its release")
    return {
        "events": len(events),
        "attempts": len(opened),
        "published": sum(1 for k in ends if ends[k] and ends[k][0]["event"] == "publish"),
        "closed": sum(1 for k in ends if ends[k] and ends[k][0]["event"] == "close"),
        "writes": sum(len(w) for w in writes.values()),
        "receiver_stops": receiver_stops,
        "revokes": revokes,
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
