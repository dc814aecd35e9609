/*
 * The pausable allocator's internal header (see vmm.c for what the library does): every
 * function and variable one file of the library gives another, and every function it
 * exports. A function used in one file only is static there. The driver's types and the
 * table of its entry points are in driver.h; the stubs' numbers, which stubs.S reads
 * too, in stubs.h.
 */
#ifndef JUPYTER_VGPU_VMM_H
#define JUPYTER_VGPU_VMM_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>

#include "driver.h"
#include "stubs.h"

/* ---- the library's own errors (name, number, words) -------------------------------- */
#define VGPU_OWN_ERRORS(X)                                                                       \
  X(VGPU_ERROR_NOT_INITIALISED, 900, "the allocator is not initialised")                         \
  X(VGPU_ERROR_UNKNOWN_POINTER, 901, "no segment starts at that address")                        \
  X(VGPU_ERROR_BAD_STATE, 902, "the segment is not in the state the call needs")                 \
  X(VGPU_ERROR_NO_DRIVER, 903, "the CUDA driver (libcuda.so.1) cannot be opened or initialised") \
  X(VGPU_ERROR_HOST, 904, "a host memory call failed")

#define VGPU_OWN_ENUM(name, value, words) name = value,
enum { VGPU_OWN_ERRORS(VGPU_OWN_ENUM) };
#undef VGPU_OWN_ENUM

/* ---- the real driver: a pointer for every entry point of the table ----------------- */
#define VGPU_FIELD(name, need, params) CUresult(*name) params;
#define VGPU_FIELD_HELD(name, params, args) CUresult(*name) params;
typedef struct {
  VGPU_DRIVER_ENTRIES(VGPU_FIELD, VGPU_FIELD, VGPU_FIELD_HELD)
} Driver;
#undef VGPU_FIELD
#undef VGPU_FIELD_HELD

extern Driver drv;

/* ---- vmm.c: the driver, the segment table, errors ---------------------------------- */
/* Loads libcuda and every entry point of the table (without cuInit); 1 when it is there. */
int vgpu_resolve_driver(void);

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

/* Table of segments, sorted by address (the lock is held). */
Segment *seg_containing(uint64_t addr); /* the segment whose range holds addr, or NULL */
CUresult seg_new(int device, uint64_t size, int flags, Segment **out);
void seg_delete(Segment *s); /* synchronize first; frees addresses and memory */
int seg_export_fd(uint64_t token); /* the descriptor of the CUDA IPC export named token, or -1 */
CUresult current_device(int *device); /* the calling thread's context's device */
CUresult ensure_context(int device);

/* The calling thread's last error (vgpu_last_error, vgpu_last_message): code, and the
 * library's words for what failed. Never calls the driver. */
void set_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Growth on demand (grow.c): when the driver refuses a physical allocation made for the
 * process (out of memory), the node arbiter is asked for room over the grow channel
 * (vgpu_set_grow_channel) before the caller sees the error, with no lock held, and the
 * allocation is tried again when it granted some (GROW_TRIES asks at most). An allocation
 * path runs:
 *   Growth g; grow_start(&g);
 *   do { lock; r = try; unlock; } while (grow_again(&g, r));
 *   grow_end(&g, r);
 * and whatever makes the physical allocation calls grow_refused when the driver answers
 * CUDA_ERROR_OUT_OF_MEMORY. */
#define GROW_TRIES 4
typedef struct {
  int asks; /* the arbiter's answers so far, for this allocation */
} Growth;
void grow_start(Growth *g);
void grow_refused(int device, uint64_t bytes); /* the driver refused bytes on device: out of memory */
int grow_again(Growth *g, CUresult r);         /* 1: try again (room was made); the lock is not held */
void grow_end(Growth *g, CUresult r);
void grow_fork_child(void); /* a child of fork() asks no more: the channel closed, unsaid */

/* JUPYTER_VGPU_TRACE=1: a line on stderr for each step of the rarer paths (CUDA IPC), to
 * tell where a program waits or fails. */
void vgpu_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define MAX_ACCESS 8 /* locations whose access a mapping keeps */

