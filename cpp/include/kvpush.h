/*
 * kvpush.h — the C API of kvpush: push-mode KV-cache transfer between a prefill engine (producer, P)
 * and a decode engine (consumer, D).
 *
 * Link with libkvpush.so (target/<profile>/libkvpush.so). docs/ffi.md explains the API, ownership,
 * threading, and has a complete example.
 *
 * Conventions
 *   - Every function returns an int status (kvpush_status): KVPUSH_OK (0) or an error code. After an
 *     error, kvpush_last_error() returns a message with context (which call, which request, which
 *     field); it is thread-local and valid until the next kvpush call on the same thread.
 *   - Handles (kvpush_engine *, kvpush_hub *) are opaque. A null, destroyed or made-up handle is
 *     answered with KVPUSH_ERR_UNKNOWN_HANDLE (or KVPUSH_ERR_NULL), never a crash.
 *   - Strings are UTF-8, NUL-terminated. Arrays are a pointer plus a count; a pointer may be NULL
 *     only when its count is 0. kvpush copies what it needs before returning: no argument is
 *     retained after a call returns.
 *   - Every function may be called from any thread, concurrently, including on the same engine.
 *   - No Rust panic ever crosses into C: one is caught and reported as KVPUSH_ERR_PANIC.
 */
#ifndef KVPUSH_H
#define KVPUSH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this ABI; compare with kvpush_abi_version() at run time. */
#define KVPUSH_ABI_VERSION 1u
/* Bytes of kvpush_completion.message, NUL included. */
#define KVPUSH_MESSAGE_LEN 256

typedef enum kvpush_status {
  KVPUSH_OK = 0,
  KVPUSH_ERR_NULL = 1,              /* a required pointer argument is NULL */
  KVPUSH_ERR_INVALID_ARGUMENT = 2,  /* zero length, invalid UTF-8, unknown enum value, ... */
  KVPUSH_ERR_UNKNOWN_HANDLE = 3,    /* never created, or already destroyed */
  KVPUSH_ERR_LAYOUT = 4,            /* the KV layout is invalid or does not fit the memory given */
  KVPUSH_ERR_DEVICE = 5,            /* memory is not of the device, or the device is unavailable */
  KVPUSH_ERR_TRANSPORT = 6,         /* a transport call failed (or NIXL is missing) */
  KVPUSH_ERR_INCOMPATIBLE = 7,      /* the peer's handshake is incompatible (every field named) */
  KVPUSH_ERR_BLOCKS = 8,            /* a block list does not fit the layout */
  KVPUSH_ERR_WRONG_MODE = 9,        /* the call does not fit the engine's mode (push / pull) */
  KVPUSH_ERR_SIDE_CHANNEL = 10,     /* listen, connect or side-channel handshake failed */
  KVPUSH_ERR_DECODE = 11,           /* bytes from a peer could not be decoded */
  KVPUSH_ERR_BUFFER_TOO_SMALL = 12, /* the needed size was written to *len */
  KVPUSH_ERR_CLOSED = 13,           /* the engine has shut down */
  KVPUSH_ERR_PANIC = 14,            /* internal error, caught at the boundary */
  KVPUSH_ERR_UNFENCED = 15          /* destroy: destroyed, but the memory may still be touched */
} kvpush_status;

typedef enum kvpush_mode { KVPUSH_MODE_PUSH = 0, KVPUSH_MODE_PULL = 1 } kvpush_mode;

typedef enum kvpush_transport {
  KVPUSH_TRANSPORT_LOOPBACK = 0, /* in-process; engines share a kvpush_hub */
  KVPUSH_TRANSPORT_NIXL = 1      /* NIXL (UCX / LIBFABRIC) plus a TCP side channel */
} kvpush_transport;

typedef enum kvpush_dtype {
  KVPUSH_DTYPE_F16 = 0,
  KVPUSH_DTYPE_BF16 = 1,
  KVPUSH_DTYPE_F32 = 2,
  KVPUSH_DTYPE_F8E4M3 = 3,
  KVPUSH_DTYPE_F8E5M2 = 4,
  KVPUSH_DTYPE_U8 = 5
} kvpush_dtype;

