/*
 * C API test of kvpush, built and run by tests/ffi_c.rs (cc -std=c11 ... -lkvpush).
 *
 *   c_api_test loopback   push and pull transfers between a producer and a consumer in this
 *                         process (loopback transport), every byte verified; aborts; error paths
 *   c_api_test nixl       push transfers over real NIXL (UCX) and the TCP side channel
 *   c_api_test bench [N]  engine-thread time per request through the C ABI (see run_bench)
 *   c_api_test neuron LIB push and pull between engines whose KV regions are framework memory of
 *                         the libnrt LIB (built with -DKVPUSH_TEST_NEURON, linked with LIB: the fake
 *                         libnrt of tests/neuron_fake), every byte verified (see run_neuron)
 *
 * Prints one line per check; exits 0 when all passed, 1 at the first failure (with the library's
 * error message).
 */
#define _POSIX_C_SOURCE 200809L

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpush.h"
#ifdef KVPUSH_TEST_NEURON
#include "nrt/nrt.h"
#endif

#define LAYERS 4
#define HEADS 2
#define HEAD_DIM 16
#define BLOCK 16
#define NUM_BLOCKS 64
#define REGIONS (2 * LAYERS)
#define DTYPE_BYTES 2
#define PART_BYTES ((size_t)BLOCK * HEADS * HEAD_DIM * DTYPE_BYTES)
#define REGION_BYTES ((size_t)NUM_BLOCKS * PART_BYTES)
#define MAX_REQ_BLOCKS 8

static void fail(const char *file, int line, const char *what, int rc) {
  fprintf(stderr, "FAILED %s:%d: %s -> %s: %s\n", file, line, what, kvpush_status_name(rc), kvpush_last_error());
  exit(1);
}

#define CHECK(call)                                          \
  do {                                                       \
    int rc_ = (call);                                        \
    if (rc_ != KVPUSH_OK) fail(__FILE__, __LINE__, #call, rc_); \
  } while (0)

#define EXPECT(cond)                                                         \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "FAILED %s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

/* The call must fail with `code` and a message containing `needle`. */
#define EXPECT_ERR(call, code, needle)                                                           \
  do {                                                                                           \
    int rc_ = (call);                                                                            \
    if (rc_ != (code) || strstr(kvpush_last_error(), (needle)) == NULL) {                        \
      fprintf(stderr, "FAILED %s:%d: %s returned %s (\"%s\"), expected %s with \"%s\"\n", __FILE__, \
              __LINE__, #call, kvpush_status_name(rc_), kvpush_last_error(), kvpush_status_name(code), \
              (needle));                                                                         \
      exit(1);                                                                                   \
    }                                                                                            \
    printf("error ok: %s: %s\n", kvpush_status_name(rc_), kvpush_last_error());                   \
  } while (0)

typedef struct worker worker;

/* Where a worker's KV regions live: the kvpush device that describes them, and how the test (in
 * the role of the serving framework) allocates them, filled with 0xEE, and frees them. */
typedef struct memory {
  const char *device;
  void (*alloc)(worker *w, const char *name);
  void (*release)(worker *w);
} memory;

struct worker {
  kvpush_engine *engine;
  const memory *mem;
  uint8_t *regions[REGIONS];
  void *handles[REGIONS]; /* the framework's handle of each region, where it has one */
  uint64_t bases[REGIONS];
  uint64_t lens[REGIONS];
  kvpush_layout layout;
};

static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000L};
  nanosleep(&ts, NULL);
}

static void sleep_ms(long ms) { sleep_us(ms * 1000); }

/* Records region `r` at `mem`, filled with 0xEE, and describes the regions in the layout once the
 * last one is in. */
static void set_region(worker *w, int r, uint8_t *mem) {
  EXPECT(mem != NULL);
  memset(mem, 0xEE, REGION_BYTES);
  w->regions[r] = mem;
  w->bases[r] = (uint64_t)(uintptr_t)mem;
  w->lens[r] = REGION_BYTES;
  if (r + 1 < REGIONS) return;
  CHECK(kvpush_layout_init(&w->layout));
  w->layout.total_layers = LAYERS;
  w->layout.kv_heads = HEADS;
  w->layout.head_dim = HEAD_DIM;
  w->layout.dtype = KVPUSH_DTYPE_BF16;
  w->layout.kv_kind = KVPUSH_KV_KEY_VALUE;
  w->layout.block_tokens = BLOCK;
  w->layout.num_blocks = NUM_BLOCKS;
  w->layout.order = KVPUSH_ORDER_HND;
  w->layout.placement = KVPUSH_PLACEMENT_SEPARATE;
  w->layout.region_bases = w->bases;
  w->layout.num_regions = REGIONS;
  w->layout.region_lens = w->lens;
}

static void alloc_host(worker *w, const char *name) {
  (void)name;
  for (int r = 0; r < REGIONS; r++) set_region(w, r, aligned_alloc(4096, REGION_BYTES));
}

static void free_host(worker *w) {
  for (int r = 0; r < REGIONS; r++) free(w->regions[r]);
}

static const memory HOST = {"host", alloc_host, free_host};

