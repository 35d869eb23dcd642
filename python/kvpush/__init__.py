"""kvpush: push-mode KV-cache transfer for disaggregated LLM serving.

The engine is native (Rust, `kvpush._native`); this package is its typed face. vLLM loads the connector
with ``--kv-transfer-config '{"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.vllm",
...}'`` (see docs/vllm.md). Errors raised by the engine derive from :class:`KvpushError`.
"""

from kvpush._native import (
    ClosedError,
    ConfigError,
    IncompatibleError,
    KvpushError,
    TransportError,
    Worker,
    check_layout,
    init_logging,
    nixl_available,
    version,
)

__all__ = [
    "ClosedError",
    "ConfigError",
    "IncompatibleError",
    "KvpushError",
    "TransportError",
    "Worker",
    "check_layout",
    "init_logging",
    "nixl_available",
    "version",
]
__version__ = version()
