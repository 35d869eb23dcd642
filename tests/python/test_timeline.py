"""``python -m kvpush.timeline``: loading several processes' lines, one request's timeline, gap medians.

No server: the lines are written here as the router, the connector and the engine write them.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvpush import timeline

MS = 1_000_000


def write(path: Path, events: list[tuple[str, str, int]]) -> None:
    with path.open("a") as f:
        for tid, ev, ns in events:
            f.write(json.dumps({"ns": ns, "ev": ev, "tid": tid, "attempt": 1, "pid": 1}) + "\n")


def test_gap_medians_over_a_run(tmp_path: Path, capsys) -> None:
    base = 1_700_000_000 * 10**9
    # Three requests; "b" happens 1, 4, 10 ms after "a" (median 4), "c" 2, 2, 9 ms after "b" (median 2).
    offsets = {"t1": (1, 2), "t2": (4, 2), "t3": (10, 9)}
    for i, (tid, (ab, bc)) in enumerate(offsets.items()):
        t0 = base + i * 1000 * MS
        write(tmp_path / "router-1.jsonl", [(tid, "a", t0)])
        write(tmp_path / "vllm-2.jsonl", [(tid, "c", t0 + (ab + bc) * MS)])
        write(tmp_path / "engine-2.jsonl", [(tid, "b", t0 + ab * MS)])
    # A later duplicate keeps the first time; junk lines are skipped.
    write(tmp_path / "engine-2.jsonl", [("t1", "b", base + 50 * MS)])
    (tmp_path / "engine-2.jsonl").open("a").write("not json\n{\"ev\": \"x\"}\n")

    reqs = timeline.load([tmp_path])
    assert sorted(reqs) == ["t1", "t2", "t3"]
    assert reqs["t1"]["b"] == base + 1 * MS
    s = timeline.summarize(reqs)
    assert s["requests"] == 3
    assert [e["event"] for e in s["events"]] == ["a", "b", "c"]
    b, c = s["events"][1], s["events"][2]
    assert (b["at_ms"], b["gap_from"], b["gap_ms"]) == (4.0, "a", 4.0)
    assert (c["at_ms"], c["gap_from"], c["gap_ms"]) == (6.0, "b", 2.0)
    assert all(e["requests"] == 3 for e in s["events"])

    # One request's timeline, by a prefix of its id; the summary in text and JSON.
    assert timeline.main([str(tmp_path), "--request", "t3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "transfer t3"
    assert out[2].split()[-1] == "b" and "+  10.000" in out[2]
    assert out[3].split()[-1] == "c" and "+   9.000" in out[3]
    assert timeline.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == s
    assert timeline.main([str(tmp_path / "nothing")]) == 1


def test_missing_events_count_only_where_present() -> None:
    ms = MS
    reqs = {"x": {"a": 0, "b": 3 * ms}, "y": {"a": 0, "c": 5 * ms}, "z": {"a": 0, "b": 1 * ms, "c": 9 * ms}}
    s = timeline.summarize(reqs)
    by = {e["event"]: e for e in s["events"]}
    assert by["b"]["requests"] == 2 and by["b"]["at_ms"] == 2.0
    assert by["c"]["requests"] == 2 and by["c"]["at_ms"] == 7.0
    # c after b: only "z" has both.
    assert (by["c"]["gap_from"], by["c"]["gap_ms"]) == ("b", 8.0)
