/* A fake libnrt for kvpush's tests: the libnrt functions kvpush uses, over host memory.
 *
 * Built by tests/neuron.rs with `cc -shared -fPIC` into a temporary directory (no SONAME, so it is
 * only ever found by path and never mistaken for the real libnrt.so.1). Each test loads its own copy
 * of the file, so every test has its own "runtime" state.
 *
 * Behaviour, as the real runtime documents it: tensor calls before nrt_init (or after nrt_close)
 * answer NRT_UNINITIALIZED / NRT_CLOSED; a second nrt_init without a close fails; device tensors
 * live on a NeuronCore in [0, core count); nrt_tensor_get_va returns the memory's address (here host
 * memory from mmap) unless device memory is "not mapped" (the NEURON_RT_MAP_HBM=0 case), when it
 * returns NULL; nrt_get_dmabuf_fd accepts only ranges inside a live device tensor and returns a new
 * fd (a memfd stands in for the dma-buf).
 *
 * Knobs (integers): read from the environment when the library is loaded, and settable at run time
 * with fake_nrt_set(name, value):
 *   FAKE_NRT_FAIL_INIT=1      nrt_init fails with NRT_FAILURE
 *   FAKE_NRT_REINIT_OK=1      a second nrt_init without a close succeeds (whether the real runtime's
 *                             does is unverified; kvpush must not rely on it failing)
 *   FAKE_NRT_FAIL_DMABUF=1    nrt_get_dmabuf_fd fails with NRT_FAILURE
 *   FAKE_NRT_NO_MAP_HBM=1     nrt_tensor_get_va returns NULL for device tensors
 *   FAKE_NRT_FAIL_ALLOCS=n    the next n device allocations fail with NRT_RESOURCE
 *   FAKE_NRT_NC_COUNT=n       NeuronCores of the instance (default 2)
 *   FAKE_NRT_VISIBLE_NC=n     NeuronCores visible to the process (default: all)
 * Counters, read with fake_nrt_get(name): init_calls, close_calls, initialized, allocs, frees,
 * live_tensors, live_bytes, reads, writes, memsets, dmabuf_calls.
 *
 * Build variants: -DFAKE_NRT_NO_DMABUF leaves out nrt_get_dmabuf_fd (an optional symbol);
 * -DFAKE_NRT_NO_TENSOR_FREE leaves out nrt_tensor_free (a required one).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nrt/nrt.h"
#include "nrt/nrt_version.h"

#define EXPORT __attribute__((visibility("default")))
#define TENSOR_MAGIC 0x6e727454u /* "nrtT" */

struct nrt_tensor {
    uint32_t magic;
    nrt_tensor_placement_t placement;
    int core;
    size_t size;
    unsigned char *mem;
    size_t mapped; /* bytes mapped at mem (size rounded up to a page) */
    struct nrt_tensor *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct nrt_tensor *tensors; /* every live tensor */

static long knob_fail_init, knob_reinit_ok, knob_fail_dmabuf, knob_no_map_hbm, knob_fail_allocs;
static long knob_nc_count = 2, knob_visible_nc = -1;

static long init_calls, close_calls, initialized, ever_closed;
static long allocs, frees, live_tensors, live_bytes, reads, writes, memsets, dmabuf_calls;

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return fallback;
    return strtol(v, NULL, 10);
}

__attribute__((constructor)) static void fake_nrt_load(void) {
    knob_fail_init = env_long("FAKE_NRT_FAIL_INIT", 0);
    knob_reinit_ok = env_long("FAKE_NRT_REINIT_OK", 0);
    knob_fail_dmabuf = env_long("FAKE_NRT_FAIL_DMABUF", 0);
    knob_no_map_hbm = env_long("FAKE_NRT_NO_MAP_HBM", 0);
    knob_fail_allocs = env_long("FAKE_NRT_FAIL_ALLOCS", 0);
    knob_nc_count = env_long("FAKE_NRT_NC_COUNT", 2);
    knob_visible_nc = env_long("FAKE_NRT_VISIBLE_NC", -1);
}

