"""What a request's ``kv_transfer_params`` say about its transfer, read without ever raising.

The connector's scheduler half runs inside vLLM's scheduler, where an exception stops the whole server.
``kv_transfer_params`` come from whatever sits in front of vLLM — kvpush router, vLLM's own toy proxy,
llm-d, a client — so every value is checked here and a bad one becomes a :class:`Refused` with the reason,
never an exception: D then prefills the request itself, P releases its blocks at once.

Transfer ids: kvpush router mints 32 hex digits; other routers send UUIDs or any string, and vLLM's own
proxies send none (P's vLLM request id names the transfer, and D learns it from P's answer as
``remote_request_id``). The engine keys a transfer by 128 bits (``Key`` in src/proto), so
:func:`transfer_key` maps any id to 32 hex digits: 32 hex digits stand for themselves (kvpush router's
ids reach the engine unchanged), anything else is hashed with BLAKE2b-128 (keyed by a fixed
personalisation string), the same on P and D since both run this function on the same string.

Pure Python with no vLLM import: tests/python/test_connector_params.py tests it without servers.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_HEX32 = re.compile(r"^[0-9a-fA-F]{32}$")
_PERSON = b"kvpush.transfer"
_PROMPT_PERSON = b"kvpush.prompt"
U32_MAX = 2**32 - 1
MAX_ENGINE_ID = 256  # bytes of an engine id (MAX_ENGINE_ID in src/proto/msg.rs)


def transfer_key(transfer_id: str) -> str:
    """The engine's 32-hex key of ``transfer_id``: itself (lower case) when it is 32 hex digits, else
    its BLAKE2b-128 digest. Deterministic across processes and machines (never Python's ``hash``)."""
    if _HEX32.match(transfer_id):
        return transfer_id.lower()
    data = transfer_id.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16, person=_PERSON).hexdigest()


def prompt_digest(token_ids: Sequence[int]) -> str | None:
    """BLAKE2b-128 of a prompt's token ids (each a little-endian u64), 32 hex digits, or None for ids
    that are not u64: P sends it with the prompt's KV (``remote_prompt_digest``) and D checks that its
    prompt begins with those tokens before it loads their KV into its own request."""
    try:
        ids = array("Q", token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16, person=_PROMPT_PERSON).hexdigest()


@dataclass(frozen=True)
class Transfer:
    """A transfer as both sides name it."""

    transfer_id: str  # as the router (or P) named it: what P hands back to D
    key: str  # transfer_key(transfer_id): what the engine is given
    attempt: int
    # P only: the decode engine the router chose (``consumer_engine_id``); only it receives the KV.
    # None: the first engine to register the transfer does.
    consumer_engine_id: str | None = None


