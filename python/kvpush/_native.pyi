"""Type stubs of the native module (src/python/mod.rs)."""

from typing import Any, Literal

OutcomeKind = Literal["sent", "received", "failed", "ended", "quarantined", "released"]

class KvpushError(Exception): ...
class ConfigError(KvpushError): ...
class TransportError(KvpushError): ...
class IncompatibleError(KvpushError): ...
class ClosedError(KvpushError): ...

class Worker:
    """One engine worker (one rank) over NIXL and a TCP side channel."""

    def __init__(self, config: dict[str, Any]) -> None: ...
    @property
    def side_channel_port(self) -> int | None: ...
    def request_finished(
        self,
        transfer_id: str,
        attempt: int,
        block_ids: list[list[int]],
        num_tokens: int,
        consumer_engine_id: str | None = None,
    ) -> None: ...
    def layers_ready(
        self,
        transfer_id: str,
        attempt: int,
        block_ids: list[list[int]],
        num_tokens: int,
        first_layer: int,
        end_layer: int,
        consumer_engine_id: str | None = None,
    ) -> None: ...
    def blocks_allocated(
        self,
        transfer_id: str,
        attempt: int,
        producer: str,
        host: str,
        port: int,
        producer_tp: int,
        block_ids: list[list[int]],
        num_tokens: int,
    ) -> None: ...
    def start_pull(
        self,
        transfer_id: str,
        attempt: int,
        producer: str,
        host: str,
        port: int,
        producer_tp: int,
        remote_block_ids: list[list[int]],
        local_block_ids: list[list[int]],
        num_tokens: int,
        producer_pp: int = 1,
        producer_ranks: list[str] = ...,
        remote_block_tokens: int | None = None,
    ) -> None: ...
    def tell_producer(
        self, word: str, transfer_id: str, attempt: int, producer: str, host: str, port: int, producer_tp: int
    ) -> None: ...
    def abort(self, transfer_id: str, attempt: int) -> None: ...
    def poll(self) -> list[tuple[OutcomeKind, str, int, str, list[list[int]]]]: ...
    def wait(self, timeout_s: float) -> bool: ...
    def take_transfers(self) -> list[tuple[int, int, int, int]]: ...
    def stats(self) -> dict[str, Any]: ...

def check_layout(config: dict[str, Any]) -> dict[str, Any]: ...
def nixl_available() -> bool: ...
def version() -> str: ...
def init_logging() -> None: ...