typedef enum kvpush_kv_kind {
  KVPUSH_KV_KEY_VALUE = 0, /* K and V, split over TP ranks by KV head */
  KVPUSH_KV_LATENT = 1     /* one latent part per token (MLA), replicated */
} kvpush_kv_kind;

typedef enum kvpush_block_order {
  KVPUSH_ORDER_HND = 0, /* [heads, tokens, head_dim] within a block part */
  KVPUSH_ORDER_NHD = 1  /* [tokens, heads, head_dim] */
} kvpush_block_order;

typedef enum kvpush_placement {
  KVPUSH_PLACEMENT_SEPARATE = 0, /* K and V in two regions per layer */
  KVPUSH_PLACEMENT_JOINT = 1,    /* one region per layer; each block holds K then V */
  KVPUSH_PLACEMENT_SINGLE = 2,   /* one region per layer, one part (latent only) */
  KVPUSH_PLACEMENT_HEAD_JOINT = 3, /* one region per layer; each head holds K then V (HND only) */
  KVPUSH_PLACEMENT_CELL_JOINT = 4 /* one region per layer; each (head, token) cell holds K then V */
} kvpush_placement;

typedef enum kvpush_outcome {
  KVPUSH_OUTCOME_SENT = 0,     /* producer: the blocks may be freed (see release) */
  KVPUSH_OUTCOME_RECEIVED = 1, /* consumer: every part landed; the request may decode */
  KVPUSH_OUTCOME_FAILED = 2,   /* consumer: the KV will not arrive; its registered blocks are invalid */
  KVPUSH_OUTCOME_ENDED = 3,    /* consumer: ended without data (aborted or superseded) */
  KVPUSH_OUTCOME_QUARANTINED = 4, /* consumer: failed or ended, but the blocks stay out of use until RELEASED */
  KVPUSH_OUTCOME_RELEASED = 5  /* consumer: the blocks of a QUARANTINED request may be reused */
} kvpush_outcome;

typedef enum kvpush_release {
  KVPUSH_RELEASE_NONE = 0, /* not a producer outcome */
  KVPUSH_RELEASE_SENT = 1,
  KVPUSH_RELEASE_FAILED = 2,
  KVPUSH_RELEASE_LEASE_EXPIRED = 3,
  KVPUSH_RELEASE_ABORTED = 4,
  KVPUSH_RELEASE_SUPERSEDED = 5,
  KVPUSH_RELEASE_STALE = 6,
  KVPUSH_RELEASE_DUPLICATE = 7,
  KVPUSH_RELEASE_REFUSED = 8
} kvpush_release;

typedef struct kvpush_engine kvpush_engine;
typedef struct kvpush_hub kvpush_hub;

/* (transfer_id, attempt): the router mints a 128-bit transfer id per request for both legs. */
typedef struct kvpush_key {
  uint64_t id_hi;
  uint64_t id_lo;
  uint32_t attempt;
} kvpush_key;

/* Block ids of one KV cache group. */
typedef struct kvpush_block_list {
  const uint32_t *ids;
  size_t len;
} kvpush_block_list;

/* A KV cache group: layers sharing one block table. */
typedef struct kvpush_kv_group {
  uint32_t window_tokens; /* 0: full attention; N: sliding window of N tokens */
  const uint32_t *layers; /* global layer indices, strictly increasing */
  size_t num_layers;
} kvpush_kv_group;

/* One worker's KV cache in memory. Fill with kvpush_layout_init() first. Enum fields hold the values
 * of the enums named in their comments (unknown values are KVPUSH_ERR_LAYOUT). */
