/* kvpush's declaration of the Neuron runtime's version query, written from AWS's public API
 * reference (nrt_version.h); not the SDK's header. See nrt.h beside this file. */
#ifndef KVPUSH_NRT_VERSION_SUBSET_H
#define KVPUSH_NRT_VERSION_SUBSET_H

#include <stddef.h>
#include <stdint.h>

#include "nrt/nrt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RT_VERSION_DETAIL_LEN 128
#define GIT_HASH_LEN 64

typedef struct nrt_version {
    uint64_t rt_major;
    uint64_t rt_minor;
    uint64_t rt_patch;
    uint64_t rt_maintenance;
    char rt_detail[RT_VERSION_DETAIL_LEN];
    char git_hash[GIT_HASH_LEN];
} nrt_version_t;

/* Fills the first `size` bytes of `ver`. */
NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* KVPUSH_NRT_VERSION_SUBSET_H */