/* ---- test control ---- */

static long *knob(const char *name) {
    if (strcmp(name, "FAKE_NRT_FAIL_INIT") == 0) return &knob_fail_init;
    if (strcmp(name, "FAKE_NRT_REINIT_OK") == 0) return &knob_reinit_ok;
    if (strcmp(name, "FAKE_NRT_FAIL_DMABUF") == 0) return &knob_fail_dmabuf;
    if (strcmp(name, "FAKE_NRT_NO_MAP_HBM") == 0) return &knob_no_map_hbm;
    if (strcmp(name, "FAKE_NRT_FAIL_ALLOCS") == 0) return &knob_fail_allocs;
    if (strcmp(name, "FAKE_NRT_NC_COUNT") == 0) return &knob_nc_count;
    if (strcmp(name, "FAKE_NRT_VISIBLE_NC") == 0) return &knob_visible_nc;
    return NULL;
}

/* Sets a knob; returns 0, or -1 for an unknown name. */
EXPORT int fake_nrt_set(const char *name, long value) {
    pthread_mutex_lock(&lock);
    long *k = knob(name);
    if (k != NULL) *k = value;
    pthread_mutex_unlock(&lock);
    return k == NULL ? -1 : 0;
}

/* Reads a counter or a knob; -1 for an unknown name. */
EXPORT long fake_nrt_get(const char *name) {
    long v = -1;
    pthread_mutex_lock(&lock);
    long *k = knob(name);
    if (k != NULL) v = *k;
    else if (strcmp(name, "init_calls") == 0) v = init_calls;
    else if (strcmp(name, "close_calls") == 0) v = close_calls;
    else if (strcmp(name, "initialized") == 0) v = initialized;
    else if (strcmp(name, "allocs") == 0) v = allocs;
    else if (strcmp(name, "frees") == 0) v = frees;
    else if (strcmp(name, "live_tensors") == 0) v = live_tensors;
    else if (strcmp(name, "live_bytes") == 0) v = live_bytes;
    else if (strcmp(name, "reads") == 0) v = reads;
    else if (strcmp(name, "writes") == 0) v = writes;
    else if (strcmp(name, "memsets") == 0) v = memsets;
    else if (strcmp(name, "dmabuf_calls") == 0) v = dmabuf_calls;
    pthread_mutex_unlock(&lock);
    return v;
}

/* ---- helpers (called with the lock held) ---- */

static NRT_STATUS not_running(void) { return ever_closed ? NRT_CLOSED : NRT_UNINITIALIZED; }

static long visible(void) { return knob_visible_nc < 0 ? knob_nc_count : knob_visible_nc; }

/* The live tensor `t` points to, or NULL: handles are checked, never trusted. */
static struct nrt_tensor *find(const nrt_tensor_t *t) {
    for (struct nrt_tensor *x = tensors; x != NULL; x = x->next)
        if (x == t && x->magic == TENSOR_MAGIC) return x;
    return NULL;
}

/* The live device tensor whose memory holds [va, va + size), or NULL. */
static struct nrt_tensor *find_range(uint64_t va, uint64_t size) {
    for (struct nrt_tensor *x = tensors; x != NULL; x = x->next) {
        uint64_t start = (uint64_t)(uintptr_t)x->mem;
        if (x->placement == NRT_TENSOR_PLACEMENT_DEVICE && va >= start && size <= x->size && va - start <= x->size - size)
            return x;
    }
    return NULL;
}

static int in_range(const struct nrt_tensor *x, size_t offset, size_t size) {
    return offset <= x->size && size <= x->size - offset;
}

/* ---- the libnrt API ---- */

EXPORT NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    (void)fw_version;
    (void)fal_version;
    NRT_STATUS s = NRT_SUCCESS;
    pthread_mutex_lock(&lock);
    init_calls++;
    if (knob_fail_init || (initialized && !knob_reinit_ok) || framework == NRT_FRAMEWORK_TYPE_INVALID) s = NRT_FAILURE;
    else initialized = 1;
    pthread_mutex_unlock(&lock);
    return s;
}

