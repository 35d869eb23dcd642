// C++ API test of kvpush (kvpush.hpp through the cxx bridge), built and run by tests/ffi_cpp.rs:
//
//   c++ -std=c++17 cpp_api_test.cc libkvpush_cxx.a -lkvpush
//
//   cpp_api_test loopback   push transfers between a producer and a consumer in this process, every
//                           byte verified; an abort; errors thrown as kvpush::Error with their status
//   cpp_api_test nixl       push transfers over real NIXL (UCX) and the TCP side channel
//
// Prints one line per check; exits 0 when all passed, 1 at the first failure.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvpush.hpp"

namespace {

constexpr std::uint32_t kLayers = 3, kHeads = 4, kHeadDim = 8, kBlock = 8, kBlocks = 32;
constexpr std::size_t kPart = std::size_t(kBlock) * kHeads * kHeadDim * 2;  // one K or V block, f16
constexpr std::size_t kRegion = kPart * kBlocks;

[[noreturn]] void die(const std::string &what) {
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  std::exit(1);
}

#define EXPECT(cond) \
  if (!(cond)) die(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": expected " #cond)

// The call must throw kvpush::Error with `status` and a message containing `needle`.
template <class F>
void expect_error(const char *what, kvpush::Status status, const char *needle, F &&f) {
  try {
    f();
  } catch (const kvpush::Error &e) {
    if (e.status() != status || std::strstr(e.what(), needle) == nullptr) {
      die(std::string(what) + ": wrong error (status " + std::to_string(int(e.status())) + "): " + e.what());
    }
    std::printf("error ok: %s: status %d: %s\n", what, int(e.status()), e.what());
    return;
  }
  die(std::string(what) + ": no exception");
}

// One worker: its memory (K and V regions per layer) and its engine.
struct Worker {
  std::vector<std::vector<std::uint8_t>> regions;
  kvpush::Layout layout;
  kvpush::Engine engine;

  static kvpush::Layout make_layout(std::vector<std::vector<std::uint8_t>> &regions) {
    kvpush::Layout l;
    l.total_layers = kLayers;
    l.kv_heads = kHeads;
    l.head_dim = kHeadDim;
    l.dtype = kvpush::DType::F16;
    l.block_tokens = kBlock;
    l.num_blocks = kBlocks;
    l.order = kvpush::BlockOrder::NHD;
    for (auto &r : regions) {
      l.region_bases.push_back(reinterpret_cast<std::uintptr_t>(r.data()));
      l.region_lens.push_back(r.size());
    }
    return l;
  }

  Worker(const std::string &id, const kvpush::Hub *hub)
      : regions(2 * kLayers, std::vector<std::uint8_t>(kRegion, 0xEE)),
        layout(make_layout(regions)),
        engine(hub ? kvpush::Engine(config(id, false), layout, *hub)
                   : kvpush::Engine::nixl(config(id, true), layout)) {}

  static kvpush::EngineConfig config(const std::string &id, bool nixl) {
    kvpush::EngineConfig c;
    c.engine_id = id;
    c.device = "host";
    c.timeout_ms = 20000;
    if (nixl) c.listen = "127.0.0.1:0";
    return c;
  }
};

std::uint8_t pattern(int req, std::size_t region, std::size_t i, std::size_t o) {
  return std::uint8_t(req * 17 + region * 5 + i * 11 + (o % 241) * 7 + 3);
}

std::vector<kvpush::Completion> wait_for(kvpush::Engine &e, std::size_t n) {
  std::vector<kvpush::Completion> got;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (got.size() < n) {
    if (e.poll(got, 1) == 0) {  // one at a time: the rest stays queued
      EXPECT(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return got;
}

// Pushes `count` requests from p to d and verifies every byte of their tokens ([tokens, heads, dim]).
void push(Worker &p, Worker &d, const std::string &producer, int count, std::uint64_t id_hi) {
  const std::uint64_t tokens[] = {24, 5, 32, 17};
  std::vector<kvpush::Key> keys;
  std::vector<std::vector<std::uint32_t>> p_ids, d_ids;
  for (int r = 0; r < count; r++) {
    std::size_t n = (tokens[r] + kBlock - 1) / kBlock;
    std::vector<std::uint32_t> pb, db;
    for (std::size_t i = 0; i < n; i++) {
      pb.push_back(std::uint32_t(r * 4 + i));
      db.push_back(std::uint32_t(kBlocks - 1 - (r * 4 + i)));
    }
    for (std::size_t g = 0; g < p.regions.size(); g++)
      for (std::size_t i = 0; i < n; i++)
        for (std::size_t o = 0; o < kPart; o++) p.regions[g][pb[i] * kPart + o] = pattern(r, g, i, o);
    keys.push_back(kvpush::Key{id_hi, std::uint64_t(r), 1});
    p_ids.push_back(pb);
    d_ids.push_back(db);
    d.engine.blocks_allocated(keys[r], producer, {db}, tokens[r]);
    if (r % 2 == 0) {
      p.engine.request_finished(keys[r], {pb}, tokens[r]);
    } else {
      // Layer by layer (issue #21): the request is sent once its last layer is final.
      for (std::uint32_t layer = 0; layer < kLayers; layer++) {
        p.engine.layers_ready(keys[r], {pb}, tokens[r], layer, layer + 1);
      }
    }
  }
  auto sent = wait_for(p.engine, count);
  auto received = wait_for(d.engine, count);
  std::size_t bytes = 0;
  for (int r = 0; r < count; r++) {
    auto same = [&](const kvpush::Completion &c) { return c.key.id_lo == keys[r].id_lo && c.key.id_hi == id_hi; };
    auto s = std::find_if(sent.begin(), sent.end(), same);
    auto v = std::find_if(received.begin(), received.end(), same);
    EXPECT(s != sent.end() && v != received.end());
    if (v->outcome != kvpush::Outcome::Received) die("request " + std::to_string(r) + ": " + v->message);
    EXPECT(s->outcome == kvpush::Outcome::Sent && s->release == kvpush::Release::Sent);
    for (std::size_t g = 0; g < d.regions.size(); g++)
      for (std::size_t i = 0; i < d_ids[r].size(); i++)
        for (std::size_t o = 0; o < kPart; o++) {
          std::size_t token = o / (kHeads * kHeadDim * 2);
          if (i * kBlock + token >= tokens[r]) continue;
          if (d.regions[g][d_ids[r][i] * kPart + o] != pattern(r, g, i, o)) {
            die("request " + std::to_string(r) + " region " + std::to_string(g) + " byte " + std::to_string(o) +
                " differs");
          }
          bytes++;
        }
  }
  kvpush::Stats ps = p.engine.stats(), ds = d.engine.stats();
  const kvpush_counters &pc = ps.counters, &dc = ds.counters;
  EXPECT(dc.received >= std::uint64_t(count) && pc.bytes >= bytes && pc.posts >= std::uint64_t(count));
  EXPECT(ps.failures.post == 0 && ps.failures.transfer == 0 && ds.failures.timeout == 0);
  EXPECT(ds.receive.count == dc.received && ds.receive.p50_us <= ds.receive.max_us);
  std::printf("push ok: %d requests, %zu bytes verified, %llu descriptors posted (%llu before merging)\n", count,
              bytes, (unsigned long long)pc.descriptors_posted, (unsigned long long)pc.descriptors_unmerged);
}

void errors(const kvpush::Hub &hub, Worker &p, Worker &d) {
  using kvpush::Status;
  expect_error("bad layout", Status::Layout, "head_dim", [&] {
    kvpush::Layout l = p.layout;
    l.head_dim = 0;
    kvpush::Engine e(Worker::config("bad", false), l, hub);
  });
  expect_error("short region", Status::Layout, "has 1 bytes", [&] {
    kvpush::Layout l = p.layout;
    l.region_lens[2] = 1;
    kvpush::Engine e(Worker::config("bad", false), l, hub);
  });
  expect_error("no regions", Status::InvalidArgument, "region_bases", [&] {
    kvpush::Layout l = p.layout;
    l.region_bases.clear();
    l.region_lens.clear();
    kvpush::Engine e(Worker::config("bad", false), l, hub);
  });
  expect_error("non-UTF-8 engine id", Status::InvalidArgument, "UTF-8", [&] {
    kvpush::Engine e(Worker::config("\xc3\x28", false), p.layout, hub);
  });
  expect_error("unknown producer block", Status::Blocks, "77", [&] {
    d.engine.blocks_allocated(kvpush::Key{1, 2, 3}, "prefill", {{77}}, 8);
  });
  expect_error("too many groups", Status::Blocks, "group", [&] {
    d.engine.blocks_allocated(kvpush::Key{1, 2, 3}, "prefill", {{1}, {2}}, 8);
  });
  expect_error("pull call in push mode", Status::WrongMode, "push mode", [&] {
    d.engine.start_pull(kvpush::Key{1, 2, 3}, "prefill", {{1}}, {{2}}, 8);
  });
  expect_error("incompatible peer", Status::Incompatible, "differs", [&] {
    kvpush::EngineConfig c = Worker::config("other-model", false);
    std::vector<std::vector<std::uint8_t>> mem(2 * kLayers, std::vector<std::uint8_t>(kRegion * 2));
    kvpush::Layout other = Worker::make_layout(mem);
    other.head_dim = kHeadDim * 2;
    kvpush::Engine e(c, other, hub);
    d.engine.add_peer(e.handshake());
  });
  expect_error("garbage handshake", Status::Decode, "not a kvpush frame", [&] {
    d.engine.add_peer({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  });
  expect_error("loopback has no side channel", Status::InvalidArgument, "side channel", [&] {
    (void)d.engine.listen_port();
  });
  expect_error("moved-from engine", Status::UnknownHandle, "moved", [&] {
    kvpush::Engine e(Worker::config("moved", false), Worker::make_layout(p.regions), hub);
    kvpush::Engine taken = std::move(e);
    e.abort(kvpush::Key{});
  });
}

int run_loopback() {
  kvpush::Hub hub;
  Worker p("prefill", &hub), d("decode", &hub);
  d.engine.connect(p.engine);
  push(p, d, "prefill", 4, 0xC0DE);

  // An abort on the consumer before any prefill: the request ends without data.
  d.engine.blocks_allocated(kvpush::Key{9, 9, 1}, "prefill", {{20, 21}}, 16);
  d.engine.abort(kvpush::Key{9, 9, 1});
  auto ended = wait_for(d.engine, 1);
  EXPECT(ended[0].outcome == kvpush::Outcome::Ended && ended[0].key.id_lo == 9);
  std::printf("abort ok: %s\n", ended[0].message.c_str());

  errors(hub, p, d);
  std::string json = d.engine.stats_json();
  EXPECT(json.find("\"received\":4") != std::string::npos);
  std::printf("stats ok: %.60s...\n", json.c_str());
  std::printf("all C++ API checks passed\n");
  return 0;
}

int run_nixl() {
  Worker p("prefill", nullptr), d("decode", nullptr);
  std::uint16_t port = p.engine.listen_port();
  d.engine.connect("127.0.0.1:" + std::to_string(port));
  push(p, d, "prefill", 3, 0x1ACE);
  expect_error("NIXL add_peer", kvpush::Status::InvalidArgument, "side channel",
               [&] { d.engine.add_peer(p.engine.handshake()); });
  std::printf("all C++ NIXL checks passed (side channel port %u)\n", unsigned(port));
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  std::string mode = argc > 1 ? argv[1] : "loopback";
  try {
    if (mode == "loopback") return run_loopback();
    if (mode == "nixl") return run_nixl();
  } catch (const kvpush::Error &e) {
    die(std::string("unexpected kvpush::Error (status ") + std::to_string(int(e.status())) + "): " + e.what());
  }
  std::fprintf(stderr, "usage: %s [loopback|nixl]\n", argv[0]);
  return 2;
}
