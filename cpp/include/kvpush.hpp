// kvpush.hpp — the C++ API of kvpush (C++17): RAII classes over the Rust engine, through cxx.
//
// Link with libkvpush_cxx.a (the cxx bridge, these classes and cxx's runtime; built by cargo next to
// libkvpush.so) and libkvpush.so, in that order. docs/ffi.md explains the API, ownership and
// threading, with a complete example.
//
// Every failure is a kvpush::Error (a std::runtime_error) whose status() is the same code the C API
// returns and whose what() names the call and the cause. No Rust panic ever reaches C++: one is
// caught and thrown as Status::Panic. Objects are move-only; a moved-from object throws
// Status::UnknownHandle on use. All methods of one Engine may be called from any thread,
// concurrently.
#ifndef KVPUSH_HPP
#define KVPUSH_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvpush.h"

namespace kvpush {

// Status codes; the same values as kvpush_status in kvpush.h.
enum class Status : int {
  Ok = 0,
  Null = 1,
  InvalidArgument = 2,
  UnknownHandle = 3,
  Layout = 4,
  Device = 5,
  Transport = 6,
  Incompatible = 7,
  Blocks = 8,
  WrongMode = 9,
  SideChannel = 10,
  Decode = 11,
  BufferTooSmall = 12,
  Closed = 13,
  Panic = 14,
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string &what) : std::runtime_error(what), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

enum class Mode : std::uint32_t { Push = 0, Pull = 1 };
enum class DType : std::uint32_t { F16 = 0, BF16 = 1, F32 = 2, F8E4M3 = 3, F8E5M2 = 4, U8 = 5 };
enum class KvKind : std::uint32_t { KeyValue = 0, Latent = 1 };
enum class BlockOrder : std::uint32_t { HND = 0, NHD = 1 };
enum class Placement : std::uint32_t { Separate = 0, Joint = 1, Single = 2, HeadJoint = 3, CellJoint = 4 };

// What a Completion reports: producer Sent; consumer Received, Failed, Ended, or Quarantined (failed
// or ended, but the blocks stay out of use until Released for the same request).
enum class Outcome : std::uint32_t { Sent = 0, Received = 1, Failed = 2, Ended = 3, Quarantined = 4, Released = 5 };
// Why a producer released its blocks (Outcome::Sent); None otherwise.
enum class Release : std::uint32_t {
  None = 0,
  Sent = 1,
  Failed = 2,
  LeaseExpired = 3,
  Aborted = 4,
  Superseded = 5,
  Stale = 6,
  Duplicate = 7,
  Refused = 8,
};

// (transfer_id, attempt): the router mints a 128-bit transfer id per request for both legs.
struct Key {
  std::uint64_t id_hi = 0;
  std::uint64_t id_lo = 0;
  std::uint32_t attempt = 0;
};

// A KV cache group: layers sharing one block table. window_tokens 0: full attention.
struct KvGroup {
  std::uint32_t window_tokens = 0;
  std::vector<std::uint32_t> layers;
};

// One worker's KV cache in memory (see kvpush_layout in kvpush.h for each field).
struct Layout {
  std::uint32_t total_layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  DType dtype = DType::BF16;
  KvKind kv_kind = KvKind::KeyValue;
  std::uint32_t block_tokens = 0;
  std::uint32_t num_blocks = 0;
  BlockOrder order = BlockOrder::HND;
  Placement placement = Placement::Separate;
  std::uint16_t tp_rank = 0, tp_size = 1, pp_rank = 0, pp_size = 1;
  std::uint64_t block_stride = 0;           // 0: the bytes a block holds
  std::vector<KvGroup> groups;              // empty: one full-attention group with every layer
  std::vector<std::uint64_t> region_bases;  // per local layer: K then V (separate), or one
  std::vector<std::uint64_t> region_lens;   // optional: bytes at each base, checked
};

// An engine worker's configuration; empty strings take the default.
struct EngineConfig {
  std::string engine_id;  // required
  Mode mode = Mode::Push;
  std::string device;  // "host", "mock", "cuda", "neuron", "auto"; empty: $KVPUSH_DEVICE or auto
  std::uint32_t writers = 1;
  std::uint64_t lease_ms = 0;    // 0: 30 s
  std::uint64_t timeout_ms = 0;  // 0: 120 s
  // NIXL engines only.
  std::string agent_name;    // default "<engine_id>/<tp_rank>.<pp_rank>"
  std::string nixl_backend;  // default "UCX"
  std::string listen;        // side channel, default "0.0.0.0:<5600 + tp_rank>"; port 0: any
  std::string secret;        // side-channel shared secret (docs/security.md); empty: $KVPUSH_SECRET,
                             // and with none a non-loopback listen address refuses to start unless
                             // $KVPUSH_INSECURE=1
};

// Block ids per KV group.
using BlockLists = std::vector<std::vector<std::uint32_t>>;

struct Completion {
  Key key;
  Outcome outcome = Outcome::Sent;
  Release release = Release::None;
  std::string message;  // failure or release reason
};

// Counters, failures and latency percentiles of an engine: the C struct itself (kvpush.h), so a
// field added there is here too. stats().counters.bytes, stats().failures.timeout, stats().receive.p99_us.
using Stats = ::kvpush_stats;

class Engine;

// Connects loopback engines of this process (in-process transport and control link). Engines keep
// what they need of it: a Hub may be destroyed before its engines.
class Hub {
 public:
  Hub();
  ~Hub();
  Hub(Hub &&) noexcept;
  Hub &operator=(Hub &&) noexcept;
  Hub(const Hub &) = delete;
  Hub &operator=(const Hub &) = delete;

