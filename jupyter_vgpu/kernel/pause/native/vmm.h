/*
 * The pausable allocator's shared declarations (see vmm.c for what the library does).
 *
 * No CUDA header is needed to build the library: the driver types used are declared
 * here; their layout is the stable ABI of cuda.h (CUDA 11.2 and later).
 */
#ifndef JUPYTER_VGPU_VMM_H
#define JUPYTER_VGPU_VMM_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ---- the driver API subset (cuda.h) ------------------------------------------------ */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
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

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_MAP_FAILED = 205,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};
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

/* ---- the library's own error codes (also reported through vgpu_last_error) --------- */
#define VGPU_ERROR_NOT_INITIALISED 900
#define VGPU_ERROR_UNKNOWN_POINTER 901
#define VGPU_ERROR_BAD_STATE 902
#define VGPU_ERROR_NO_DRIVER 903
#define VGPU_ERROR_HOST 904

/* ---- the real driver: every entry point the library calls or wraps ----------------- */
typedef struct {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*cuDeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
  CUresult (*cuDeviceGetMemPool)(CUmemoryPool *, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetDevice)(CUdevice *);
  CUresult (*cuCtxSynchronize)(void);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
  CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
  CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
  CUresult (*cuMemAllocPitch_v2)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
  CUresult (*cuMemFree_v2)(CUdeviceptr);
  CUresult (*cuMemGetAddressRange_v2)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*cuMemAllocManaged)(CUdeviceptr *, size_t, unsigned int);
  CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
  CUresult (*cuMemAllocAsync_ptsz)(CUdeviceptr *, size_t, CUstream);
  CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
  CUresult (*cuMemFreeAsync_ptsz)(CUdeviceptr, CUstream);
  CUresult (*cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
  CUresult (*cuMemAllocFromPoolAsync_ptsz)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
  CUresult (*cuMemPoolTrimTo)(CUmemoryPool, size_t);
  CUresult (*cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
  CUresult (*cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
  CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
  CUresult (*cuPointerGetAttributes)(unsigned int, int *, void **, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
  CUresult (*cuIpcOpenMemHandle_v2)(CUdeviceptr *, CUipcMemHandle, unsigned int);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuEventCreate)(CUevent *, unsigned int);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventRecord_ptsz)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventDestroy_v2)(CUevent);
  CUresult (*cuStreamIsCapturing)(CUstream, int *);
  CUresult (*cuStreamIsCapturing_ptsz)(CUstream, int *);
  CUresult (*cuGetProcAddress)(const char *, void **, int, cuuint64_t);
  CUresult (*cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);
} Driver;

extern Driver drv;

/* Loads libcuda and every entry point above (without cuInit); 1 when it is there. */
int vgpu_resolve_driver(void);
int vgpu_init(int backend);

/* ---- state shared by the library's files -------------------------------------------- */
enum { BACKEND_NONE = 0, BACKEND_CUDA = 1, BACKEND_HOST = 2 };
extern int g_backend;
extern pthread_mutex_t g_lock; /* guards every table; never held across a user callback */

/* One reserved address range with one physical allocation of ours behind it. */
typedef struct Chunk Chunk;
typedef struct {
  uint64_t ptr;   /* start of the reserved range */
  uint64_t size;  /* bytes, a multiple of the granularity */
  int device;     /* CUDA ordinal (0 for the host backend) */
  int mapped;     /* 1: physical memory behind it; 0: paused */
  int flags;      /* SEG_* */
  int export_fd;  /* shareable handle exported for CUDA IPC, or -1 */
  uint64_t token; /* names the export to importers */
  CUmemGenericAllocationHandle handle;
  Chunk *chunk;   /* the small-allocation chunk this segment is, or NULL */
} Segment;
#define SEG_FD 1        /* created with a POSIX file-descriptor handle type (IPC possible) */
#define SEG_EXPORTED 2  /* shared with another process: never paused */
#define SEG_ASYNC 4     /* a stream-ordered allocation (cuMemAllocAsync and friends) */
#define SEG_CACHED 8    /* freed stream-ordered segment kept for reuse: holds nothing */