static void create_loopback(worker *w, const char *id, uint32_t mode, kvpush_hub *hub, const memory *mem) {
  w->mem = mem;
  mem->alloc(w, id);
  kvpush_engine_config cfg;
  CHECK(kvpush_engine_config_init(&cfg));
  cfg.engine_id = id;
  cfg.mode = mode;
  cfg.transport = KVPUSH_TRANSPORT_LOOPBACK;
  cfg.hub = hub;
  cfg.device = mem->device;
  cfg.timeout_ms = 20000;
  CHECK(kvpush_engine_create(&cfg, &w->layout, &w->engine));
}

static void create_nixl(worker *w, const char *id) {
  w->mem = &HOST;
  alloc_host(w, id);
  kvpush_engine_config cfg;
  CHECK(kvpush_engine_config_init(&cfg));
  cfg.engine_id = id;
  cfg.transport = KVPUSH_TRANSPORT_NIXL;
  cfg.device = "host";
  cfg.listen = "127.0.0.1:0";
  cfg.timeout_ms = 20000;
  CHECK(kvpush_engine_create(&cfg, &w->layout, &w->engine));
}

static void destroy(worker *w) {
  CHECK(kvpush_engine_destroy(w->engine));
  w->mem->release(w);
}

/* Byte `o` of block part number `i` of request `req` in region `g`. */
static uint8_t pattern(int req, int g, int i, size_t o) {
  return (uint8_t)(req * 131 + g * 31 + i * 7 + (int)(o % 251) * 3 + 1);
}

typedef struct request {
  kvpush_key key;
  uint64_t tokens;
  uint32_t p_ids[MAX_REQ_BLOCKS];
  uint32_t d_ids[MAX_REQ_BLOCKS];
  size_t nblocks;
} request;

static void prefill(worker *p, const request *rq, int req) {
  for (int g = 0; g < REGIONS; g++)
    for (size_t i = 0; i < rq->nblocks; i++) {
      uint8_t *blk = p->regions[g] + (size_t)rq->p_ids[i] * PART_BYTES;
      for (size_t o = 0; o < PART_BYTES; o++) blk[o] = pattern(req, g, (int)i, o);
    }
}

/* Checks every byte of the request's valid tokens on D ([heads, tokens, head_dim] per part). */
static size_t verify(const worker *d, const request *rq, int req) {
  size_t checked = 0;
  for (int g = 0; g < REGIONS; g++)
    for (size_t i = 0; i < rq->nblocks; i++) {
      const uint8_t *blk = d->regions[g] + (size_t)rq->d_ids[i] * PART_BYTES;
      for (size_t o = 0; o < PART_BYTES; o++) {
        size_t token = (o / (HEAD_DIM * DTYPE_BYTES)) % BLOCK;
        if (i * BLOCK + token >= rq->tokens) continue;
        if (blk[o] != pattern(req, g, (int)i, o)) {
          fprintf(stderr, "FAILED: request %d region %d block %zu byte %zu: got %u, want %u\n", req, g, i, o,
                  blk[o], pattern(req, g, (int)i, o));
          exit(1);
        }
        checked++;
      }
    }
  return checked;
}

static kvpush_block_list one_group(const uint32_t *ids, size_t n) {
  kvpush_block_list l = {ids, n};
  return l;
}

/* Polls `w` (two results at a time, to exercise partial drains) until `want` results arrived. */
static size_t poll_until(worker *w, kvpush_completion *acc, size_t have, size_t want) {
  for (int waited = 0; have < want; waited++) {
    size_t n = 0;
    CHECK(kvpush_poll(w->engine, acc + have, want - have < 2 ? want - have : 2, &n));
    have += n;
    if (n == 0) {
      EXPECT(waited < 20000);
      sleep_ms(1);
    }
  }
  return have;
}

static const kvpush_completion *find(const kvpush_completion *c, size_t n, kvpush_key k) {
  for (size_t i = 0; i < n; i++)
    if (c[i].key.id_hi == k.id_hi && c[i].key.id_lo == k.id_lo && c[i].key.attempt == k.attempt) return &c[i];
  return NULL;
}

/* Pushes `count` requests from p to d (half registered first, half prefilled first) and checks
 * outcomes, bytes and counters. */