 private:
  friend class Engine;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One engine worker (a producer, a consumer, or both). Destroying it stops it as
// kvpush_engine_destroy does (up to 5 s for quarantined blocks, up to 5 s for its own transfers,
// then its threads joined and its memory deregistered), but a destructor cannot report: what it
// could not fence (KVPUSH_ERR_UNFENCED in C) is logged at error level only. A caller that may have
// blocks quarantined (an Outcome::Quarantined without its Outcome::Released) when it destroys the
// Engine keeps the regions allocated until the lost peer is known to be gone.
//
// Memory contract (as kvpush_engine_create): every region of the layout stays valid until the
// Engine is destroyed; a producer does not write a request's blocks from request_finished until its
// Outcome::Sent; a consumer does not read or reuse a request's blocks from blocks_allocated /
// start_pull until its outcome.
class Engine {
 public:
  // A loopback engine on `hub`.
  Engine(const EngineConfig &config, const Layout &layout, const Hub &hub);
  // A NIXL engine with a TCP side channel (config.listen, config.secret).
  static Engine nixl(const EngineConfig &config, const Layout &layout);
  ~Engine();
  Engine(Engine &&) noexcept;
  Engine &operator=(Engine &&) noexcept;
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;

  // This worker's encoded handshake, and accepting a peer from its handshake (loopback engines).
  std::vector<std::uint8_t> handshake() const;
  void add_peer(const std::vector<std::uint8_t> &handshake);
  // Connects two engines of this process both ways (same Hub, or both NIXL).
  void connect(Engine &other);
  // NIXL: dial a peer worker's side channel ("host:port"); blocks up to 10 s.
  void connect(const std::string &addr);
  // NIXL: the side channel's port.
  std::uint16_t listen_port() const;

  // Producer: prefill of `key` finished; its KV is in `blocks`.
  void request_finished(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens);
  // Producer, push mode: layers [first_layer, end_layer) of `key` are final in `blocks` (the whole
  // prompt's blocks, the same on every call; the first call holds them until Sent). Each range is
  // written into the consumer once its registration is there (layer by layer from 512 tokens, whole
  // below). Call it as the last prefill chunk computes each layer.
  void layers_ready(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens, std::uint32_t first_layer,
                    std::uint32_t end_layer);
  // Producer: as above, for consumer engine `consumer` (the decode engine the router chose): only
  // that engine receives the KV or a grant to read it; another engine's registration is refused.
  // "": the first engine to register.
  void request_finished(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens,
                        const std::string &consumer);
  // Consumer, push mode: blocks for `key` are allocated; registers them with engine `producer`.
  void blocks_allocated(const Key &key, const std::string &producer, const BlockLists &blocks,
                        std::uint64_t num_tokens);
  // Consumer, pull mode: read `key` from `producer`'s blocks `remote` into `local`.
  void start_pull(const Key &key, const std::string &producer, const BlockLists &remote,
                  const BlockLists &local, std::uint64_t num_tokens);
  // Aborts `key` on this worker; peers are told; its outcome follows.
  void abort(const Key &key);
  // Appends at most `max` finished results to `out`; returns how many. Cheap when there are none.
  std::size_t poll(std::vector<Completion> &out, std::size_t max = 1024);

  Stats stats() const;
  std::string stats_json() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  const Impl &impl() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvpush

#endif  // KVPUSH_HPP