@dataclass(frozen=True)
class Producer:
    """Where D finds its producer, from D's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    remote_block_ids: list[list[int]] | None  # pull only: P's blocks, per KV cache group
    pp_size: int = 1
    # Pull only: the tokens per block of ``remote_block_ids`` (P's vLLM block size,
    # ``remote_block_size``), from which D's engine finds P's kernel blocks. None: P did not say (a
    # producer from before kernel blocks could be pulled): the ids are taken as P's engine blocks,
    # and P's grant refuses the read, naming the missing field, if they are not.
    remote_block_size: int | None = None
    # Each of P's ranks' side-channel ``host:port``, indexed ``pp_rank * tp_size + tp_rank``, as P
    # published them (``remote_ranks``); empty: rank ``r`` listens on ``host:port + r``.
    ranks: tuple[str, ...] = ()
    # Pull only: how many prompt tokens P computed (``remote_num_tokens``) and their digest
    # (``remote_prompt_digest``, :func:`prompt_digest`). D's prompt may be longer (a router's
    # continuation: P's prompt plus the token P sampled); D loads only these. None: P did not say.
    prompt_tokens: int | None = None
    prompt_digest: str | None = None


@dataclass(frozen=True)
class Refused:
    """The params cannot be used; ``reason`` says why, for the log."""

    reason: str


class _Bad(Exception):
    """A value that fails its check (internal: turned into ``Refused`` before it leaves this module)."""


def _present(params: dict[str, Any], key: str) -> Any:
    """The value of ``key``, or None when it is absent or null (vLLM's toy proxy sends nulls)."""
    return params.get(key)


def _int(params: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = _present(params, key)
    if v is None:
        if default is None:
            raise _Bad(f"{key} is missing")
        return default
    # bool is an int in Python; a flag is never a count.
    if isinstance(v, bool):
        raise _Bad(f"{key} is {v!r}, not an integer")
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    if not isinstance(v, int):
        raise _Bad(f"{key} is {v!r}, not an integer")
    if not lo <= v <= hi:
        raise _Bad(f"{key} is {v}, outside {lo}..{hi}")
    return v


def _str(params: dict[str, Any], key: str) -> str:
    v = _present(params, key)
    if v is None:
        raise _Bad(f"{key} is missing")
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _Bad(f"{key} is {type(v).__name__} {v!r:.80}, not a string")
    s = str(v)
    if not s.strip():
        raise _Bad(f"{key} is empty")
    return s


def _transfer_id(params: dict[str, Any], fallback_key: str | None, fallback: str | None) -> str:
    """``transfer_id`` if present, else ``params[fallback_key]``, else ``fallback``."""
    if _present(params, "transfer_id") is not None:
        return _str(params, "transfer_id")
    if fallback_key is not None and _present(params, fallback_key) is not None:
        return _str(params, fallback_key)
    if fallback is not None:
        return fallback
    raise _Bad(f"neither transfer_id nor {fallback_key} is given: nothing names the producer's transfer")


def _block_ids(params: dict[str, Any], key: str) -> list[list[int]]:
    """Block ids per KV cache group; a flat list of ints is one group (vLLM without the hybrid allocator)."""
    v = _present(params, key)
    if not isinstance(v, (list, tuple)) or not v:
        raise _Bad(f"{key} is {v!r:.80}, not a non-empty list")
    groups = list(v) if all(isinstance(g, (list, tuple)) for g in v) else [v]
    out = []
    for g in groups:
        if not isinstance(g, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= U32_MAX for b in g
        ):
            raise _Bad(f"{key} has {g!r:.80}, not a list of block ids")
        out.append([int(b) for b in g])
    if not any(out):
        raise _Bad(f"{key} holds no block")
    return out


def _ranks(params: dict[str, Any], tp: int, pp: int) -> tuple[str, ...]:
    """``remote_ranks``: one ``host:port`` per producer rank (``pp_rank * tp + tp_rank``), or ()."""
    v = _present(params, "remote_ranks")
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) != tp * pp:
        raise _Bad(f"remote_ranks is {v!r:.80}, not a list of {tp * pp} host:port (TP {tp} × PP {pp})")
    out = []
    for a in v:
        host, sep, port = a.rpartition(":") if isinstance(a, str) else ("", "", "")
        if not sep or not host.strip() or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _Bad(f"remote_ranks has {a!r:.80}, not host:port")
        out.append(a)
    return tuple(out)


def _remote_block_size(params: dict[str, Any]) -> int | None:
    """``remote_block_size``: the tokens per block of ``remote_block_ids`` (P's vLLM block size), or
    None when P did not send it."""
    if _present(params, "remote_block_size") is None:
        return None
    return _int(params, "remote_block_size", 1, U32_MAX)


def _prompt_digest(params: dict[str, Any]) -> str | None:
    """``remote_prompt_digest``: 32 hex digits, or None when P did not send it."""
    if _present(params, "remote_prompt_digest") is None:
        return None
    v = params["remote_prompt_digest"]
    if not isinstance(v, str) or not _HEX32.match(v):
        raise _Bad(f"remote_prompt_digest is {v!r:.80}, not 32 hex digits")
    return v.lower()


def _attempt(params: dict[str, Any]) -> int:
    return _int(params, "attempt", 1, U32_MAX, default=1)


def _consumer_engine_id(params: dict[str, Any]) -> str | None:
    """``consumer_engine_id`` (the decode engine the router chose), or None when absent or null.

    A malformed one refuses the transfer rather than falling back to "first engine to register": the
    router meant to bind the KV to one engine, and a request that cannot say which is not sent."""
    if _present(params, "consumer_engine_id") is None:
        return None
    v = params["consumer_engine_id"]
    if not isinstance(v, str):
        raise _Bad(f"consumer_engine_id is {type(v).__name__} {v!r:.80}, not a string")
    if not v.strip():
        raise _Bad("consumer_engine_id is empty")
    try:
        n = len(v.encode("utf-8"))
    except UnicodeEncodeError:
        raise _Bad(f"consumer_engine_id {v!r:.80} is not valid UTF-8") from None
    if n > MAX_ENGINE_ID:
        raise _Bad(f"consumer_engine_id is {n} bytes, over {MAX_ENGINE_ID}")
    return v


def is_producer(params: Any) -> bool:
    """Whether the params ask this server to prefill for a remote decode (P's role)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def is_consumer(params: Any) -> bool:
    """Whether the params ask this server to take its prompt's KV from a producer (D's role)."""
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def producer_transfer(params: Any, request_id: str) -> Transfer | Refused:
    """P: the transfer of a request whose params carry ``do_remote_decode``.

    Without a ``transfer_id`` the transfer is named after the vLLM request id (vLLM's proxies send
    none; P hands the id back to D in its ``kv_transfer_params``). ``consumer_engine_id`` (optional)
    binds the transfer to that decode engine."""
    if not isinstance(params, dict):
        return Refused(f"kv_transfer_params is {type(params).__name__}, not an object")
    try:
        tid = _transfer_id(params, None, request_id)
        return Transfer(tid, transfer_key(tid), _attempt(params), _consumer_engine_id(params))
    except _Bad as e:
        return Refused(str(e))


def consumer_transfer(params: Any, mode: str) -> tuple[Transfer, Producer] | Refused:
    """D: the transfer and producer of a request whose params carry ``do_remote_prefill``.

    The transfer is ``transfer_id``, else ``remote_request_id`` (vLLM's convention: P's request id,
    which P named the transfer after when no id came). ``mode`` ``pull`` needs ``remote_block_ids``."""
    if not isinstance(params, dict):
        return Refused(f"kv_transfer_params is {type(params).__name__}, not an object")
    try:
        tid = _transfer_id(params, "remote_request_id", None)
        transfer = Transfer(tid, transfer_key(tid), _attempt(params))
        tp, pp = _int(params, "tp_size", 1, 65535, default=1), _int(params, "pp_size", 1, 65535, default=1)
        producer = Producer(
            engine_id=_str(params, "remote_engine_id"),
            host=_str(params, "remote_host"),
            port=_int(params, "remote_port", 1, 65535),
            tp_size=tp,
            remote_block_ids=_block_ids(params, "remote_block_ids") if mode == "pull" else None,
            pp_size=pp,
            ranks=_ranks(params, tp, pp),
            remote_block_size=_remote_block_size(params) if mode == "pull" else None,
            prompt_tokens=(
                _int(params, "remote_num_tokens", 1, U32_MAX)
                if mode == "pull" and _present(params, "remote_num_tokens") is not None
                else None
            ),
            prompt_digest=_prompt_digest(params) if mode == "pull" else None,
        )
        return transfer, producer
    except _Bad as e:
        return Refused(str(e))
