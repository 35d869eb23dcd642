"""Which request an outcome of the native engine belongs to: the connector's worker half records each
transfer it hands to the engine and looks every outcome of ``Worker.poll()`` up here.

Pure Python with no vLLM import, so it is tested without servers (tests/python/test_connector_outcomes.py,
tests/python/test_connector_quarantine.py). It never decides anything about a transfer: it maps an
outcome back to the vLLM request id and the role (``"p"`` producer, ``"d"`` consumer) it was handed to
the engine with, and keeps the requests whose blocks the engine quarantined until it releases them.
"""

from __future__ import annotations


class OutcomeMatcher:
    """Transfers handed to the engine, until their outcome comes back (and, quarantined, until their
    blocks are released)."""

    def __init__(self) -> None:
        # (transfer id, attempt) -> (req_id, role). The attempt is part of the key: the router retries
        # under the same transfer id, and an older attempt's outcome (an abort's "ended", a late
        # "received") must end that attempt's request, never complete the retry's.
        self._by_transfer: dict[tuple[str, int], tuple[str, str]] = {}
        # Ended with "quarantined": the request's end is reported, its blocks are not, until the
        # engine's "released" for the same attempt (docs/reliability.md).
        self._quarantined: dict[tuple[str, int], tuple[str, str]] = {}

    def expect(self, transfer_id: str, attempt: int, req_id: str, role: str) -> None:
        """``req_id`` handed transfer ``transfer_id`` (attempt ``attempt``) to the engine as ``role``."""
        self._by_transfer[(transfer_id, int(attempt))] = (req_id, role)

    def take(self, transfer_id: str, attempt: int) -> tuple[str, str] | None:
        """The request and role an outcome of ``transfer_id`` (attempt ``attempt``) ends, forgotten
        from now on; ``None`` for a transfer this worker does not wait for."""
        return self._by_transfer.pop((transfer_id, int(attempt)), None)

    def quarantine(self, transfer_id: str, attempt: int, owner: tuple[str, str]) -> None:
        """The outcome of ``transfer_id`` (attempt ``attempt``), taken for ``owner``, was
        "quarantined": its blocks stay out of use until :meth:`release`."""
        self._quarantined[(transfer_id, int(attempt))] = owner

    def release(self, transfer_id: str, attempt: int) -> tuple[str, str] | None:
        """The request and role whose quarantined blocks the engine's "released" for ``transfer_id``
        (attempt ``attempt``) gives back; ``None`` for one this worker does not hold."""
        return self._quarantined.pop((transfer_id, int(attempt)), None)

    def expects(self, role: str) -> bool:
        """Whether some transfer handed to the engine as ``role`` has no outcome yet."""
        return any(r == role for _, r in self._by_transfer.values())

    @property
    def quarantined(self) -> int:
        """Requests whose blocks are held for a quarantine now."""
        return len(self._quarantined)

    def __len__(self) -> int:
        return len(self._by_transfer)