EXPORT void nrt_close(void) {
    pthread_mutex_lock(&lock);
    close_calls++;
    initialized = 0;
    ever_closed = 1;
    pthread_mutex_unlock(&lock);
}

EXPORT NRT_STATUS nrt_get_total_nc_count(uint32_t *nc_count) {
    if (nc_count == NULL) return NRT_INVALID;
    pthread_mutex_lock(&lock);
    *nc_count = (uint32_t)knob_nc_count;
    pthread_mutex_unlock(&lock);
    return NRT_SUCCESS;
}

EXPORT NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count) {
    if (nc_count == NULL) return NRT_INVALID;
    pthread_mutex_lock(&lock);
    *nc_count = (uint32_t)visible();
    pthread_mutex_unlock(&lock);
    return NRT_SUCCESS;
}

EXPORT NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size, const char *name,
                                      nrt_tensor_t **tensor) {
    (void)name;
    if (tensor == NULL || size == 0) return NRT_INVALID;
    if (placement != NRT_TENSOR_PLACEMENT_DEVICE && placement != NRT_TENSOR_PLACEMENT_HOST) return NRT_INVALID;
    pthread_mutex_lock(&lock);
    NRT_STATUS s = NRT_SUCCESS;
    if (!initialized) s = not_running();
    else if (placement == NRT_TENSOR_PLACEMENT_DEVICE && (vnc < 0 || vnc >= visible())) s = NRT_INVALID;
    else if (placement == NRT_TENSOR_PLACEMENT_DEVICE && knob_fail_allocs > 0) {
        knob_fail_allocs--;
        s = NRT_RESOURCE;
    }
    pthread_mutex_unlock(&lock);
    if (s != NRT_SUCCESS) return s;

    long page = sysconf(_SC_PAGESIZE);
    size_t mapped = (size + (size_t)page - 1) / (size_t)page * (size_t)page;
    void *mem = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return NRT_RESOURCE;
    struct nrt_tensor *t = calloc(1, sizeof *t);
    if (t == NULL) {
        munmap(mem, mapped);
        return NRT_RESOURCE;
    }
    t->magic = TENSOR_MAGIC;
    t->placement = placement;
    t->core = placement == NRT_TENSOR_PLACEMENT_DEVICE ? vnc : -1;
    t->size = size;
    t->mem = mem;
    t->mapped = mapped;
    pthread_mutex_lock(&lock);
    t->next = tensors;
    tensors = t;
    allocs++;
    live_tensors++;
    live_bytes += (long)size;
    pthread_mutex_unlock(&lock);
    *tensor = t;
    return NRT_SUCCESS;
}

#ifndef FAKE_NRT_NO_TENSOR_FREE
EXPORT void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (tensor == NULL || *tensor == NULL) return;
    pthread_mutex_lock(&lock);
    struct nrt_tensor **link = &tensors;
    while (*link != NULL && *link != *tensor) link = &(*link)->next;
    struct nrt_tensor *t = *link;
    if (t != NULL) {
        *link = t->next;
        frees++;
        live_tensors--;
        live_bytes -= (long)t->size;
    }
    pthread_mutex_unlock(&lock);
    if (t != NULL) {
        t->magic = 0;
        munmap(t->mem, t->mapped);
        free(t);
    }
    *tensor = NULL;
}
#endif

/* Under the lock: the tensor that a read or write of `size` bytes at `offset` through `buf` copies
 * to or from (in *t), or the status refusing the copy. */
static NRT_STATUS copy_target(const nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size,
                              struct nrt_tensor **t) {
    *t = find(tensor);
    if (!initialized) return not_running();
    if (*t == NULL || buf == NULL || !in_range(*t, offset, size)) return NRT_INVALID;
    return NRT_SUCCESS;
}

