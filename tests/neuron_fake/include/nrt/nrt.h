/* kvpush's declarations of the part of the Neuron runtime (libnrt) API that kvpush uses.
 *
 * Written for kvpush from AWS's public Neuron runtime API reference (nrt.h); this is NOT the SDK's
 * header and holds only what kvpush needs. Two things use it: the fake libnrt the tests build
 * (tests/neuron_fake/fake_nrt.c), and the `bindgen` feature of neuron-sys when no SDK is installed
 * (NEURON_SDK_INCLUDE=tests/neuron_fake/include), which is how neuron/neuron-sys/src/bindings.rs was
 * generated here. On a machine with the SDK, regenerate from the real headers and compare.
 */
#ifndef KVPUSH_NRT_SUBSET_H
#define KVPUSH_NRT_SUBSET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status of every libnrt call; 0 is success. */
typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5,
    NRT_HW_ERROR = 6,
    NRT_QUEUE_FULL = 7,
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
    NRT_EXEC_BAD_INPUT = 1002,
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005,
    NRT_COLL_PENDING = 1100,
} NRT_STATUS;

/* Opaque tensor handle. */
typedef struct nrt_tensor nrt_tensor_t;

/* Where a tensor's memory lives. */
typedef enum {
    NRT_TENSOR_PLACEMENT_DEVICE,
    NRT_TENSOR_PLACEMENT_HOST,
    NRT_TENSOR_PLACEMENT_VIRTUAL,
} nrt_tensor_placement_t;

/* Who calls nrt_init. */
typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0,
    NRT_FRAMEWORK_TYPE_NO_FW = 1,
    NRT_FRAMEWORK_TYPE_TENSORFLOW,
    NRT_FRAMEWORK_TYPE_PYTORCH,
    NRT_FRAMEWORK_TYPE_MXNET,
    NRT_FRAMEWORK_TYPE_PRECHECK,
} nrt_framework_type_t;

/* Runtime lifetime. */
NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version);
void nrt_close(void);

/* NeuronCores of the instance and those visible to this process (callable before nrt_init). */
NRT_STATUS nrt_get_total_nc_count(uint32_t *nc_count);
NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count);

/* Tensors: allocation (vnc -1 for host placement), free (sets *tensor to NULL), copies, size,
 * the virtual address of the memory (NULL when it is not mapped into the process), memset. */
NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t tensor_placement, int vnc, size_t size, const char *name,
                               nrt_tensor_t **tensor);
void nrt_tensor_free(nrt_tensor_t **tensor);
NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size);
NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size);
size_t nrt_tensor_get_size(const nrt_tensor_t *tensor);
void *nrt_tensor_get_va(const nrt_tensor_t *tensor);
NRT_STATUS nrt_tensor_memset(nrt_tensor_t *tensor, uint64_t offset, int value, size_t size);

/* EFA peer-direct: the dma-buf fd of a registered device range, and the PCI BDF of the EFA device
 * attached to the Neuron device holding `va` (len: in, buffer size with the NUL; out, string length). */
NRT_STATUS nrt_get_dmabuf_fd(uint64_t va, uint64_t size, int *fd);
NRT_STATUS nrt_get_attached_efa_bdf(const void *va, char *efa_bdf, size_t *len);

#ifdef __cplusplus
}
#endif

#endif /* KVPUSH_NRT_SUBSET_H */