/* 1 when the growing array `array` of `count` items, with room for `cap`, has room for one
 * more, doubling it when full (`first` items the first time); 0 when memory ran out, the
 * array left as it was. */
#define VGPU_ROOM(array, count, cap, first)                                 \
  __extension__({                                                           \
    int room_ = (count) < (cap);                                            \
    if (!room_) {                                                           \
      size_t want_ = (cap) ? 2 * (size_t)(cap) : (size_t)(first);           \
      __typeof__(array) grown_ = realloc((array), want_ * sizeof *(array)); \
      if (grown_) {                                                         \
        (array) = grown_;                                                   \
        (cap) = want_;                                                      \
        room_ = 1;                                                          \
      }                                                                     \
    }                                                                       \
    room_;                                                                  \
  })

/* Flags of the units the engine pauses (vgpu_units). */
#define UNIT_MAPPED 1
#define UNIT_OTHERS 2   /* made with cuMemCreate by someone else (handles.c) */
#define UNIT_PAUSABLE 4 /* may be released and mapped again */
#define UNIT_CHUNK 8    /* holds small allocations */
#define UNIT_EXPORTED 16
#define UNIT_ASYNC 32

/* ---- arena.c: small and stream-ordered allocations -------------------------------- */
#define ARENA_LIMIT (1u << 20) /* allocations below this share 2 MiB chunks */
CUresult arena_alloc(int device, uint64_t size, int async, uint64_t *out);
int arena_free(uint64_t ptr);                                 /* 1 when ptr was a slot of ours */
int arena_slot(uint64_t ptr, uint64_t *base, uint64_t *size); /* 1: ptr lies in a live slot */
void arena_chunk_released(Chunk *c);
CUresult async_alloc(uint64_t *out, size_t size);
CUresult async_free(uint64_t ptr, CUstream stream, int ptsz); /* CUDA_ERROR_NOT_FOUND: not ours */
void async_collect(int release);                              /* reap finished frees; drop caches */
int async_reclaim_now(uint64_t ptr); /* the device is idle: give it back now; 1 when ours */
void async_pool_figures(CUmemoryPool pool, int attr, uint64_t *value);
void async_pool_reset_high(CUmemoryPool pool, int attr);
void async_trim(CUmemoryPool pool, size_t keep);
int async_should_let_through(CUstream stream, int ptsz, CUmemoryPool pool); /* pool NULL: current */
void async_let_through(uint64_t ptr, uint64_t size);
int async_forget_through(uint64_t ptr);
extern uint64_t g_async_live_bytes, g_async_cached_bytes, g_arena_bytes;

/* ---- handles.c: allocations made with cuMemCreate by others ------------------------ */
#define VGPU_HANDLE_TAG 0x7647000000000000ULL
int handle_is_ours(CUmemGenericAllocationHandle h);
/* The wrapped entry points (interpose.c calls them for handles and mappings of ours). */
CUresult handles_create(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                        unsigned long long flags);
CUresult handles_release(CUmemGenericAllocationHandle h);
CUresult handles_map_range(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                           unsigned long long flags);
int handles_covers(CUdeviceptr va, size_t size); /* 1 when [va, va + size) holds a mapping of ours */
CUresult handles_unmap_range(CUdeviceptr va, size_t size);
CUresult handles_set_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult handles_retain(CUmemGenericAllocationHandle *out, void *addr); /* CUDA_ERROR_NOT_FOUND: not ours */
CUresult handles_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h);
CUresult handles_export(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags);
CUresult handles_import(CUmemGenericAllocationHandle *out, void *os_handle, int type);
/* Units the engine pauses (the lock is held): see vgpu_units in vmm.c. */
size_t handles_units(uint64_t *ptrs, uint64_t *sizes, int *devices, int *flags, size_t n);
int handles_unmap(uint64_t window); /* -1: no such unit */
int handles_map(uint64_t window);
/* handles_map without setting access: note(ctx, va, size, access, count) for each mapping. */
typedef void (*AccessNote)(void *ctx, uint64_t va, uint64_t size, const CUmemAccessDesc *access, int count);
int handles_map_unset(uint64_t window, AccessNote note, void *ctx);
void handles_figures(uint64_t *mapped, uint64_t *paused, uint64_t *exported, uint64_t *imported,
                     uint64_t *other);

