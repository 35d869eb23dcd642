"""The connector's outcome matching, without servers: an outcome ends the attempt it was reported for.

The router retries a request under the same transfer id with the next attempt number; on D the retry is
a new vLLM request while the old one is still held (aborted, its blocks not yet released). An outcome of
the old attempt must end the old request and never the new one: taking a stale "ended" or "received" as
the new attempt's would let D decode blocks that nothing wrote (issue 16, window 6).
"""

from __future__ import annotations

import pytest

outcomes = pytest.importorskip("kvpush._outcomes", reason="the kvpush package (maturin develop)")

TID = "0123456789abcdef0123456789abcdef"


def test_stale_attempt_outcome_does_not_complete_the_retry() -> None:
    m = outcomes.OutcomeMatcher()
    m.expect(TID, 1, "req-old", "d")
    m.expect(TID, 2, "req-new", "d")  # the router's retry, registered before attempt 1 ended
    # Attempt 1's outcome arrives after the retry was registered: it ends the old request only.
    assert m.take(TID, 1) == ("req-old", "d")
    # The retry is still waiting for its own outcome, and only that one ends it.
    assert len(m) == 1
    assert m.take(TID, 1) is None
    assert m.take(TID, 2) == ("req-new", "d")
    assert len(m) == 0


def test_outcome_of_an_attempt_never_handed_over_is_ignored() -> None:
    m = outcomes.OutcomeMatcher()
    m.expect(TID, 2, "req-new", "d")
    # An outcome of attempt 1, which this worker never handed to the engine (say, it went to another
    # D), must not end attempt 2.
    assert m.take(TID, 1) is None
    assert m.take(TID, 3) is None
    assert m.take(TID, 2) == ("req-new", "d")


def test_producer_and_consumer_roles_are_kept_per_attempt() -> None:
    m = outcomes.OutcomeMatcher()
    m.expect(TID, 1, "p-req", "p")
    m.expect(TID, 2, "p-req-retry", "p")
    assert m.take(TID, 2) == ("p-req-retry", "p")
    assert m.take(TID, 1) == ("p-req", "p")