/* Table of segments, sorted by address. */
Segment *seg_containing(uint64_t addr); /* the segment whose range holds addr, or NULL */
Segment *seg_at(uint64_t ptr);          /* the segment starting at ptr, or NULL */
CUresult seg_new(int device, uint64_t size, int flags, Segment **out);
void seg_delete(Segment *s); /* synchronize first; frees addresses and memory */
CUresult seg_back(Segment *s);
CUresult seg_back_unset(Segment *s); /* physical memory mapped, no access set yet */
CUresult seg_unback(Segment *s);
CUresult current_device(int *device); /* the calling thread's context's device */
CUresult ensure_context(int device);
void set_error(int code, const char *what);
extern uint64_t g_mapped_bytes, g_paused_bytes;

/* Small and stream-ordered allocations (arena.c). */
#define ARENA_LIMIT (1u << 20) /* allocations below this share 2 MiB chunks */
CUresult arena_alloc(int device, uint64_t size, int async, uint64_t *out);
int arena_free(uint64_t ptr);                       /* 1 when ptr was a slot of ours */
int arena_slot(uint64_t ptr, uint64_t *base, uint64_t *size); /* 1: ptr lies in a live slot */
void arena_chunk_released(Chunk *c);
CUresult async_alloc(uint64_t *out, size_t size, CUstream stream, int ptsz);
CUresult async_free(uint64_t ptr, CUstream stream, int ptsz); /* CUDA_ERROR_NOT_FOUND: not ours */
void async_collect(int release);                    /* reap finished frees; drop caches */
int async_reclaim_now(uint64_t ptr); /* the device is idle: give it back now; 1 when ours */
int async_pool_is_ours(CUmemoryPool pool);
void async_pool_figures(CUmemoryPool pool, int attr, uint64_t *value);
void async_pool_reset_high(CUmemoryPool pool, int attr);
void async_trim(CUmemoryPool pool, size_t keep);
int async_should_let_through(CUstream stream, int ptsz, CUmemoryPool pool); /* pool NULL: current */
void async_let_through(uint64_t ptr, uint64_t size);
int async_forget_through(uint64_t ptr);
extern uint64_t g_async_live_bytes, g_async_cached_bytes, g_arena_bytes;

#define MAX_ACCESS 8 /* locations whose access a mapping keeps */

/* Flags of the units the engine pauses (vgpu_units). */
#define UNIT_MAPPED 1
#define UNIT_OTHERS 2   /* made with cuMemCreate by someone else (handles.c) */
#define UNIT_PAUSABLE 4 /* may be released and mapped again */
#define UNIT_CHUNK 8    /* holds small allocations */
#define UNIT_EXPORTED 16
#define UNIT_ASYNC 32

/* Allocations made with cuMemCreate by others (handles.c). */
#define VGPU_HANDLE_TAG 0x7647000000000000ULL
int handle_is_ours(CUmemGenericAllocationHandle h);
uint64_t handles_count(void);
/* Units the engine pauses: see vgpu_units in vmm.c. */
size_t handles_units(uint64_t *ptrs, uint64_t *sizes, int *devices, int *flags, size_t n);
int handles_unmap(uint64_t window);  /* -1: no such unit */
int handles_map(uint64_t window);
/* handles_map without setting access: note(ctx, va, size, access, count) for each mapping. */
typedef void (*AccessNote)(void *ctx, uint64_t va, uint64_t size, const CUmemAccessDesc *access, int count);
int handles_map_unset(uint64_t window, AccessNote note, void *ctx);
void handles_figures(uint64_t *mapped, uint64_t *paused, uint64_t *exported, uint64_t *imported,
                     uint64_t *other);

/* CUDA IPC (ipc.c). */
void ipc_forget(Segment *s); /* the segment goes away: close its export */
extern uint64_t g_exported_bytes, g_imported_bytes;

/* Memory we let through to the driver and cannot pause (interpose.c). */
extern uint64_t g_managed_bytes, g_passthrough_bytes;

int interposing(void);
void *vgpu_real_dlsym(void *handle, const char *name); /* dlsym, never ours (interpose.c) */

/* The gate (gate.c): while the kernel's memory is away, calls wait before the driver. */
#include "stubs.h"
CUresult vgpu_held_enter(void);        /* before a call that touches device memory */
void vgpu_held_leave(void);            /* after it */
CUresult vgpu_held_if_suspended(void); /* before any other call: waits only while suspended */
int vgpu_free_deferred(void);          /* 1: a free of ours waits for the kernel's return */
void frees_reap_deferred(void);        /* interpose.c: the frees deferred while away, done now */

/* JUPYTER_VGPU_TRACE=1: a line on stderr for each step of the rarer paths (CUDA IPC), to
 * tell where a program waits or fails. */
void vgpu_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fork_child_reset(void);

#endif