/* ---- ipc.c: CUDA IPC of segments of ours ------------------------------------------- */
CUresult ipc_get_handle(CUipcMemHandle *handle, CUdeviceptr dptr); /* CUDA_ERROR_NOT_FOUND: not ours */
CUresult ipc_open(CUdeviceptr *out, const CUipcMemHandle *handle); /* CUDA_ERROR_NOT_FOUND: not ours */
CUresult ipc_close(CUdeviceptr dptr);                              /* CUDA_ERROR_NOT_FOUND: not ours */
void ipc_forget(Segment *s); /* the segment goes away: close its export (the lock is held) */
void fork_child_reset(void); /* a child of fork() serves none of its parent's exports */
extern uint64_t g_exported_bytes, g_imported_bytes;

/* ---- interpose.c: the entry points a preloaded process reaches instead ------------- */
extern uint64_t g_managed_bytes, g_passthrough_bytes; /* let through to the driver: not pausable */
void *vgpu_real_dlsym(void *handle, const char *name); /* dlsym, never ours */
void frees_reap_deferred(void); /* the frees deferred while the kernel was away, done now */
/* The stubs' table (stubs.S): the driver function each stub stands for. */
extern void *g_vgpu_stub_real[VGPU_STUBS] __attribute__((visibility("hidden")));

/* ---- gate.c: while the kernel's memory is away, calls wait before the driver ------- */
CUresult vgpu_held_enter(void);        /* before a call that touches device memory */
void vgpu_held_leave(void);            /* after it */
CUresult vgpu_held_if_suspended(void); /* before any other call: waits only while suspended */
int vgpu_free_deferred(void);          /* 1: a free of ours waits for the kernel's return */
int vgpu_machinery(void);              /* 1: the calling thread is the machinery's (vgpu_gate_mine) */
int vgpu_away(void);                   /* VGPU_PRESENT, VGPU_PAUSED or VGPU_SUSPENDED */
/* Read by the stubs on every call; the stubs' slow path (stubs.S) calls vgpu_stub_hold. */
extern int g_vgpu_away __attribute__((visibility("hidden")));
CUresult vgpu_stub_hold(int index) __attribute__((visibility("hidden")));

/* ---- the library's own forms of the driver's entry points (interpose.c, held.c) ---- */
VGPU_DRIVER_ENTRIES(VGPU_NONE2, VGPU_DRIVER_PROTO, VGPU_DRIVER_PROTO_HELD)

/* ---- the CUDA runtime's entry points, ours (interpose.c) --------------------------- */
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status);
int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status);

/* ---- what vmm.py calls (ctypes): keep its argtypes and restype in step ------------- */
/* vmm.c */
int vgpu_init(int backend);
void *vgpu_malloc(ssize_t size, int device, void *stream);
void vgpu_free(void *ptr, ssize_t size, int device, void *stream);
int vgpu_unmap(uint64_t ptr);
int vgpu_map(uint64_t ptr);
int vgpu_map_many(const uint64_t *ptrs, size_t n);
size_t vgpu_units(uint64_t *ptrs, uint64_t *sizes, int *devices, int *flags, size_t n);
void vgpu_collect(void);
size_t vgpu_figures(uint64_t *out, size_t n);
uint64_t vgpu_mapped_bytes(void);
int vgpu_backend(void);
int vgpu_last_error(void);
const char *vgpu_last_message(void);
const char *vgpu_error_name(int code);
const char *vgpu_error_string(int code);
/* grow.c */
int vgpu_set_grow_channel(const char *socket_path);
void vgpu_grow_figures(uint64_t *out2);
/* interpose.c */
int vgpu_preloaded(void);
int vgpu_stubs_available(void);
/* gate.c */
int vgpu_gate_close(int mode, int timeout_ms);
void vgpu_gate_set(int mode);
void vgpu_gate_open(void);
int vgpu_gate_mine(int on);
int vgpu_gate_wanted_fd(void);
void vgpu_gate_fail(int code, const char *why);
void vgpu_gate_figures(int *mode, long *waiting, double *since, uint64_t *held_total, int *wanted);

#endif