static void push_requests(worker *p, worker *d, const char *producer, int count, uint64_t id_hi) {
  static const uint64_t tokens[] = {64, 40, 16, 100, 1, 33};
  request rq[6];
  EXPECT(count <= 6);
  for (int r = 0; r < count; r++) {
    rq[r].key.id_hi = id_hi;
    rq[r].key.id_lo = (uint64_t)r + 1;
    rq[r].key.attempt = 1;
    rq[r].tokens = tokens[r];
    rq[r].nblocks = (size_t)((tokens[r] + BLOCK - 1) / BLOCK);
    for (size_t i = 0; i < rq[r].nblocks; i++) {
      rq[r].p_ids[i] = (uint32_t)(r * MAX_REQ_BLOCKS + i);                        /* contiguous */
      /* first three contiguous, then descending: some runs merge, some do not */
      rq[r].d_ids[i] = (uint32_t)(NUM_BLOCKS - (r + 1) * MAX_REQ_BLOCKS + (i < 3 ? i : 10 - i));
    }
    prefill(p, &rq[r], r);
  }
  for (int r = 0; r < count; r++) {
    kvpush_block_list pg = one_group(rq[r].p_ids, rq[r].nblocks);
    kvpush_block_list dg = one_group(rq[r].d_ids, rq[r].nblocks);
    if (r % 2 == 0) {
      CHECK(kvpush_blocks_allocated(d->engine, rq[r].key, producer, &dg, 1, rq[r].tokens));
      CHECK(kvpush_request_finished(p->engine, rq[r].key, &pg, 1, rq[r].tokens));
    } else {
      CHECK(kvpush_request_finished(p->engine, rq[r].key, &pg, 1, rq[r].tokens));
      CHECK(kvpush_blocks_allocated(d->engine, rq[r].key, producer, &dg, 1, rq[r].tokens));
    }
  }
  kvpush_completion pc[6], dc[6];
  size_t np = poll_until(p, pc, 0, (size_t)count);
  size_t nd = poll_until(d, dc, 0, (size_t)count);
  size_t bytes = 0;
  for (int r = 0; r < count; r++) {
    const kvpush_completion *s = find(pc, np, rq[r].key);
    const kvpush_completion *v = find(dc, nd, rq[r].key);
    EXPECT(s != NULL && v != NULL);
    if (v->outcome != KVPUSH_OUTCOME_RECEIVED) {
      fprintf(stderr, "FAILED: request %d: consumer outcome %u: %s\n", r, v->outcome, v->message);
      exit(1);
    }
    EXPECT(s->outcome == KVPUSH_OUTCOME_SENT && s->release == KVPUSH_RELEASE_SENT);
    bytes += verify(d, &rq[r], r);
  }
  kvpush_stats pst, dst;
  CHECK(kvpush_engine_stats(p->engine, &pst));
  CHECK(kvpush_engine_stats(d->engine, &dst));
  const kvpush_counters *ps = &pst.counters, *ds = &dst.counters;
  EXPECT(ds->received >= (uint64_t)count);
  EXPECT(ps->posts >= (uint64_t)count && ps->bytes >= bytes);
  EXPECT(ps->descriptors_posted <= ps->descriptors_unmerged);
  EXPECT(pst.failures.post == 0 && pst.failures.transfer == 0 && dst.failures.timeout == 0);
  EXPECT(dst.receive.count == ds->received && dst.receive.p50_us <= dst.receive.max_us);
  printf("push ok: %d requests, %zu bytes verified, producer posted %llu bytes in %llu descriptors (%llu before "
         "merging)\n",
         count, bytes, (unsigned long long)ps->bytes, (unsigned long long)ps->descriptors_posted,
         (unsigned long long)ps->descriptors_unmerged);
}

static void pull_request(kvpush_hub *hub, const memory *mem) {
  worker p, d;
  create_loopback(&p, "prefill-pull", KVPUSH_MODE_PULL, hub, mem);
  create_loopback(&d, "decode-pull", KVPUSH_MODE_PULL, hub, mem);
  CHECK(kvpush_engine_connect(d.engine, p.engine));
  request rq = {{0, 0xBEEF, 2}, 48, {10, 11, 12}, {3, 7, 5}, 3};
  prefill(&p, &rq, 9);
  kvpush_block_list pg = one_group(rq.p_ids, rq.nblocks), dg = one_group(rq.d_ids, rq.nblocks);
  EXPECT_ERR(kvpush_blocks_allocated(d.engine, rq.key, "prefill-pull", &dg, 1, rq.tokens), KVPUSH_ERR_WRONG_MODE,
             "pull mode");
  /* P names its consumer: the grant goes to decode-pull only. */
  CHECK(kvpush_request_finished_for(p.engine, rq.key, &pg, 1, rq.tokens, "decode-pull"));
  CHECK(kvpush_start_pull(d.engine, rq.key, "prefill-pull", &pg, 1, &dg, 1, rq.tokens));
  kvpush_completion pc[1], dc[1];
  poll_until(&d, dc, 0, 1);
  poll_until(&p, pc, 0, 1);
  EXPECT(dc[0].outcome == KVPUSH_OUTCOME_RECEIVED && dc[0].key.id_lo == 0xBEEF && dc[0].key.attempt == 2);
  EXPECT(pc[0].outcome == KVPUSH_OUTCOME_SENT);
  printf("pull ok: %zu bytes verified\n", verify(&d, &rq, 9));
  destroy(&d);
  destroy(&p);
}

/* Layer by layer: the producer reports each layer as it is final (a 48-token request is below the
 * engines' layer-wise threshold, so it goes whole once the last layer is final); every byte verified. */
