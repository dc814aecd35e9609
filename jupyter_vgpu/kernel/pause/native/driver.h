/*
 * The CUDA driver as the library sees it: the subset of cuda.h it needs, and the one
 * table of every driver entry point it calls, wraps or holds (VGPU_DRIVER_ENTRIES).
 *
 * No CUDA header is needed to build the library: the driver types used are declared
 * here; their layout is the stable ABI of cuda.h (CUDA 11.2 and later). Names in the
 * table are the driver's exported symbols (cuda.h 12 and 13): the _v2 forms the headers
 * map the plain names to, and the per-thread default stream forms (_ptds, _ptsz).
 *
 * The driver stand-in of the tests (tests/native/fake_cuda.c) includes this header too,
 * so the compiler holds its functions to the same signatures.
 */
#ifndef JUPYTER_VGPU_DRIVER_H
#define JUPYTER_VGPU_DRIVER_H

#include <stddef.h>
#include <stdint.h>

/* ---- the driver API subset (cuda.h) ------------------------------------------------ */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef void *CUarray;
typedef unsigned int cuuint32_t;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes; /* none 0, POSIX file descriptor 1 */
  CUmemLocation location;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1, ordinal */
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct { char reserved[64]; } CUipcMemHandle;

/* The driver's errors the library returns or tests itself (name, number). Their words
 * come from the driver (cuGetErrorString), never from here. */
#define VGPU_CUDA_ERRORS(X)           \
  X(CUDA_SUCCESS, 0)                  \
  X(CUDA_ERROR_INVALID_VALUE, 1)      \
  X(CUDA_ERROR_OUT_OF_MEMORY, 2)      \
  X(CUDA_ERROR_NOT_INITIALIZED, 3)    \
  X(CUDA_ERROR_INVALID_CONTEXT, 201)  \
  X(CUDA_ERROR_MAP_FAILED, 205)       \
  X(CUDA_ERROR_OPERATING_SYSTEM, 304) \
  X(CUDA_ERROR_INVALID_HANDLE, 400)   \
  X(CUDA_ERROR_ILLEGAL_STATE, 401)    \
  X(CUDA_ERROR_NOT_FOUND, 500)        \
  X(CUDA_ERROR_NOT_READY, 600)        \
  X(CUDA_ERROR_NOT_SUPPORTED, 801)

#define VGPU_ERROR_ENUM(name, value) name = value,
enum { VGPU_CUDA_ERRORS(VGPU_ERROR_ENUM) };
#undef VGPU_ERROR_ENUM

#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_EVENT_DISABLE_TIMING 2
#define CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE 10
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT 14
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH 6
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_MEMPOOL_ATTR_USED_MEM_HIGH 8

/* ---- every driver entry point the library calls, wraps or holds -------------------- */
/*
 * One row each, in one of three kinds, each a macro the user of the table passes:
 *
 *   CALLED(name, need, params)  the library calls the driver's; a program gets the
 *                               driver's own (a stub while suspended: stubs.S)
 *   OURS(name, need, params)    the library's own form (interpose.c) stands for it
 *   HELD(name, params, args)    the library's own form is the gate's hold around the
 *                               driver's (made from the row in held.c): it reads or
 *                               writes device memory or puts work on the GPU
 *
 * need: 1 when the library cannot work without the entry point (the driver is then
 * taken as missing); any other that the driver lacks stays NULL and is never handed out.
 * From the table come the pointers to the driver's functions (Driver drv, resolved when
 * libcuda is loaded: vmm.c), the prototypes of the library's own forms (vmm.h), the held
 * forms (held.c), and the table that hands the library's forms out (interpose.c).
 */
#define P_LAUNCH CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm
#define A_LAUNCH f, gx, gy, gz, bx, by, bz, shm