typedef struct kvpush_layout {
  uint32_t total_layers; /* layers of the whole model (all PP ranks) */
  uint32_t kv_heads;     /* KV heads of the whole model (1 for latent) */
  uint32_t head_dim;     /* elements per head */
  uint32_t dtype;        /* kvpush_dtype */
  uint32_t kv_kind;      /* kvpush_kv_kind */
  uint32_t block_tokens; /* tokens per block */
  uint32_t num_blocks;   /* blocks in every region */
  uint32_t order;        /* kvpush_block_order */
  uint32_t placement;    /* kvpush_placement */
  uint16_t tp_rank, tp_size, pp_rank, pp_size;
  uint64_t block_stride; /* bytes from one block to the next; 0: the bytes a block holds */
  const kvpush_kv_group *groups; /* NULL with 0: one full-attention group with every layer */
  size_t num_groups;
  /* Region base addresses: for each local layer, K then V (separate) or one (joint, single). */
  const uint64_t *region_bases;
  size_t num_regions;
  /* Optional (NULL): bytes available at each base, checked to hold num_blocks * block_stride. */
  const uint64_t *region_lens;
} kvpush_layout;

/* An engine worker's configuration. Fill with kvpush_engine_config_init() first. Optional strings
 * that are NULL or "" take the default. */
typedef struct kvpush_engine_config {
  const char *engine_id; /* required: the engine's id, shared by its workers */
  uint32_t mode;         /* kvpush_mode */
  uint32_t transport;    /* kvpush_transport */
  kvpush_hub *hub;       /* loopback: required; NIXL: NULL */
  const char *device;    /* "host", "mock", "cuda", "neuron", "auto"; NULL: $KVPUSH_DEVICE or auto */
  uint32_t writers;      /* writer threads (0: 1) */
  uint64_t lease_ms;     /* producer lease (0: 30 s) */
  uint64_t timeout_ms;   /* consumer timeout (0: 120 s) */
  const char *agent_name;   /* NIXL agent name; default "<engine_id>/<tp_rank>.<pp_rank>" */
  const char *nixl_backend; /* NIXL backend plugin; default "UCX" ("LIBFABRIC" for EFA) */
  const char *listen;       /* side channel; default "0.0.0.0:<5600 + tp_rank>"; port 0: any */
  const char *secret;       /* side-channel shared secret (docs/security.md); NULL: $KVPUSH_SECRET;
                               "" is an error; none at all refuses a non-loopback listen address
                               unless $KVPUSH_INSECURE=1 */
} kvpush_engine_config;

/* One finished result, from kvpush_poll. */
typedef struct kvpush_completion {
  kvpush_key key;
  uint32_t outcome; /* kvpush_outcome */
  uint32_t release; /* kvpush_release (KVPUSH_OUTCOME_SENT), else 0 */
  char message[KVPUSH_MESSAGE_LEN]; /* failure or release reason; NUL-terminated, truncated */
} kvpush_completion;

/* Counters of an engine. The same struct as Counters in src/engine/stats.rs (#[repr(C)], all
 * uint64_t): a new counter is added there and here, in the same place; tests/ffi_c.rs checks that
 * every field's name and offset agree. */
typedef struct kvpush_counters {
  uint64_t registrations;        /* sent (consumer) or received (producer) */
  uint64_t matches;              /* transfers matched by the rendezvous */
  uint64_t posts;                /* transfers posted */
  uint64_t descriptors_unmerged; /* copies before merging */
  uint64_t descriptors_posted;   /* descriptors posted */
  uint64_t bytes;                /* bytes posted */
  uint64_t released;             /* producer: requests whose blocks were released */
  uint64_t received;             /* consumer: requests received */
  uint64_t failed;               /* consumer: requests failed */
  uint64_t aborted;              /* aborts handled */
  uint64_t quarantined;          /* consumer: ends reported while the blocks stayed quarantined */
} kvpush_counters;