static void layers_request(kvpush_hub *hub) {
  worker p, d;
  create_loopback(&p, "prefill-layers", KVPUSH_MODE_PUSH, hub, &HOST);
  create_loopback(&d, "decode-layers", KVPUSH_MODE_PUSH, hub, &HOST);
  CHECK(kvpush_engine_connect(d.engine, p.engine));
  request rq = {{0, 0x1A7E, 1}, 48, {10, 11, 12}, {3, 7, 5}, 3};
  prefill(&p, &rq, 21);
  kvpush_block_list pg = one_group(rq.p_ids, rq.nblocks), dg = one_group(rq.d_ids, rq.nblocks);
  CHECK(kvpush_blocks_allocated(d.engine, rq.key, "prefill-layers", &dg, 1, rq.tokens));
  EXPECT_ERR(kvpush_layers_ready(p.engine, rq.key, &pg, 1, rq.tokens, 3, 1), KVPUSH_ERR_INVALID_ARGUMENT,
             "ends before it starts");
  EXPECT_ERR(kvpush_layers_ready(p.engine, rq.key, NULL, 1, rq.tokens, 0, 1), KVPUSH_ERR_NULL, "groups");
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    CHECK(kvpush_layers_ready(p.engine, rq.key, &pg, 1, rq.tokens, layer, layer + 1));
  }
  kvpush_completion pc[1], dc[1];
  poll_until(&d, dc, 0, 1);
  poll_until(&p, pc, 0, 1);
  EXPECT(dc[0].outcome == KVPUSH_OUTCOME_RECEIVED && dc[0].key.id_lo == 0x1A7E);
  EXPECT(pc[0].outcome == KVPUSH_OUTCOME_SENT && pc[0].release == KVPUSH_RELEASE_SENT);
  printf("layers ok: %zu bytes verified\n", verify(&d, &rq, 21));
  destroy(&d);
  destroy(&p);
}

static void aborts(worker *p, worker *d) {
  /* Consumer registers, then aborts before any prefill: it ends without data. */
  uint32_t d_ids[2] = {40, 41}, p_ids[2] = {50, 51};
  kvpush_key kd = {7, 1, 1}, kp = {7, 2, 1};
  kvpush_block_list dg = one_group(d_ids, 2), pg = one_group(p_ids, 2);
  CHECK(kvpush_blocks_allocated(d->engine, kd, "prefill", &dg, 1, 32));
  CHECK(kvpush_abort(d->engine, kd));
  /* Producer finishes prefill, nobody registers, it aborts: its blocks come back. */
  CHECK(kvpush_request_finished(p->engine, kp, &pg, 1, 32));
  CHECK(kvpush_abort(p->engine, kp));
  kvpush_completion c[1];
  poll_until(d, c, 0, 1);
  EXPECT(c[0].key.id_lo == 1 && c[0].outcome == KVPUSH_OUTCOME_ENDED);
  printf("abort ok: consumer outcome %u (%s)\n", c[0].outcome, c[0].message);
  poll_until(p, c, 0, 1);
  EXPECT(c[0].key.id_lo == 2 && c[0].outcome == KVPUSH_OUTCOME_SENT && c[0].release == KVPUSH_RELEASE_ABORTED);
  printf("abort ok: producer released with %s\n", c[0].message);
}