#define VGPU_DRIVER_ENTRIES(CALLED, OURS, HELD)                                                                       \
  CALLED(cuInit, 1, (unsigned int flags))                                                                             \
  CALLED(cuDeviceGet, 1, (CUdevice *dev, int ordinal))                                                                \
  CALLED(cuDeviceGetAttribute, 0, (int *value, int attr, CUdevice dev))                                               \
  CALLED(cuDeviceGetDefaultMemPool, 0, (CUmemoryPool *pool, CUdevice dev))                                            \
  CALLED(cuDeviceGetMemPool, 0, (CUmemoryPool *pool, CUdevice dev))                                                   \
  CALLED(cuCtxGetCurrent, 1, (CUcontext *ctx))                                                                        \
  CALLED(cuCtxSetCurrent, 1, (CUcontext ctx))                                                                         \
  CALLED(cuCtxGetDevice, 1, (CUdevice *dev))                                                                          \
  CALLED(cuCtxSynchronize, 1, (void))                                                                                 \
  CALLED(cuDevicePrimaryCtxRetain, 1, (CUcontext *ctx, CUdevice dev))                                                 \
  CALLED(cuMemGetAllocationGranularity, 1, (size_t *granularity, const CUmemAllocationProp *prop, int option))        \
  CALLED(cuMemAddressReserve, 1, (CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,                      \
                                  unsigned long long flags))                                                          \
  CALLED(cuMemAddressFree, 1, (CUdeviceptr ptr, size_t size))                                                         \
  CALLED(cuEventCreate, 0, (CUevent *event, unsigned int flags))                                                      \
  CALLED(cuEventRecord, 0, (CUevent event, CUstream stream))                                                          \
  CALLED(cuEventRecord_ptsz, 0, (CUevent event, CUstream stream))                                                     \
  CALLED(cuEventQuery, 0, (CUevent event))                                                                            \
  CALLED(cuEventDestroy_v2, 0, (CUevent event))                                                                       \
  CALLED(cuStreamIsCapturing, 0, (CUstream stream, int *status))                                                      \
  CALLED(cuStreamIsCapturing_ptsz, 0, (CUstream stream, int *status))                                                 \
  CALLED(cuGetErrorName, 0, (CUresult error, const char **name))                                                      \
  CALLED(cuGetErrorString, 0, (CUresult error, const char **text))                                                    \
  OURS(cuMemCreate, 1, (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,           \
                        unsigned long long flags))                                                                    \
  OURS(cuMemRelease, 1, (CUmemGenericAllocationHandle handle))                                                        \
  OURS(cuMemMap, 1, (CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle handle,                 \
                     unsigned long long flags))                                                                       \
  OURS(cuMemUnmap, 1, (CUdeviceptr va, size_t size))                                                                  \
  OURS(cuMemSetAccess, 1, (CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count))                   \
  OURS(cuMemAlloc_v2, 1, (CUdeviceptr *dptr, size_t size))                                                            \
  OURS(cuMemFree_v2, 1, (CUdeviceptr dptr))                                                                           \
  OURS(cuMemRetainAllocationHandle, 0, (CUmemGenericAllocationHandle *handle, void *addr))                            \
  OURS(cuMemGetAllocationPropertiesFromHandle, 0, (CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle))   \
  OURS(cuMemExportToShareableHandle, 0, (void *out, CUmemGenericAllocationHandle handle, int type,                    \
                                         unsigned long long flags))                                                   \
  OURS(cuMemImportFromShareableHandle, 0, (CUmemGenericAllocationHandle *handle, void *os_handle, int type))          \
  OURS(cuMemAllocPitch_v2, 0, (CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem))     \
  OURS(cuMemGetAddressRange_v2, 0, (CUdeviceptr *base, size_t *size, CUdeviceptr dptr))                               \
  OURS(cuMemAllocManaged, 0, (CUdeviceptr *dptr, size_t size, unsigned int flags))                                    \
  OURS(cuMemAllocAsync, 0, (CUdeviceptr *dptr, size_t size, CUstream stream))                                         \
  OURS(cuMemAllocAsync_ptsz, 0, (CUdeviceptr *dptr, size_t size, CUstream stream))                                    \
  OURS(cuMemFreeAsync, 0, (CUdeviceptr dptr, CUstream stream))                                                        \
  OURS(cuMemFreeAsync_ptsz, 0, (CUdeviceptr dptr, CUstream stream))                                                   \
  OURS(cuMemAllocFromPoolAsync, 0, (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream))              \
  OURS(cuMemAllocFromPoolAsync_ptsz, 0, (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream))         \
  OURS(cuMemPoolTrimTo, 0, (CUmemoryPool pool, size_t keep))                                                          \
  OURS(cuMemPoolGetAttribute, 0, (CUmemoryPool pool, int attr, void *value))                                          \
  OURS(cuMemPoolSetAttribute, 0, (CUmemoryPool pool, int attr, void *value))                                          \
  OURS(cuPointerGetAttribute, 0, (void *data, int attr, CUdeviceptr ptr))                                             \
  OURS(cuPointerGetAttributes, 0, (unsigned int n, int *attrs, void **data, CUdeviceptr ptr))                         \
  OURS(cuIpcGetMemHandle, 0, (CUipcMemHandle *handle, CUdeviceptr dptr))                                              \
  OURS(cuIpcOpenMemHandle, 0, (CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags))                         \
  OURS(cuIpcOpenMemHandle_v2, 0, (CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags))                      \
  OURS(cuIpcCloseMemHandle, 0, (CUdeviceptr dptr))                                                                    \
  OURS(cuGetProcAddress, 0, (const char *symbol, void **pfn, int version, cuuint64_t flags))                          \
  OURS(cuGetProcAddress_v2, 0, (const char *symbol, void **pfn, int version, cuuint64_t flags, int *status))          \
  HELD(cuLaunchKernel, (P_LAUNCH, CUstream s, void **params, void **extra), (A_LAUNCH, s, params, extra))             \
  HELD(cuLaunchKernel_ptsz, (P_LAUNCH, CUstream s, void **params, void **extra), (A_LAUNCH, s, params, extra))        \
  HELD(cuLaunchKernelEx, (const void *config, CUfunction f, void **params, void **extra), (config, f, params, extra)) \
  HELD(cuLaunchKernelEx_ptsz, (const void *config, CUfunction f, void **params, void **extra),                        \
       (config, f, params, extra))                                                                                    \
  HELD(cuLaunchCooperativeKernel, (P_LAUNCH, CUstream s, void **params), (A_LAUNCH, s, params))                       \
  HELD(cuLaunchCooperativeKernel_ptsz, (P_LAUNCH, CUstream s, void **params), (A_LAUNCH, s, params))                  \
  HELD(cuLaunchCooperativeKernelMultiDevice, (void *list, unsigned n, unsigned flags), (list, n, flags))              \
  HELD(cuLaunch, (CUfunction f), (f))                                                                                 \
  HELD(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h))                                                         \
  HELD(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s))                                     \
  HELD(cuGraphLaunch, (CUgraphExec g, CUstream s), (g, s))                                                            \
  HELD(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s))                                                       \
  HELD(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                                 \
  HELD(cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                            \
  HELD(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))                           \
  HELD(cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))                      \
  HELD(cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))         \
  HELD(cuMemcpyPeer_ptds, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))    \
  HELD(cuMemcpyPeerAsync, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),          \
       (d, dc, s, sc, n, st))                                                                                         \
  HELD(cuMemcpyPeerAsync_ptsz, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),     \
       (d, dc, s, sc, n, st))                                                                                         \
  HELD(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *h, size_t n), (d, h, n))                                          \
  HELD(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *h, size_t n), (d, h, n))                                     \
  HELD(cuMemcpyDtoH_v2, (void *h, CUdeviceptr s, size_t n), (h, s, n))                                                \
  HELD(cuMemcpyDtoH_v2_ptds, (void *h, CUdeviceptr s, size_t n), (h, s, n))                                           \
  HELD(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                          \
  HELD(cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                     \
  HELD(cuMemcpyDtoA_v2, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n))                                 \
  HELD(cuMemcpyDtoA_v2_ptds, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n))                            \
  HELD(cuMemcpyAtoD_v2, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n))                                 \
  HELD(cuMemcpyAtoD_v2_ptds, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n))                            \
  HELD(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *h, size_t n, CUstream st), (d, h, n, st))                    \
  HELD(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *h, size_t n, CUstream st), (d, h, n, st))               \
  HELD(cuMemcpyDtoHAsync_v2, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st))                          \
  HELD(cuMemcpyDtoHAsync_v2_ptsz, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st))                     \
  HELD(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))                    \
  HELD(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))               \
  HELD(cuMemcpy2D_v2, (const void *c), (c))                                                                           \
  HELD(cuMemcpy2D_v2_ptds, (const void *c), (c))                                                                      \
  HELD(cuMemcpy2DUnaligned_v2, (const void *c), (c))                                                                  \
  HELD(cuMemcpy2DUnaligned_v2_ptds, (const void *c), (c))                                                             \
  HELD(cuMemcpy2DAsync_v2, (const void *c, CUstream st), (c, st))                                                     \
  HELD(cuMemcpy2DAsync_v2_ptsz, (const void *c, CUstream st), (c, st))                                                \
  HELD(cuMemcpy3D_v2, (const void *c), (c))                                                                           \
  HELD(cuMemcpy3D_v2_ptds, (const void *c), (c))                                                                      \
  HELD(cuMemcpy3DAsync_v2, (const void *c, CUstream st), (c, st))                                                     \
  HELD(cuMemcpy3DAsync_v2_ptsz, (const void *c, CUstream st), (c, st))                                                \
  HELD(cuMemcpy3DPeer, (const void *c), (c))                                                                          \
  HELD(cuMemcpy3DPeer_ptds, (const void *c), (c))                                                                     \
  HELD(cuMemcpy3DPeerAsync, (const void *c, CUstream st), (c, st))                                                    \
  HELD(cuMemcpy3DPeerAsync_ptsz, (const void *c, CUstream st), (c, st))                                               \
  HELD(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                          \
  HELD(cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                     \
  HELD(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                                        \
  HELD(cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                                   \
  HELD(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                          \
  HELD(cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                     \
  HELD(cuMemsetD2D8_v2, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h), (d, p, v, w, h))              \
  HELD(cuMemsetD2D8_v2_ptds, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h), (d, p, v, w, h))         \
  HELD(cuMemsetD2D16_v2, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h), (d, p, v, w, h))            \
  HELD(cuMemsetD2D16_v2_ptds, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h), (d, p, v, w, h))       \
  HELD(cuMemsetD2D32_v2, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h), (d, p, v, w, h))              \
  HELD(cuMemsetD2D32_v2_ptds, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h), (d, p, v, w, h))         \
  HELD(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))                       \
  HELD(cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))                  \
  HELD(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))                     \
  HELD(cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))                \
  HELD(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))                       \
  HELD(cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))                  \
  HELD(cuMemsetD2D8Async, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream st),                \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuMemsetD2D8Async_ptsz, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream st),           \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuMemsetD2D16Async, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream st),              \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuMemsetD2D16Async_ptsz, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream st),         \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuMemsetD2D32Async, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream st),                \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuMemsetD2D32Async_ptsz, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream st),           \
       (d, p, v, w, h, st))                                                                                           \
  HELD(cuStreamWriteValue32_v2, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))                \
  HELD(cuStreamWriteValue32_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))           \
  HELD(cuStreamWriteValue64_v2, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))                \
  HELD(cuStreamWriteValue64_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))           \
  HELD(cuStreamWaitValue32_v2, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))                 \
  HELD(cuStreamWaitValue32_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))            \
  HELD(cuStreamWaitValue64_v2, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))                 \
  HELD(cuStreamWaitValue64_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))            \
  HELD(cuStreamBatchMemOp_v2, (CUstream st, unsigned n, void *ops, unsigned f), (st, n, ops, f))                      \
  HELD(cuStreamBatchMemOp_v2_ptsz, (CUstream st, unsigned n, void *ops, unsigned f), (st, n, ops, f))

/* For a user of the table that has nothing to make of a kind. */
#define VGPU_NONE2(name, a, b)

/* Prototypes of every entry point of the table (the driver stand-in of the tests
 * defines a subset of them; the library its own forms: vmm.h). */
#define VGPU_DRIVER_PROTO(name, a, params) CUresult name params;
#define VGPU_DRIVER_PROTO_HELD(name, params, args) CUresult name params;

#endif