/* Failures by kind. The same struct as Failures in src/engine/stats.rs (as kvpush_counters). */
typedef struct kvpush_failures {
  uint64_t post;          /* posting a transfer failed */
  uint64_t transfer;      /* a posted transfer failed */
  uint64_t plan;          /* planning failed */
  uint64_t lease_expired; /* producer: leases or registration waits that ran out */
  uint64_t timeout;       /* consumer: requests that timed out waiting for their parts */
  uint64_t remote;        /* consumer: failure notifications received from a peer */
  uint64_t malformed;     /* frames that could not be decoded or were out of range */
  uint64_t unknown_peer;  /* frames or transfers concerning unknown peers */
  uint64_t link;          /* control-link sends that failed */
  uint64_t writer_panic;  /* writer threads that panicked (their requests were failed) */
  uint64_t shutdown_unfenced; /* posted transfers still pending when destroy's fence gave up */
  uint64_t quarantine_expired; /* quarantined blocks released by the time bound */
} kvpush_failures;

/* Percentiles of a latency histogram, in microseconds. */
typedef struct kvpush_latency {
  uint64_t count, p50_us, p90_us, p99_us, max_us;
} kvpush_latency;

/* Everything kvpush_engine_stats reports (C++: kvpush::Stats). */
typedef struct kvpush_stats {
  kvpush_counters counters;
  kvpush_failures failures;
  kvpush_latency wait_registration_first; /* producer: registration waiting for prefill */
  kvpush_latency wait_blocks_first;       /* producer: blocks waiting for the registration */
  kvpush_latency post;                    /* plan + merge + post of one transfer */
  kvpush_latency transfer;                /* post to done */
  kvpush_latency receive;                 /* consumer: registration to received */
} kvpush_stats;

/* ---- Library ------------------------------------------------------------------------------ */

const char *kvpush_version(void);   /* e.g. "0.1.0", static */
uint32_t kvpush_abi_version(void);  /* KVPUSH_ABI_VERSION of the library */
const char *kvpush_last_error(void); /* "" after a successful call; see Conventions */
const char *kvpush_status_name(int status); /* "KVPUSH_ERR_LAYOUT", static */
int kvpush_nixl_available(void);    /* 1 if libnixl_capi.so can be loaded, else 0 */

int kvpush_layout_init(kvpush_layout *layout);
int kvpush_engine_config_init(kvpush_engine_config *config);

/* ---- Hubs (loopback transport) ------------------------------------------------------------- */

/* A hub connects loopback engines of this process (transport and control link). */
int kvpush_hub_create(kvpush_hub **out);
/* Engines created on the hub keep what they need: a hub may be destroyed before them. */
int kvpush_hub_destroy(kvpush_hub *hub);

/* ---- Engines ------------------------------------------------------------------------------- */

/* Creates an engine worker: validates the layout, checks its regions with the device, registers
 * them with the transport and starts the writer threads (NIXL: also the agent and the side-channel
 * listener). Memory contract: every region stays valid until kvpush_engine_destroy returns (where it
 * returned KVPUSH_ERR_UNFENCED: until the peers it names are gone); a
 * producer does not write a request's blocks from kvpush_request_finished until its SENT outcome; a
 * consumer does not read or reuse a request's blocks from kvpush_blocks_allocated /
 * kvpush_start_pull until its outcome (RECEIVED, FAILED or ENDED), or after QUARANTINED until RELEASED. */
int kvpush_engine_create(const kvpush_engine_config *config, const kvpush_layout *layout,
                         kvpush_engine **out);
/* Waits for calls in progress on the engine and stops it: waits up to 5 s for quarantined blocks
 * (QUARANTINED without RELEASED yet) to be released, ends every transfer it posted (cancelled, then
 * waited for up to 5 s), joins its threads and deregisters its memory. The handle is gone in every
 * case. KVPUSH_OK: nothing can touch the memory any more; it may be freed. KVPUSH_ERR_UNFENCED: a
 * transfer did not end, or blocks stayed quarantined for a peer lost without a fence, which may
 * still write into them (NIXL over UCX shared memory / CMA: a peer process that still runs writes
 * into this process whatever was deregistered); kvpush_last_error names the requests. Then keep the
 * regions allocated and their blocks unused until those peers are known to be gone. */
