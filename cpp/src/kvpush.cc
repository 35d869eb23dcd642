// The C++ shim classes of kvpush.hpp over the cxx bridge (src/ffi/cxx.rs).
//
// Each class holds a rust::Box of its Rust object behind a pimpl, so kvpush.hpp needs neither cxx's
// headers nor the generated ones. Every bridge call goes through call(), which turns rust::Error
// (a Rust Result's Err) into kvpush::Error with the status code the Rust side recorded, and
// std::invalid_argument (cxx refusing a non-UTF-8 std::string) into Status::InvalidArgument.
#include "kvpush.hpp"

#include <utility>

#include "kvpush/src/ffi/cxx.rs.h"
#include "rust/cxx.h"

namespace kvpush {

namespace {

template <class F>
auto call(F &&f) -> decltype(f()) {
  try {
    return f();
  } catch (const rust::Error &e) {
    int code = bridge::take_error_code();
    throw Error(code == 0 ? Status::Panic : static_cast<Status>(code), e.what());
  } catch (const std::invalid_argument &e) {
    throw Error(Status::InvalidArgument, std::string("invalid argument (strings must be UTF-8): ") + e.what());
  }
}

bridge::Key to_bridge(const Key &k) { return bridge::Key{k.id_hi, k.id_lo, k.attempt}; }

// Block lists flattened: every id, then one length per group.
struct Flat {
  std::vector<std::uint32_t> ids;
  std::vector<std::size_t> lens;