EXPORT NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t;
    NRT_STATUS s = copy_target(tensor, buf, offset, size, &t);
    if (s == NRT_SUCCESS) {
        memcpy(buf, t->mem + offset, size);
        reads++;
    }
    pthread_mutex_unlock(&lock);
    return s;
}

EXPORT NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t;
    NRT_STATUS s = copy_target(tensor, buf, offset, size, &t);
    if (s == NRT_SUCCESS) {
        memcpy(t->mem + offset, buf, size);
        writes++;
    }
    pthread_mutex_unlock(&lock);
    return s;
}

EXPORT NRT_STATUS nrt_tensor_memset(nrt_tensor_t *tensor, uint64_t offset, int value, size_t size) {
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t = find(tensor);
    NRT_STATUS s = NRT_SUCCESS;
    if (!initialized) s = not_running();
    else if (t == NULL || !in_range(t, (size_t)offset, size)) s = NRT_INVALID;
    else {
        memset(t->mem + offset, value, size);
        memsets++;
    }
    pthread_mutex_unlock(&lock);
    return s;
}

EXPORT size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) {
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t = find(tensor);
    size_t n = t == NULL ? 0 : t->size;
    pthread_mutex_unlock(&lock);
    return n;
}

EXPORT void *nrt_tensor_get_va(const nrt_tensor_t *tensor) {
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t = find(tensor);
    void *va = NULL;
    if (t != NULL && !(t->placement == NRT_TENSOR_PLACEMENT_DEVICE && knob_no_map_hbm)) va = t->mem;
    pthread_mutex_unlock(&lock);
    return va;
}

#ifndef FAKE_NRT_NO_DMABUF
EXPORT NRT_STATUS nrt_get_dmabuf_fd(uint64_t va, uint64_t size, int *fd) {
    if (fd == NULL || size == 0) return NRT_INVALID;
    pthread_mutex_lock(&lock);
    dmabuf_calls++;
    NRT_STATUS s = NRT_SUCCESS;
    if (!initialized) s = not_running();
    else if (knob_fail_dmabuf) s = NRT_FAILURE;
    else if (find_range(va, size) == NULL) s = NRT_INVALID;
    pthread_mutex_unlock(&lock);
    if (s != NRT_SUCCESS) return s;
    int f = memfd_create("fake-nrt-dmabuf", MFD_CLOEXEC);
    if (f < 0) return NRT_RESOURCE;
    *fd = f;
    return NRT_SUCCESS;
}
#endif

EXPORT NRT_STATUS nrt_get_attached_efa_bdf(const void *va, char *efa_bdf, size_t *len) {
    if (efa_bdf == NULL || len == NULL) return NRT_INVALID;
    pthread_mutex_lock(&lock);
    struct nrt_tensor *t = initialized ? find_range((uint64_t)(uintptr_t)va, 1) : NULL;
    int core = t == NULL ? -1 : t->core;
    pthread_mutex_unlock(&lock);
    if (core < 0) return NRT_FAILURE;
    char bdf[32];
    /* Two NeuronCores per Neuron device, one EFA device per Neuron device. */
    int n = snprintf(bdf, sizeof bdf, "0000:%02x:1c.0", 0x10 + core / 2);
    if ((size_t)n + 1 > *len) return NRT_RESOURCE;
    memcpy(efa_bdf, bdf, (size_t)n + 1);
    *len = (size_t)n;
    return NRT_SUCCESS;
}

EXPORT NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size) {
    if (ver == NULL || size > sizeof *ver) return NRT_INVALID;
    nrt_version_t v;
    memset(&v, 0, sizeof v);
    v.rt_major = 2;
    v.rt_minor = 99;
    v.rt_patch = 7;
    v.rt_maintenance = 0;
    snprintf(v.rt_detail, sizeof v.rt_detail, "fake libnrt for kvpush tests");
    snprintf(v.git_hash, sizeof v.git_hash, "0123456789abcdef");
    memcpy(ver, &v, size);
    return NRT_SUCCESS;
}