int kvpush_engine_destroy(kvpush_engine *engine);

/* The worker's encoded handshake. With buf NULL or cap too small, only *len is written and
 * KVPUSH_ERR_BUFFER_TOO_SMALL returned. */
int kvpush_engine_handshake(const kvpush_engine *engine, uint8_t *buf, size_t cap, size_t *len);
/* Loopback engines: accept a peer from its handshake bytes (compatibility checked; a refusal names
 * every differing field with both values). NIXL engines handshake over their side channel instead. */
int kvpush_engine_add_peer(kvpush_engine *engine, const uint8_t *handshake, size_t len);
/* Connects two engines of this process both ways: through their common hub (loopback) or by
 * dialing b's side channel (NIXL). */
int kvpush_engine_connect(kvpush_engine *a, kvpush_engine *b);
/* NIXL: dial a peer worker's side channel ("host:port") and handshake both ways. Blocks up to 10 s. */
int kvpush_engine_connect_addr(kvpush_engine *engine, const char *addr);
/* NIXL: the port this worker's side channel listens on. */
int kvpush_engine_listen_port(const kvpush_engine *engine, uint16_t *port);

/* Producer: prefill of `key` finished; its KV is in `groups` (block ids per KV group). */
int kvpush_request_finished(kvpush_engine *engine, kvpush_key key, const kvpush_block_list *groups,
                            size_t num_groups, uint64_t num_tokens);
/* Producer, push mode: layers [first_layer, end_layer) of `key` are final in `groups` (the whole
 * prompt's block ids, the same on every call). The first call holds the blocks until SENT; each range
 * is written into the consumer once its registration is there (layer by layer from 512 tokens, whole
 * below). Call it as the last prefill chunk computes each layer; earlier chunks call nothing. */
int kvpush_layers_ready(kvpush_engine *engine, kvpush_key key, const kvpush_block_list *groups,
                        size_t num_groups, uint64_t num_tokens, uint32_t first_layer, uint32_t end_layer);
/* Producer: as kvpush_request_finished, for consumer engine `consumer` (the decode engine the router
 * chose): only that engine receives the KV (push) or a grant to read it (pull); another engine that
 * registers `key` is refused. NULL or "": the first engine to register (kvpush_request_finished). */
int kvpush_request_finished_for(kvpush_engine *engine, kvpush_key key, const kvpush_block_list *groups,
                                size_t num_groups, uint64_t num_tokens, const char *consumer);
/* Consumer, push mode: blocks for `key` are allocated; registers them with every worker of engine
 * `producer` that writes into this one. RECEIVED or FAILED follows. */
int kvpush_blocks_allocated(kvpush_engine *engine, kvpush_key key, const char *producer,
                            const kvpush_block_list *groups, size_t num_groups, uint64_t num_tokens);
/* Consumer, pull mode: read `key` from engine `producer`'s blocks `remote` into `local`. */
int kvpush_start_pull(kvpush_engine *engine, kvpush_key key, const char *producer,
                      const kvpush_block_list *remote, size_t num_remote,
                      const kvpush_block_list *local, size_t num_local, uint64_t num_tokens);
/* Aborts `key` on this worker in whatever state it is; peers are told; its outcome follows. */
int kvpush_abort(kvpush_engine *engine, kvpush_key key);

/* Moves at most `cap` finished results into `out` and their number into *n; the rest stay queued.
 * Costs one atomic load when there are none: call it from the engine loop every step. */
int kvpush_poll(kvpush_engine *engine, kvpush_completion *out, size_t cap, size_t *n);

int kvpush_engine_stats(const kvpush_engine *engine, kvpush_stats *out);
/* Statistics as JSON, NUL-terminated; *len is the length without the NUL (BUFFER_TOO_SMALL as for
 * kvpush_engine_handshake, with room for the NUL). */
int kvpush_engine_stats_json(const kvpush_engine *engine, char *buf, size_t cap, size_t *len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVPUSH_H */