  explicit Flat(const BlockLists &lists) {
    std::size_t total = 0;
    for (const auto &l : lists) total += l.size();
    ids.reserve(total);
    lens.reserve(lists.size());
    for (const auto &l : lists) {
      ids.insert(ids.end(), l.begin(), l.end());
      lens.push_back(l.size());
    }
  }
  rust::Slice<const std::uint32_t> id_slice() const { return {ids.data(), ids.size()}; }
  rust::Slice<const std::size_t> len_slice() const { return {lens.data(), lens.size()}; }
};

template <class T>
rust::Vec<T> to_vec(const std::vector<T> &v) {
  rust::Vec<T> out;
  out.reserve(v.size());
  for (const auto &x : v) out.push_back(x);
  return out;
}

bridge::EngineSpec to_bridge(const EngineConfig &c) {
  return bridge::EngineSpec{
      rust::String(c.engine_id), static_cast<std::uint32_t>(c.mode), rust::String(c.device),
      c.writers,                 c.lease_ms,                          c.timeout_ms,
      rust::String(c.agent_name), rust::String(c.nixl_backend),       rust::String(c.listen),
      rust::String(c.secret)};
}

bridge::LayoutSpec to_bridge(const Layout &l) {
  rust::Vec<bridge::GroupSpec> groups;
  groups.reserve(l.groups.size());
  for (const auto &g : l.groups) groups.push_back(bridge::GroupSpec{g.window_tokens, to_vec(g.layers)});
  return bridge::LayoutSpec{l.total_layers,
                            l.kv_heads,
                            l.head_dim,
                            static_cast<std::uint32_t>(l.dtype),
                            static_cast<std::uint32_t>(l.kv_kind),
                            l.block_tokens,
                            l.num_blocks,
                            static_cast<std::uint32_t>(l.order),
                            static_cast<std::uint32_t>(l.placement),
                            l.tp_rank,
                            l.tp_size,
                            l.pp_rank,
                            l.pp_size,
                            l.block_stride,
                            std::move(groups),
                            to_vec(l.region_bases),
                            to_vec(l.region_lens)};
}

}  // namespace

// ---- Hub ----------------------------------------------------------------------------------------

struct Hub::Impl {
  rust::Box<bridge::RustHub> hub;
};

Hub::Hub() : impl_(new Impl{bridge::new_hub()}) {}
Hub::~Hub() = default;
Hub::Hub(Hub &&) noexcept = default;
Hub &Hub::operator=(Hub &&) noexcept = default;

// ---- Engine -------------------------------------------------------------------------------------

struct Engine::Impl {
  rust::Box<bridge::RustEngine> engine;
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::Engine(const EngineConfig &config, const Layout &layout, const Hub &hub) {
  if (!hub.impl_) throw Error(Status::UnknownHandle, "Engine: the Hub was moved from");
  impl_ = call([&] {
    auto spec = to_bridge(config);
    auto lay = to_bridge(layout);
    return std::unique_ptr<Impl>(new Impl{bridge::new_loopback_engine(spec, lay, *hub.impl_->hub)});
  });
}

Engine Engine::nixl(const EngineConfig &config, const Layout &layout) {
  return Engine(call([&] {
    auto spec = to_bridge(config);
    auto lay = to_bridge(layout);
    return std::unique_ptr<Impl>(new Impl{bridge::new_nixl_engine(spec, lay)});
  }));
}

Engine::~Engine() = default;
Engine::Engine(Engine &&) noexcept = default;
Engine &Engine::operator=(Engine &&) noexcept = default;

const Engine::Impl &Engine::impl() const {
  if (!impl_) throw Error(Status::UnknownHandle, "kvpush::Engine: used after being moved from");
  return *impl_;
}

std::vector<std::uint8_t> Engine::handshake() const {
  return call([&] {
    rust::Vec<std::uint8_t> v = impl().engine->handshake();
    return std::vector<std::uint8_t>(v.begin(), v.end());
  });
}

void Engine::add_peer(const std::vector<std::uint8_t> &handshake) {
  call([&] { impl().engine->add_peer(rust::Slice<const std::uint8_t>(handshake.data(), handshake.size())); });
}

void Engine::connect(Engine &other) {
  const Impl &theirs = other.impl();
  call([&] { impl().engine->connect(*theirs.engine); });
}

void Engine::connect(const std::string &addr) {
  call([&] { impl().engine->connect_addr(rust::Str(addr)); });
}

std::uint16_t Engine::listen_port() const {
  return call([&] { return impl().engine->listen_port(); });
}

void Engine::request_finished(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens) {
  request_finished(key, blocks, num_tokens, std::string());
}

void Engine::request_finished(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens,
                              const std::string &consumer) {
  Flat f(blocks);
  call([&] {
    impl().engine->request_finished(to_bridge(key), f.id_slice(), f.len_slice(), num_tokens,
                                    rust::Str(consumer));
  });
}

void Engine::layers_ready(const Key &key, const BlockLists &blocks, std::uint64_t num_tokens,
                          std::uint32_t first_layer, std::uint32_t end_layer) {
  Flat f(blocks);
  call([&] {
    impl().engine->layers_ready(to_bridge(key), f.id_slice(), f.len_slice(), num_tokens, first_layer, end_layer);
  });
}

void Engine::blocks_allocated(const Key &key, const std::string &producer, const BlockLists &blocks,
                              std::uint64_t num_tokens) {
  Flat f(blocks);
  call([&] {
    impl().engine->blocks_allocated(to_bridge(key), rust::Str(producer), f.id_slice(), f.len_slice(),
                                    num_tokens);
  });
}

void Engine::start_pull(const Key &key, const std::string &producer, const BlockLists &remote,
                        const BlockLists &local, std::uint64_t num_tokens) {
  Flat r(remote), l(local);
  call([&] {
    impl().engine->start_pull(to_bridge(key), rust::Str(producer), r.id_slice(), r.len_slice(),
                              l.id_slice(), l.len_slice(), num_tokens);
  });
}

void Engine::abort(const Key &key) {
  call([&] { impl().engine->abort(to_bridge(key)); });
}

std::size_t Engine::poll(std::vector<Completion> &out, std::size_t max) {
  return call([&] {
    rust::Vec<bridge::Completion> got;
    std::size_t n = impl().engine->poll(got, max);
    out.reserve(out.size() + got.size());
    for (const auto &c : got) {
      out.push_back(Completion{Key{c.key.id_hi, c.key.id_lo, c.key.attempt}, static_cast<Outcome>(c.outcome),
                               static_cast<Release>(c.release), std::string(c.message)});
    }
    return n;
  });
}

Stats Engine::stats() const {
  return call([&] { return impl().engine->stats(); });
}

std::string Engine::stats_json() const {
  return call([&] { return std::string(impl().engine->stats_json()); });
}

}  // namespace kvpush
