// C++ API test of kvpush (kvpush.hpp through the cxx bridge), built and run by tests/ffi_cpp.rs:
//
//   c++ -std=c++17 cpp_api_test.cc libkvpush_cxx.a -lkvpush
//
//   cpp_api_test loopback   push transfers between a producer and a consumer in this process, every
//                           byte verified; an abort; errors thrown as kvpush::Error with their status
//   cpp_api_test nixl       push transfers over real NIXL (UCX) and the TCP side channel
//   cpp_api_test neuron LIB push transfers between engines whose regions are framework memory of
//                           the libnrt LIB (built with -DKVPUSH_TEST_NEURON and linked with LIB, the
//                           fake libnrt of tests/neuron_fake), every byte verified
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
#ifdef KVPUSH_TEST_NEURON
#include "nrt/nrt.h"
#endif

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

// Device tensors the framework allocated (device "neuron"), freed after the engine that uses them.
struct Tensors {
  std::vector<void *> handles;
  Tensors() = default;
  Tensors(const Tensors &) = delete;
  Tensors &operator=(const Tensors &) = delete;
  ~Tensors() {
#ifdef KVPUSH_TEST_NEURON
    for (void *h : handles) {
      nrt_tensor_t *t = static_cast<nrt_tensor_t *>(h);
      nrt_tensor_free(&t);
    }
#endif
  }
};

// One worker: its memory (K and V regions per layer, on `device`) and its engine; members are
// destroyed in reverse order, so the engine goes before the memory.
struct Worker {
  std::vector<std::vector<std::uint8_t>> host;  // the regions on device "host"
  Tensors tensors;                              // the regions on device "neuron"
  std::vector<std::uint8_t *> regions;
  kvpush::Layout layout;
  kvpush::Engine engine;

  static kvpush::Layout make_layout(std::vector<std::vector<std::uint8_t>> &mem) {
    std::vector<std::uint8_t *> ptrs;
    for (auto &r : mem) ptrs.push_back(r.data());
    return make_layout(ptrs, mem.empty() ? 0 : mem[0].size());
  }

  static kvpush::Layout make_layout(const std::vector<std::uint8_t *> &regions, std::size_t len) {
    kvpush::Layout l;
    l.total_layers = kLayers;
    l.kv_heads = kHeads;
    l.head_dim = kHeadDim;
    l.dtype = kvpush::DType::F16;
    l.block_tokens = kBlock;
    l.num_blocks = kBlocks;
    l.order = kvpush::BlockOrder::NHD;
    for (auto *r : regions) {
      l.region_bases.push_back(reinterpret_cast<std::uintptr_t>(r));
      l.region_lens.push_back(len);
    }
    return l;
  }

  Worker(const std::string &id, const kvpush::Hub *hub, const std::string &device = "host")
      : regions(allocate(id, device)),
        layout(make_layout(regions, kRegion)),
        engine(hub ? kvpush::Engine(config(id, false, device), layout, *hub)
                   : kvpush::Engine::nixl(config(id, true), layout)) {}

  // The regions, each filled with 0xEE: host vectors, or (as vllm-neuron's worker allocates its KV
  // cache) one device tensor per layer and part through libnrt, of which kvpush sees the address.
  std::vector<std::uint8_t *> allocate([[maybe_unused]] const std::string &id, const std::string &device) {
    std::vector<std::uint8_t *> out;
    for (std::uint32_t r = 0; r < 2 * kLayers; r++) {
      std::uint8_t *mem = nullptr;
      if (device == "host") {
        host.emplace_back(kRegion);
        mem = host.back().data();
#ifdef KVPUSH_TEST_NEURON
      } else if (device == "neuron") {
        std::string name = id + ".model.layers." + std::to_string(r / 2) + (r % 2 ? ".v" : ".k");
        nrt_tensor_t *t = nullptr;
        EXPECT(nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, kRegion, name.c_str(), &t) == NRT_SUCCESS);
        tensors.handles.push_back(t);
        mem = static_cast<std::uint8_t *>(nrt_tensor_get_va(t));
#endif
      }
      if (mem == nullptr) die("no memory for region " + std::to_string(r) + " on device " + device);
      std::memset(mem, 0xEE, kRegion);
      out.push_back(mem);
    }
    return out;
  }

  static kvpush::EngineConfig config(const std::string &id, bool nixl, const std::string &device = "host") {
    kvpush::EngineConfig c;
    c.engine_id = id;
    c.device = device;
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
    if (r % 3 == 0) {
      p.engine.request_finished(keys[r], {pb}, tokens[r]);
    } else if (r % 3 == 1) {
      // Naming the consumer (every D here is engine "decode"): served the same.
      p.engine.request_finished(keys[r], {pb}, tokens[r], "decode");
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
    kvpush::Engine e(Worker::config("moved", false), Worker::make_layout(p.regions, kRegion), hub);
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

#ifdef KVPUSH_TEST_NEURON
// The framework's side as vllm-neuron's worker plays it: NEURON_RT_VISIBLE_CORES and
// NEURON_RT_MAP_HBM=1 set and the runtime started before kvpush exists; kvpush (KVPUSH_LIBNRT: the
// same library) attaches to it and accepts the tensors by their addresses alone.
int run_neuron(const char *libnrt) {
  EXPECT(setenv("NEURON_RT_VISIBLE_CORES", "0", 1) == 0 && setenv("NEURON_RT_MAP_HBM", "1", 1) == 0);
  EXPECT(setenv("KVPUSH_LIBNRT", libnrt, 1) == 0);
  EXPECT(nrt_init(NRT_FRAMEWORK_TYPE_PYTORCH, "2.8", "") == NRT_SUCCESS);
  {
    kvpush::Hub hub;
    Worker p("prefill", &hub, "neuron"), d("decode", &hub, "neuron");
    d.engine.connect(p.engine);
    push(p, d, "prefill", 4, 0x4E52);
    expect_error("host memory on device neuron", kvpush::Status::Device, "does not map it", [&] {
      std::vector<std::vector<std::uint8_t>> mem(2 * kLayers, std::vector<std::uint8_t>(kRegion));
      kvpush::Engine e(Worker::config("host-on-neuron", false, "neuron"), Worker::make_layout(mem), hub);
    });
  }
  nrt_close();
  std::printf("all C++ Neuron checks passed\n");
  return 0;
}
#endif

}  // namespace

int main(int argc, char **argv) {
  std::string mode = argc > 1 ? argv[1] : "loopback";
  try {
    if (mode == "loopback") return run_loopback();
    if (mode == "nixl") return run_nixl();
#ifdef KVPUSH_TEST_NEURON
    if (mode == "neuron" && argc > 2) return run_neuron(argv[2]);
#endif
  } catch (const kvpush::Error &e) {
    die(std::string("unexpected kvpush::Error (status ") + std::to_string(int(e.status())) + "): " + e.what());
  }
  std::fprintf(stderr, "usage: %s [loopback|nixl|neuron LIBNRT]\n", argv[0]);
  return 2;
}