static void error_paths(kvpush_hub *hub, worker *p, worker *d) {
  kvpush_engine_config cfg;
  CHECK(kvpush_engine_config_init(&cfg));
  cfg.engine_id = "bad";
  cfg.hub = hub;
  cfg.device = "host";
  kvpush_layout l = p->layout;
  kvpush_engine *e = NULL;

  l.kv_heads = 0;
  EXPECT_ERR(kvpush_engine_create(&cfg, &l, &e), KVPUSH_ERR_LAYOUT, "kv_heads");
  l = p->layout;
  l.dtype = 42;
  EXPECT_ERR(kvpush_engine_create(&cfg, &l, &e), KVPUSH_ERR_LAYOUT, "`dtype` = 42");
  l = p->layout;
  uint64_t short_lens[REGIONS];
  for (int r = 0; r < REGIONS; r++) short_lens[r] = REGION_BYTES;
  short_lens[5] = REGION_BYTES - 1;
  l.region_lens = short_lens;
  EXPECT_ERR(kvpush_engine_create(&cfg, &l, &e), KVPUSH_ERR_LAYOUT, "region 5");
  l = p->layout;
  l.num_regions = 3;
  EXPECT_ERR(kvpush_engine_create(&cfg, &l, &e), KVPUSH_ERR_LAYOUT, "3 region bases given, 8 expected");
  EXPECT(e == NULL);
  EXPECT_ERR(kvpush_engine_create(NULL, &p->layout, &e), KVPUSH_ERR_NULL, "config");
  cfg.engine_id = "\xff\xfe";
  EXPECT_ERR(kvpush_engine_create(&cfg, &p->layout, &e), KVPUSH_ERR_INVALID_ARGUMENT, "UTF-8");
  cfg.engine_id = "bad";
  cfg.hub = NULL;
  EXPECT_ERR(kvpush_engine_create(&cfg, &p->layout, &e), KVPUSH_ERR_NULL, "hub");
  cfg.hub = hub;
  cfg.mode = 7;
  EXPECT_ERR(kvpush_engine_create(&cfg, &p->layout, &e), KVPUSH_ERR_INVALID_ARGUMENT, "mode");
  cfg.mode = KVPUSH_MODE_PUSH;
  cfg.device = "tpu";
  EXPECT_ERR(kvpush_engine_create(&cfg, &p->layout, &e), KVPUSH_ERR_DEVICE, "tpu");
  cfg.device = "host";
  /* Memory that is not mapped: the host device refuses it before anything is registered. */
  uint64_t unmapped[REGIONS];
  for (int r = 0; r < REGIONS; r++) unmapped[r] = 0x10000 + (uint64_t)r * REGION_BYTES;
  l = p->layout;
  l.region_bases = unmapped;
  l.region_lens = NULL;
  EXPECT_ERR(kvpush_engine_create(&cfg, &l, &e), KVPUSH_ERR_DEVICE, "not memory of this device");
  EXPECT(e == NULL);

  /* Block lists that do not fit the layout. */
  uint32_t far[1] = {9999};
  kvpush_block_list g = one_group(far, 1);
  kvpush_key k = {0, 99, 1};
  EXPECT_ERR(kvpush_blocks_allocated(d->engine, k, "prefill", &g, 1, 16), KVPUSH_ERR_BLOCKS, "9999");
  EXPECT_ERR(kvpush_blocks_allocated(d->engine, k, "prefill", NULL, 1, 16), KVPUSH_ERR_NULL, "groups");
  EXPECT_ERR(kvpush_blocks_allocated(d->engine, k, NULL, &g, 1, 16), KVPUSH_ERR_NULL, "producer");
  {
    uint32_t ok_ids[1] = {1};
    kvpush_block_list okg = one_group(ok_ids, 1);
    char long_id[300];
    memset(long_id, 'd', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    EXPECT_ERR(kvpush_request_finished_for(p->engine, k, &okg, 1, 16, long_id), KVPUSH_ERR_INVALID_ARGUMENT,
               "consumer engine id");
  }
  EXPECT_ERR(kvpush_start_pull(d->engine, k, "prefill", &g, 1, &g, 1, 16), KVPUSH_ERR_WRONG_MODE, "start_pull");

  /* Handshakes: a short buffer, garbage, an incompatible peer. */
  uint8_t small[4];
  size_t len = 0;
  EXPECT_ERR(kvpush_engine_handshake(p->engine, small, sizeof small, &len), KVPUSH_ERR_BUFFER_TOO_SMALL,
             "too small");
  EXPECT(len > sizeof small);
  uint8_t garbage[16] = "not a handshake";
  EXPECT_ERR(kvpush_engine_add_peer(d->engine, garbage, sizeof garbage), KVPUSH_ERR_DECODE, "handshake");
  worker pull;
  create_loopback(&pull, "prefill-pull-mode", KVPUSH_MODE_PULL, hub, &HOST);
  len = 0;
  EXPECT(kvpush_engine_handshake(pull.engine, NULL, 0, &len) == KVPUSH_ERR_BUFFER_TOO_SMALL && len > 0);
  uint8_t *hs = malloc(len);
  CHECK(kvpush_engine_handshake(pull.engine, hs, len, &len));
  EXPECT(strcmp(kvpush_last_error(), "") == 0);
  EXPECT_ERR(kvpush_engine_add_peer(d->engine, hs, len), KVPUSH_ERR_INCOMPATIBLE, "mode differs");
  EXPECT_ERR(kvpush_engine_connect(d->engine, d->engine), KVPUSH_ERR_INVALID_ARGUMENT, "itself");
  free(hs);
  destroy(&pull);

  /* Handles: null, destroyed, made up; out-pointers. */
  EXPECT_ERR(kvpush_abort(pull.engine, k), KVPUSH_ERR_UNKNOWN_HANDLE, "unknown");
  EXPECT_ERR(kvpush_engine_destroy(pull.engine), KVPUSH_ERR_UNKNOWN_HANDLE, "already destroyed");
  EXPECT_ERR(kvpush_abort((kvpush_engine *)hub, k), KVPUSH_ERR_UNKNOWN_HANDLE, "engine handle");
  EXPECT_ERR(kvpush_poll(d->engine, NULL, 0, NULL), KVPUSH_ERR_NULL, "`n`");
  EXPECT_ERR(kvpush_engine_listen_port(d->engine, NULL), KVPUSH_ERR_INVALID_ARGUMENT, "no side channel");
  size_t n = 1;
  CHECK(kvpush_poll(d->engine, NULL, 0, &n));
  EXPECT(n == 0);
}

/* Connects p and d through handshake bytes, as engines in different address spaces would. */
static void exchange_handshakes(worker *p, worker *d) {
  size_t len = 0;
  EXPECT(kvpush_engine_handshake(p->engine, NULL, 0, &len) == KVPUSH_ERR_BUFFER_TOO_SMALL);
  uint8_t *hp = malloc(len);
  CHECK(kvpush_engine_handshake(p->engine, hp, len, &len));
  CHECK(kvpush_engine_add_peer(d->engine, hp, len));
  free(hp);
  EXPECT(kvpush_engine_handshake(d->engine, NULL, 0, &len) == KVPUSH_ERR_BUFFER_TOO_SMALL);
  uint8_t *hd = malloc(len);
  CHECK(kvpush_engine_handshake(d->engine, hd, len, &len));
  CHECK(kvpush_engine_add_peer(p->engine, hd, len));
  free(hd);
}

static void run_loopback(void) {
  EXPECT(kvpush_abi_version() == KVPUSH_ABI_VERSION);
  printf("kvpush %s, ABI %u\n", kvpush_version(), kvpush_abi_version());
  kvpush_hub *hub = NULL;
  CHECK(kvpush_hub_create(&hub));
  worker p, d;
  create_loopback(&p, "prefill", KVPUSH_MODE_PUSH, hub, &HOST);
  create_loopback(&d, "decode", KVPUSH_MODE_PUSH, hub, &HOST);
  exchange_handshakes(&p, &d);

  push_requests(&p, &d, "prefill", 6, 0xC0FFEE);
  aborts(&p, &d);
  error_paths(hub, &p, &d);
  pull_request(hub, &HOST);
  layers_request(hub);

  /* Statistics as JSON. */
  size_t jlen = 0;
  EXPECT(kvpush_engine_stats_json(d.engine, NULL, 0, &jlen) == KVPUSH_ERR_BUFFER_TOO_SMALL);
  char *json = malloc(jlen + 1);
  CHECK(kvpush_engine_stats_json(d.engine, json, jlen + 1, &jlen));
  EXPECT(strlen(json) == jlen && strstr(json, "\"received\":6") != NULL);
  printf("stats ok: %.80s...\n", json);
  free(json);

  /* The hub may go before its engines. */
  CHECK(kvpush_hub_destroy(hub));
  EXPECT_ERR(kvpush_hub_destroy(hub), KVPUSH_ERR_UNKNOWN_HANDLE, "hub handle");
  push_requests(&p, &d, "prefill", 2, 0xD00D);
  destroy(&d);
  destroy(&p);
  printf("all C API checks passed\n");
}

static void run_nixl(void) {
  if (!kvpush_nixl_available()) {
    fprintf(stderr, "FAILED: NIXL is not available (LD_LIBRARY_PATH must hold libnixl_capi.so)\n");
    exit(1);
  }
  worker p, d;
  create_nixl(&p, "prefill");
  create_nixl(&d, "decode");
  uint16_t port = 0;
  CHECK(kvpush_engine_listen_port(p.engine, &port));
  EXPECT(port != 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
  CHECK(kvpush_engine_connect_addr(d.engine, addr));
  uint8_t hs[1];
  size_t len = 0;
  EXPECT(kvpush_engine_handshake(p.engine, hs, 0, &len) == KVPUSH_ERR_BUFFER_TOO_SMALL);
  EXPECT_ERR(kvpush_engine_add_peer(d.engine, hs, 1), KVPUSH_ERR_INVALID_ARGUMENT, "side channel");
  push_requests(&p, &d, "prefill", 4, 0xA11CE);
  destroy(&d);
  destroy(&p);
  printf("all NIXL checks passed (side channel port %u)\n", port);
}

#ifdef KVPUSH_TEST_NEURON
/* ---- neuron: framework memory -------------------------------------------------------------------
 * The test plays the serving framework as vllm-neuron's worker does: it sets NEURON_RT_VISIBLE_CORES
 * and NEURON_RT_MAP_HBM=1, starts the runtime (nrt_init) before kvpush exists, and allocates one
 * device tensor per KV region with libnrt; kvpush gets only the tensors' device addresses (never an
 * nrt_tensor_t*), through KVPUSH_LIBNRT the same library, attached to the framework's runtime. */

static void alloc_neuron(worker *w, const char *name) {
  for (int r = 0; r < REGIONS; r++) {
    char tensor_name[96];
    snprintf(tensor_name, sizeof tensor_name, "%s.model.layers.%d.self_attn.attn.%c", name, r / 2, r % 2 ? 'v' : 'k');
    nrt_tensor_t *t = NULL;
    EXPECT(nrt_tensor_allocate(NRT_TENSOR_PLACEMENT_DEVICE, 0, REGION_BYTES, tensor_name, &t) == NRT_SUCCESS);
    w->handles[r] = t;
    set_region(w, r, nrt_tensor_get_va(t)); /* the mapping NEURON_RT_MAP_HBM=1 asks for */
  }
}

static void free_neuron(worker *w) {
  for (int r = 0; r < REGIONS; r++) {
    nrt_tensor_t *t = w->handles[r];
    if (t != NULL) nrt_tensor_free(&t);
  }
}

static const memory NEURON = {"neuron", alloc_neuron, free_neuron};

/* Pushes `count` requests from a fresh P on `pm` to a fresh D on `dm`, every byte verified. */
static void push_pair(kvpush_hub *hub, const memory *pm, const memory *dm, int count, uint64_t id_hi) {
  worker p, d;
  create_loopback(&p, "prefill", KVPUSH_MODE_PUSH, hub, pm);
  create_loopback(&d, "decode", KVPUSH_MODE_PUSH, hub, dm);
  exchange_handshakes(&p, &d);
  push_requests(&p, &d, "prefill", count, id_hi);
  destroy(&d);
  destroy(&p);
}

static void run_neuron(const char *libnrt) {
  EXPECT(setenv("NEURON_RT_VISIBLE_CORES", "0", 1) == 0);
  EXPECT(setenv("NEURON_RT_MAP_HBM", "1", 1) == 0);
  EXPECT(setenv("KVPUSH_LIBNRT", libnrt, 1) == 0);
  EXPECT(nrt_init(NRT_FRAMEWORK_TYPE_PYTORCH, "2.8", "") == NRT_SUCCESS);
  kvpush_hub *hub = NULL;
  CHECK(kvpush_hub_create(&hub));

  /* kvpush owning the runtime is refused: the framework started it. */
  worker own;
  EXPECT(setenv("KVPUSH_NEURON_RUNTIME", "own", 1) == 0);
  own.mem = &NEURON;
  alloc_neuron(&own, "own");
  kvpush_engine_config cfg;
  CHECK(kvpush_engine_config_init(&cfg));
  cfg.engine_id = "own";
  cfg.transport = KVPUSH_TRANSPORT_LOOPBACK;
  cfg.hub = hub;
  cfg.device = "neuron";
  EXPECT_ERR(kvpush_engine_create(&cfg, &own.layout, &own.engine), KVPUSH_ERR_DEVICE, "KVPUSH_NEURON_RUNTIME=attach");
  EXPECT(unsetenv("KVPUSH_NEURON_RUNTIME") == 0);
  /* Memory the framework never allocated on the device: refused before anything is registered. */
  uint8_t *host = aligned_alloc(4096, REGION_BYTES);
  EXPECT(host != NULL);
  uint64_t saved = own.bases[REGIONS - 1];
  own.bases[REGIONS - 1] = (uint64_t)(uintptr_t)host;
  EXPECT_ERR(kvpush_engine_create(&cfg, &own.layout, &own.engine), KVPUSH_ERR_DEVICE,
             "libnrt does not map it as Neuron device memory");
  free(host);
  /* A tensor the framework freed: no longer mapped, refused too. */
  own.bases[REGIONS - 1] = saved;
  nrt_tensor_t *last = own.handles[REGIONS - 1];
  nrt_tensor_free(&last);
  own.handles[REGIONS - 1] = last; /* NULL now: free_neuron skips it */
  EXPECT_ERR(kvpush_engine_create(&cfg, &own.layout, &own.engine), KVPUSH_ERR_DEVICE, "libnrt does not map it");
  free_neuron(&own);

  push_pair(hub, &NEURON, &NEURON, 6, 0x4E52);
  pull_request(hub, &NEURON);
  /* Trainium P, host-memory D (the shape of Trainium P -> GPU D through host memory): P's KV in
   * Neuron device memory, D's in host memory, every byte verified on D. */
  push_pair(hub, &NEURON, &HOST, 4, 0x7E4);
  printf("mixed ok: Neuron P, host D\n");
  CHECK(kvpush_hub_destroy(hub));
  nrt_close();
  printf("all C API Neuron checks passed\n");
}
#endif

/* ---- bench: engine-thread time per request through the C ABI ------------------------------------
 * The same workload as `cargo bench --bench engine_thread` (16 layers, 1 KV head of 128, bf16,
 * 16-token blocks, requests of 64 tokens, registration first, one at a time with short pauses so
 * the writers are asleep when a call arrives), timing on this thread every kvpush call made for a
 * request: kvpush_blocks_allocated, kvpush_request_finished and each kvpush_poll that returns the
 * request's result. Empty polls are timed apart. */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double pct_us(uint64_t *v, size_t n, double q) {
  qsort(v, n, sizeof *v, cmp_u64);
  return (double)v[(size_t)((double)(n - 1) * q + 0.5)] / 1000.0;
}

#define B_LAYERS 16
#define B_REGIONS (2 * B_LAYERS)
#define B_BLOCKS 1024
#define B_PART ((size_t)16 * 128 * 2)

static kvpush_engine *bench_engine(const char *id, kvpush_hub *hub, uint8_t **mem, uint64_t *bases) {
  for (int r = 0; r < B_REGIONS; r++) {
    mem[r] = aligned_alloc(4096, B_BLOCKS * B_PART);
    EXPECT(mem[r] != NULL);
    memset(mem[r], 0, B_BLOCKS * B_PART);
    bases[r] = (uint64_t)(uintptr_t)mem[r];
  }
  kvpush_layout l;
  CHECK(kvpush_layout_init(&l));
  l.total_layers = B_LAYERS;
  l.kv_heads = 1;
  l.head_dim = 128;
  l.dtype = KVPUSH_DTYPE_BF16;
  l.block_tokens = 16;
  l.num_blocks = B_BLOCKS;
  l.region_bases = bases;
  l.num_regions = B_REGIONS;
  kvpush_engine_config c;
  CHECK(kvpush_engine_config_init(&c));
  c.engine_id = id;
  c.hub = hub;
  c.device = "host";
  kvpush_engine *e = NULL;
  CHECK(kvpush_engine_create(&c, &l, &e));
  return e;
}

static void run_bench(size_t n) {
  kvpush_hub *hub = NULL;
  CHECK(kvpush_hub_create(&hub));
  uint8_t *pm[B_REGIONS], *dm[B_REGIONS];
  uint64_t pb[B_REGIONS], db[B_REGIONS];
  kvpush_engine *p = bench_engine("p", hub, pm, pb), *d = bench_engine("d", hub, dm, db);
  CHECK(kvpush_engine_connect(d, p));
  uint64_t *p_side = calloc(n, 8), *d_side = calloc(n, 8), *total = calloc(n, 8), *enq_p = calloc(n, 8),
           *enq_d = calloc(n, 8), *drains = calloc(2 * n, 8), *empty = calloc(64 * n, 8);
  size_t ndrains = 0, nempty = 0;
  kvpush_completion out[4];
  for (size_t i = 0; i < n; i++) {
    kvpush_key key = {0, i + 1, 1};
    uint32_t ids[4];
    for (uint32_t b = 0; b < 4; b++) ids[b] = (uint32_t)((i * 4 + b) % B_BLOCKS);
    kvpush_block_list g = {ids, 4};
    uint64_t t = now_ns();
    CHECK(kvpush_blocks_allocated(d, key, "p", &g, 1, 64));
    uint64_t d_ns = now_ns() - t;
    enq_d[i] = d_ns;
    sleep_us(200);
    t = now_ns();
    CHECK(kvpush_request_finished(p, key, &g, 1, 64));
    uint64_t p_ns = now_ns() - t;
    enq_p[i] = p_ns;
    int sent = 0, received = 0;
    uint64_t deadline = now_ns() + 10000000000u;
    while (!(sent && received)) {
      EXPECT(now_ns() < deadline);
      for (int side = 0; side < 2; side++) {
        size_t got = 0;
        t = now_ns();
        CHECK(kvpush_poll(side == 0 ? p : d, out, 4, &got));
        uint64_t ns = now_ns() - t;
        if (got == 0) {
          if (nempty < 64 * n) empty[nempty++] = ns;
          continue;
        }
        drains[ndrains++] = ns;
        for (size_t k = 0; k < got; k++) {
          EXPECT(out[k].key.id_lo == i + 1);
          if (out[k].outcome == KVPUSH_OUTCOME_SENT) sent = 1;
          else if (out[k].outcome == KVPUSH_OUTCOME_RECEIVED) received = 1;
          else EXPECT(!"unexpected outcome");
        }
        if (side == 0) p_ns += ns;
        else d_ns += ns;
      }
      sleep_us(20);
    }
    p_side[i] = p_ns;
    d_side[i] = d_ns;
    total[i] = p_ns + d_ns;
  }
  printf("engine-thread time per request through the C ABI, push, loopback, %zu requests of 64 tokens x 16 layers:\n",
         n);
  printf("  producer (request_finished + polls)    p50 %6.2f us   p99 %6.2f us   max %8.2f us\n",
         pct_us(p_side, n, 0.5), pct_us(p_side, n, 0.99), pct_us(p_side, n, 1.0));
  printf("  consumer (blocks_allocated + polls)    p50 %6.2f us   p99 %6.2f us   max %8.2f us\n",
         pct_us(d_side, n, 0.5), pct_us(d_side, n, 0.99), pct_us(d_side, n, 1.0));
  printf("  both sides                             p50 %6.2f us   p99 %6.2f us   max %8.2f us\n",
         pct_us(total, n, 0.5), pct_us(total, n, 0.99), pct_us(total, n, 1.0));
  printf("  request_finished alone p50 %.2f / p99 %.2f us; blocks_allocated alone p50 %.2f / p99 %.2f us; a poll "
         "with results p50 %.2f / p99 %.2f us\n",
         pct_us(enq_p, n, 0.5), pct_us(enq_p, n, 0.99), pct_us(enq_d, n, 0.5), pct_us(enq_d, n, 0.99),
         pct_us(drains, ndrains, 0.5), pct_us(drains, ndrains, 0.99));
  printf("  empty poll                             p50 %6.3f us   p99 %6.3f us\n", pct_us(empty, nempty, 0.5),
         pct_us(empty, nempty, 0.99));
  CHECK(kvpush_engine_destroy(d));
  CHECK(kvpush_engine_destroy(p));
  CHECK(kvpush_hub_destroy(hub));
  for (int r = 0; r < B_REGIONS; r++) {
    free(pm[r]);
    free(dm[r]);
  }
  free(p_side), free(d_side), free(total), free(enq_p), free(enq_d), free(drains), free(empty);
  printf("bench done\n");
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "loopback";
  if (strcmp(mode, "loopback") == 0) {
    run_loopback();
  } else if (strcmp(mode, "nixl") == 0) {
    run_nixl();
#ifdef KVPUSH_TEST_NEURON
  } else if (strcmp(mode, "neuron") == 0 && argc > 2) {
    run_neuron(argv[2]);
#endif
  } else if (strcmp(mode, "bench") == 0) {
    run_bench(argc > 2 ? (size_t)strtoul(argv[2], NULL, 10) : 5000);
  } else {
    fprintf(stderr, "usage: %s [loopback|nixl|bench [N]|neuron LIBNRT]\n", argv[0]);
    return 2;
  }
  return 0;
}
