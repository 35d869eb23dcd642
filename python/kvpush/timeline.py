"""``python -m kvpush.timeline DIR_OR_FILES...``: a request's timeline and the median of each gap over a run.

Reads the JSON lines that ``KVPUSH_TIMELINE=DIR`` makes ``kvpush router`` (``router_*`` events), the
connector (``p_*``, ``d_*``) and the engine (``eng_*``) write (kvpush/_timeline.py lists the events;
docs/benchmarks.md, "Time to first token", shows a run). Every process of a host stamps its events
with CLOCK_REALTIME, so lines of P, D and the router compare directly.

For each request (transfer id) it keeps each event's first time. Over a run, events are put in the
order of their median offset from the request's first event, and the gap between consecutive events
is the median, over the requests that have both, of the later one's time minus the earlier one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Requests = dict[str, dict[str, int]]


def files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    return out


def load(paths: Iterable[str | Path]) -> Requests:
    """Transfer id -> event -> its first time (ns). Lines that are not events are skipped."""
    reqs: Requests = {}
    for path in files(paths):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
                tid, ev, ns = str(e["tid"]), str(e["ev"]), int(e["ns"])
            except (ValueError, KeyError, TypeError):
                continue
            events = reqs.setdefault(tid, {})
            if ev not in events or ns < events[ev]:
                events[ev] = ns
    return reqs


def summarize(reqs: Requests) -> dict[str, Any]:
    """Events in order of median offset from each request's first event, with that median (ms), the
    median gap from the event before (ms) and how many requests had each."""
    offsets: dict[str, list[float]] = {}
    for events in reqs.values():
        t0 = min(events.values())
        for ev, ns in events.items():
            offsets.setdefault(ev, []).append((ns - t0) / 1e6)
    order = sorted(offsets, key=lambda ev: (statistics.median(offsets[ev]), ev))
    rows = []
    for i, ev in enumerate(order):
        row: dict[str, Any] = {"event": ev, "requests": len(offsets[ev]), "at_ms": statistics.median(offsets[ev])}
        if i > 0:
            prev = order[i - 1]
            gaps = [(e[ev] - e[prev]) / 1e6 for e in reqs.values() if ev in e and prev in e]
            row["gap_from"] = prev
            row["gap_ms"] = statistics.median(gaps) if gaps else None
        rows.append(row)
    return {"requests": len(reqs), "events": rows}


def request_lines(events: dict[str, int]) -> list[str]:
    """One request's events in time order: offset from its first event and gap from the one before (ms)."""
    items = sorted(events.items(), key=lambda kv: (kv[1], kv[0]))
    t0 = items[0][1] if items else 0
    out, prev = [], t0
    for ev, ns in items:
        out.append(f"{(ns - t0) / 1e6:9.3f} ms  +{(ns - prev) / 1e6:8.3f}  {ev}")
        prev = ns
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    out = [f"{summary['requests']} requests; median at (ms from the first event) and median gap (ms)"]
    for r in summary["events"]:
        gap = r.get("gap_ms")
        gap_s = "" if "gap_from" not in r else f"+{gap:8.3f}" if gap is not None else "       -"
        out.append(f"{r['at_ms']:9.3f}  {gap_s:>9}  {r['event']:24s} ({r['requests']})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="KVPUSH_TIMELINE directories or their .jsonl files")
    ap.add_argument("--request", help="print this transfer id's timeline (a prefix is enough; 'last': the latest)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    try:
        reqs = load(args.paths)
    except OSError as e:
        print(f"cannot read the timeline: {e}", file=sys.stderr)
        return 1
    if not reqs:
        print("no timeline events found", file=sys.stderr)
        return 1
    if args.request:
        if args.request == "last":
            tid = max(reqs, key=lambda t: min(reqs[t].values()))
        else:
            matches = [t for t in reqs if t.startswith(args.request.lower())]
            if len(matches) != 1:
                print(f"{len(matches)} transfer ids start with {args.request!r}", file=sys.stderr)
                return 1
            tid = matches[0]
        print(f"transfer {tid}")
        print("\n".join(request_lines(reqs[tid])))
        return 0
    summary = summarize(reqs)
    print(json.dumps(summary, indent=1) if args.json else "\n".join(summary_lines(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
