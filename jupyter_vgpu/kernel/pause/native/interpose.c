/*
 * The entry points a process reaches instead of the CUDA runtime's and driver's, when
 * the library is loaded with LD_PRELOAD.
 *
 * A program reaches the driver four ways, and each is covered:
 *   - linked against libcuda: the library's exported cu* functions come first in the
 *     global scope (LD_PRELOAD), so they are the ones bound;
 *   - dlopen("libcuda.so.1") and dlsym (JAX/XLA's stubs, ctypes, Numba, the CUDA
 *     runtime finding cuGetProcAddress): dlsym is interposed too, and a lookup that
 *     finds one of the driver functions below gets ours;
 *   - cuGetProcAddress (how the CUDA runtime, static or shared, fills its table of the
 *     driver): ours asks the driver, then hands back ours for the functions below;
 *   - the runtime's cudaGetDriverEntryPoint[ByVersion] (PyTorch's driver calls, its
 *     expandable segments among them): ours asks the runtime, then does the same.
 * Which of ours stands for a driver function is decided by its address (substitute):
 * a lookup that returns the driver's cuMemAlloc_v2 gets our cuMemAlloc_v2, one that
 * returns another version of it (an old ABI) is left alone.
 *
 * dlsym: glibc resolves RTLD_NEXT and RTLD_DEFAULT relative to its caller (the return
 * address): for every name but the few driver functions wrapped, ours ends in a
 * sibling call to the real dlsym, which then sees the original caller
 * (tests/unit/test_vmm_native.py checks both lookups through a library of its own).
 *
 * JUPYTER_VGPU_PAUSABLE=0 in the environment turns all of it off: every entry point
 * passes through to the runtime or the driver.
 */
#include "vmm.h"

#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>

uint64_t g_managed_bytes = 0, g_passthrough_bytes = 0;

/* ---- the real dlsym ------------------------------------------------------------------ */
static void *(*g_real_dlsym)(void *, const char *) = NULL;

static void find_real_dlsym(void) {
  static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
  for (size_t i = 0; i < sizeof versions / sizeof *versions && !g_real_dlsym; i++)
    *(void **)&g_real_dlsym = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

void *vgpu_real_dlsym(void *handle, const char *name) {
  if (!g_real_dlsym) find_real_dlsym();
  return g_real_dlsym(handle, name);
}

/* ---- on or off ------------------------------------------------------------------------ */
/* 0: not decided; 1: allocations go through the tables; -1: pass through. */
static int g_interpose = 0;

static int enabled(void) {
  const char *off = getenv("JUPYTER_VGPU_PAUSABLE");
  return !(off && strcmp(off, "0") == 0);
}

static int interposing(void) {
  if (g_interpose == 0) {
    g_interpose = enabled() ? 1 : -1;
    if (g_interpose == 1 && g_backend == BACKEND_NONE) {
      if (vgpu_init(BACKEND_CUDA) != 0) g_interpose = -1;
    }
  }
  return g_interpose == 1 && g_backend == BACKEND_CUDA;
}

/* ---- allocation and free ---------------------------------------------------------- */
/* cuMemAlloc's, cuMemAllocPitch's and cudaMalloc's memory: a slot of a chunk, or a
 * segment. Out of memory, it asks for room first (grow_again, without the lock). */
static CUresult alloc_sync(int device, uint64_t size, uint64_t *out) {
  CUresult r;
  Growth g;
  grow_start(&g);
  do {
    pthread_mutex_lock(&g_lock);
    if (size < ARENA_LIMIT) r = arena_alloc(device, size, 0, out);
    else {
      Segment *s;
      r = seg_new(device, size, 0, &s);
      if (r == CUDA_SUCCESS) *out = s->ptr;
    }
    pthread_mutex_unlock(&g_lock);
  } while (grow_again(&g, r));
  grow_end(&g, r);
  if (r != CUDA_SUCCESS) set_error(r, "%llu bytes on device %d", (unsigned long long)size, device);
  return r;
}

/* Free memory of ours synchronously (cudaFree's and cuMemFree's contract: work still
 * using it finishes first). The device is synchronized without the lock held: a
 * synchronize lasts as long as the longest kernel queued, and every other thread of the
 * process (allocations, the kernel's usage reports) would wait on the lock meanwhile.
 * CUDA_ERROR_NOT_FOUND: not ours. */
static CUresult defer_free(uint64_t ptr);

static CUresult free_sync(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  Segment *s = seg_containing(ptr);
  int device = s ? s->device : 0;
  int ours = s && !(s->flags & SEG_CACHED);
  pthread_mutex_unlock(&g_lock);
  if (!ours) return CUDA_ERROR_NOT_FOUND;
  if (vgpu_free_deferred()) return defer_free(ptr); /* the pause engine may be moving it */
  ensure_context(device);
  drv.cuCtxSynchronize();
  pthread_mutex_lock(&g_lock);
  CUresult r = CUDA_SUCCESS;
  s = seg_containing(ptr);
  if (!s || (s->flags & SEG_CACHED)) r = CUDA_ERROR_INVALID_VALUE; /* freed meanwhile by another thread */
  else if (s->flags & SEG_ASYNC) {
    if (!async_reclaim_now(ptr)) r = CUDA_ERROR_INVALID_VALUE;
  } else if (s->chunk) {
    if (!arena_free(ptr)) r = CUDA_ERROR_INVALID_VALUE;
  } else if (s->ptr != ptr) {
    r = CUDA_ERROR_INVALID_VALUE; /* not the start of an allocation */
  } else {
    seg_delete(s);
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

/* Frees of memory of ours made while the kernel was away: done once it is back
 * (frees_reap_deferred, from the gate's opening). Memory the pause engine moves must stay
 * where it is until then; its owner has let go of it, so nothing else changes. */
static uint64_t *g_deferred = NULL;
static size_t g_ndeferred = 0, g_cap_deferred = 0;

static CUresult defer_free(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int kept = VGPU_ROOM(g_deferred, g_ndeferred, g_cap_deferred, 64);
  if (kept) g_deferred[g_ndeferred++] = ptr;
  pthread_mutex_unlock(&g_lock);
  return kept ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

void frees_reap_deferred(void) {
  pthread_mutex_lock(&g_lock);
  uint64_t *todo = g_deferred;
  size_t n = g_ndeferred;
  g_deferred = NULL;
  g_ndeferred = g_cap_deferred = 0;
  pthread_mutex_unlock(&g_lock);
  for (size_t i = 0; i < n; i++) free_sync(todo[i]);
  free(todo);
}

typedef struct { uint64_t ptr, size; } Managed;
static Managed *g_managed = NULL;
static size_t g_nmanaged = 0, g_cap_managed = 0;

static void note_managed(uint64_t ptr, uint64_t size) {
  pthread_mutex_lock(&g_lock);
  if (VGPU_ROOM(g_managed, g_nmanaged, g_cap_managed, 64)) {
    g_managed[g_nmanaged].ptr = ptr;
    g_managed[g_nmanaged++].size = size;
    g_managed_bytes += size;
  }
  pthread_mutex_unlock(&g_lock);
}

static void forget_managed(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  for (size_t i = 0; i < g_nmanaged; i++)
    if (g_managed[i].ptr == ptr) {
      g_managed_bytes -= g_managed[i].size;
      g_managed[i] = g_managed[--g_nmanaged];
      break;
    }
  pthread_mutex_unlock(&g_lock);
}

/* ---- the driver's entry points, ours ------------------------------------------------ */
#define PASS_IF_OFF(call) \
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED; \
  if (!interposing()) return call
/* While the kernel is suspended every call waits for its restore (gate.c). */
#define HOLD_IF_SUSPENDED()                            \
  do {                                                 \
    CUresult held_ = vgpu_held_if_suspended();         \
    if (held_ != CUDA_SUCCESS) return held_;           \
  } while (0)

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAlloc_v2(dptr, size));
  if (!dptr || !size) return CUDA_ERROR_INVALID_VALUE;
  int device;
  CUresult r = current_device(&device);
  if (r != CUDA_SUCCESS) return r;
  uint64_t p;
  r = alloc_sync(device, size, &p);
  if (r == CUDA_SUCCESS) *dptr = p;
  return r;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocPitch_v2(dptr, pitch, width, height, elem));
  if (!dptr || !pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
  int device, align = 0;
  CUresult r = current_device(&device);
  if (r != CUDA_SUCCESS) return r;
  CUdevice dev;
  if (drv.cuDeviceGetAttribute && drv.cuDeviceGet(&dev, device) == CUDA_SUCCESS)
    drv.cuDeviceGetAttribute(&align, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, dev);
  if (align <= 0) align = 512;
  size_t p = (width + (size_t)align - 1) / (size_t)align * (size_t)align;
  uint64_t out;
  r = alloc_sync(device, (uint64_t)p * height, &out);
  if (r == CUDA_SUCCESS) {
    *dptr = out;
    *pitch = p;
  }
  return r;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemFree_v2(dptr));
  CUresult r = dptr ? free_sync(dptr) : CUDA_ERROR_NOT_FOUND;
  if (r != CUDA_ERROR_NOT_FOUND) return r;
  forget_managed(dptr);
  return drv.cuMemFree_v2(dptr);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemGetAddressRange_v2(base, size, dptr));
  uint64_t b, n;
  pthread_mutex_lock(&g_lock);
  int slot = arena_slot(dptr, &b, &n);
  pthread_mutex_unlock(&g_lock);
  if (!slot) return drv.cuMemGetAddressRange_v2(base, size, dptr);
  if (base) *base = b;
  if (size) *size = n;
  return CUDA_SUCCESS;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocManaged(dptr, size, flags));
  CUresult r = drv.cuMemAllocManaged(dptr, size, flags);
  if (r == CUDA_SUCCESS) note_managed(*dptr, size);
  return r;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream, int ptsz) {
  CUresult (*real)(CUdeviceptr *, size_t, CUstream) = ptsz ? drv.cuMemAllocAsync_ptsz : drv.cuMemAllocAsync;
  CUresult (*real_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream) =
      ptsz ? drv.cuMemAllocFromPoolAsync_ptsz : drv.cuMemAllocFromPoolAsync;
  if (!size || !dptr || async_should_let_through(stream, ptsz, pool)) {
    CUresult r = pool ? real_pool(dptr, size, pool, stream) : real(dptr, size, stream);
    if (r == CUDA_SUCCESS && dptr && size) async_let_through(*dptr, size);
    return r;
  }
  uint64_t p;
  CUresult r;
  Growth g; /* async_alloc takes and lets go of the lock itself */
  grow_start(&g);
  do r = async_alloc(&p, size);
  while (grow_again(&g, r));
  grow_end(&g, r);
  if (r == CUDA_SUCCESS) *dptr = p;
  return r;
}

static CUresult free_async(CUdeviceptr dptr, CUstream stream, int ptsz) {
  CUresult (*real)(CUdeviceptr, CUstream) = ptsz ? drv.cuMemFreeAsync_ptsz : drv.cuMemFreeAsync;
  if (async_forget_through(dptr)) return real(dptr, stream);
  CUresult r = async_free(dptr, stream, ptsz);
  if (r == CUDA_ERROR_NOT_FOUND) r = free_sync(dptr); /* memory of ours from cuMemAlloc */
  return r == CUDA_ERROR_NOT_FOUND ? real(dptr, stream) : r;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocAsync(dptr, size, stream));
  return alloc_async(dptr, size, NULL, stream, 0);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocAsync_ptsz(dptr, size, stream));
  return alloc_async(dptr, size, NULL, stream, 1);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocFromPoolAsync(dptr, size, pool, stream));
  return alloc_async(dptr, size, pool, stream, 0);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemAllocFromPoolAsync_ptsz(dptr, size, pool, stream));
  return alloc_async(dptr, size, pool, stream, 1);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemFreeAsync(dptr, stream));
  return free_async(dptr, stream, 0);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemFreeAsync_ptsz(dptr, stream));
  return free_async(dptr, stream, 1);
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemPoolTrimTo(pool, keep));
  async_trim(pool, keep);
  return drv.cuMemPoolTrimTo(pool, keep);
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemPoolGetAttribute(pool, attr, value));
  CUresult r = drv.cuMemPoolGetAttribute(pool, attr, value);
  if (r == CUDA_SUCCESS && value && attr >= CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT &&
      attr <= CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    async_pool_figures(pool, attr, (uint64_t *)value);
  return r;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemPoolSetAttribute(pool, attr, value));
  CUresult r = drv.cuMemPoolSetAttribute(pool, attr, value);
  if (r == CUDA_SUCCESS && (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH))
    async_pool_reset_high(pool, attr);
  return r;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemCreate(handle, size, prop, flags));
  return handles_create(handle, size, prop, flags);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handle_is_ours(handle) ? handles_release(handle) : drv.cuMemRelease(handle);
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handle_is_ours(handle) ? handles_map_range(va, size, offset, handle, flags)
                                : drv.cuMemMap(va, size, offset, handle, flags);
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handles_covers(va, size) ? handles_unmap_range(va, size) : drv.cuMemUnmap(va, size);
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handles_covers(va, size) ? handles_set_access(va, size, desc, count)
                                  : drv.cuMemSetAccess(va, size, desc, count);
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = handles_retain(handle, addr);
  return r == CUDA_ERROR_NOT_FOUND ? drv.cuMemRetainAllocationHandle(handle, addr) : r;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handle_is_ours(handle) ? handles_properties(prop, handle)
                                : drv.cuMemGetAllocationPropertiesFromHandle(prop, handle);
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  return handle_is_ours(handle) ? handles_export(out, handle, type, flags)
                                : drv.cuMemExportToShareableHandle(out, handle, type, flags);
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
  HOLD_IF_SUSPENDED();
  PASS_IF_OFF(drv.cuMemImportFromShareableHandle(handle, os_handle, type));
  return handles_import(handle, os_handle, type);
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
  PASS_IF_OFF(drv.cuIpcGetMemHandle(handle, dptr));
  CUresult r = vgpu_held_enter(); /* a paused segment cannot be shared until it is back */
  if (r != CUDA_SUCCESS) return r;
  r = ipc_get_handle(handle, dptr);
  if (r == CUDA_ERROR_NOT_FOUND) r = drv.cuIpcGetMemHandle(handle, dptr);
  vgpu_held_leave();
  return r;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = ipc_open(dptr, &handle); /* our handles are opened even with the library off */
  return r == CUDA_ERROR_NOT_FOUND ? drv.cuIpcOpenMemHandle_v2(dptr, handle, flags) : r;
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver() || !drv.cuIpcOpenMemHandle) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = ipc_open(dptr, &handle);
  return r == CUDA_ERROR_NOT_FOUND ? drv.cuIpcOpenMemHandle(dptr, handle, flags) : r;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = ipc_close(dptr);
  return r == CUDA_ERROR_NOT_FOUND ? drv.cuIpcCloseMemHandle(dptr) : r;
}

/* Pointer attributes: the range of a small allocation is its slot, and segments of ours
 * made with shareable handles can be shared through cuIpcGetMemHandle. */
static void fix_attribute(int attr, void *data, CUdeviceptr ptr) {
  if (!data) return;
  pthread_mutex_lock(&g_lock);
  uint64_t base, size;
  Segment *s = seg_containing(ptr);
  if ((attr == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR || attr == CU_POINTER_ATTRIBUTE_RANGE_SIZE) &&
      arena_slot(ptr, &base, &size)) {
    if (attr == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) *(CUdeviceptr *)data = base;
    else *(size_t *)data = size;
  } else if (attr == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE && s && (s->flags & SEG_FD)) {
    *(unsigned char *)data = 1; /* a bool; the bytes after it are the driver's (0) */
  }
  pthread_mutex_unlock(&g_lock);
}

/* A pointer's attributes are the driver's only while its memory is mapped: asked while
 * the kernel is away, the question waits for its return. */
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  PASS_IF_OFF(drv.cuPointerGetAttribute(data, attr, ptr));
  CUresult r = vgpu_held_enter();
  if (r != CUDA_SUCCESS) return r;
  r = drv.cuPointerGetAttribute(data, attr, ptr);
  vgpu_held_leave();
  if (r == CUDA_SUCCESS) fix_attribute(attr, data, ptr);
  return r;
}

CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr) {
  PASS_IF_OFF(drv.cuPointerGetAttributes(n, attrs, data, ptr));
  CUresult r = vgpu_held_enter();
  if (r != CUDA_SUCCESS) return r;
  r = drv.cuPointerGetAttributes(n, attrs, data, ptr);
  vgpu_held_leave();
  for (unsigned int i = 0; r == CUDA_SUCCESS && attrs && data && i < n; i++) fix_attribute(attrs[i], data[i], ptr);
  return r;
}

/* ---- which of ours stands for a driver function ------------------------------------ */
/* One entry point of ours: its name, our function, and where the driver's is kept. Every
 * OURS and HELD row of the driver's table (driver.h), the HELD ones made in held.c. */
typedef struct {
  const char *name;
  void *ours;
  void **real;
} Hook;

#define HOOK(name, need, params) {#name, (void *)name, (void **)&drv.name},
#define HOOK_HELD(name, params, args) {#name, (void *)name, (void **)&drv.name},
static const Hook g_hooks[] = {VGPU_DRIVER_ENTRIES(VGPU_NONE2, HOOK, HOOK_HELD)};
#undef HOOK_HELD
#undef HOOK
#define NHOOKS (sizeof g_hooks / sizeof *g_hooks)

/* ---- stubs for every other driver entry point handed out (stubs.S) ---------------- */
__attribute__((visibility("hidden"))) void *g_vgpu_stub_real[VGPU_STUBS];
static size_t g_nstubs = 0;
static pthread_mutex_t g_stub_lock = PTHREAD_MUTEX_INITIALIZER;
#if defined(__x86_64__) && defined(__ELF__)
extern char vgpu_stub_base[] __attribute__((visibility("hidden")));
#define HAVE_STUBS 1
#else
#define HAVE_STUBS 0
#endif

/* 1 when this library holds every driver entry point it hands out while the kernel is
 * suspended (x86-64; elsewhere only its own: the launches, copies and allocations). */
int vgpu_stubs_available(void) { return HAVE_STUBS; }

/* The stub standing for the driver function at real (made on first use), or real itself
 * where there are no stubs, or all of them are taken. */
static void *stub_for(void *real) {
#if HAVE_STUBS
  pthread_mutex_lock(&g_stub_lock);
  void *out = real;
  size_t i = 0;
  while (i < g_nstubs && g_vgpu_stub_real[i] != real) i++;
  if (i == g_nstubs && g_nstubs < VGPU_STUBS) {
    __atomic_store_n(&g_vgpu_stub_real[i], real, __ATOMIC_RELEASE);
    g_nstubs++;
  }
  if (i < g_nstubs) out = vgpu_stub_base + VGPU_STUB_BYTES * i;
  pthread_mutex_unlock(&g_stub_lock);
  return out;
#else
  return real;
#endif
}

/* 1 when fn is a function of the loaded driver (libcuda). */
static int in_driver(void *fn) {
  Dl_info info;
  return fn && dladdr(fn, &info) && info.dli_fname && strstr(info.dli_fname, "libcuda.so");
}

/* Ours for the driver function at real: the library's own form of it (here or held.c),
 * else a stub that holds it while the kernel is suspended; real itself when the library
 * is off, or real is not the driver's. */
static void *substitute(void *real) {
  if (!real || !enabled() || !vgpu_resolve_driver()) return real;
  for (size_t i = 0; i < NHOOKS; i++)
    if (*g_hooks[i].real == real) return g_hooks[i].ours;
  return in_driver(real) ? stub_for(real) : real;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver() || !drv.cuGetProcAddress) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = drv.cuGetProcAddress(symbol, pfn, version, flags);
  if (r == CUDA_SUCCESS && pfn) *pfn = substitute(*pfn);
  return r;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
  HOLD_IF_SUSPENDED();
  if (!vgpu_resolve_driver() || !drv.cuGetProcAddress_v2) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = drv.cuGetProcAddress_v2(symbol, pfn, version, flags, status);
  if (r == CUDA_SUCCESS && pfn) *pfn = substitute(*pfn);
  return r;
}

void *dlsym(void *handle, const char *name) {
  if (!g_real_dlsym) find_real_dlsym();
  if (name[0] == 'c' && name[1] == 'u' && name[2] != 'd' && handle != RTLD_NEXT && enabled()) {
    vgpu_held_if_suspended();
    vgpu_resolve_driver(); /* loads libcuda first: its functions are then known by address */
    return substitute(g_real_dlsym(handle, name));
  }
  return g_real_dlsym(handle, name); /* a sibling call: glibc sees our caller as its caller */
}

/* ---- the CUDA runtime's entry points, ours ----------------------------------------- */
/* The runtime library PyTorch loaded is not always in the global scope (RTLD_LOCAL),
 * where RTLD_NEXT would find it: look for it among the loaded objects instead. */
static int find_cudart(struct dl_phdr_info *info, size_t size, void *out) {
  (void)size;
  if (info->dlpi_name && strstr(info->dlpi_name, "libcudart.so")) {
    *(void **)out = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
    return *(void **)out != NULL;
  }
  return 0;
}

static void *runtime_symbol(const char *name) {
  void *sym = dlsym(RTLD_NEXT, name);
  if (sym) return sym;
  void *lib = NULL;
  dl_iterate_phdr(find_cudart, &lib);
  return lib ? vgpu_real_dlsym(lib, name) : NULL;
}

typedef int (*cuda_malloc_fn)(void **, size_t);
typedef int (*cuda_free_fn)(void *);
typedef int (*cuda_int_fn)(int *);
static cuda_free_fn real_free;
static cuda_malloc_fn real_malloc;
static cuda_int_fn real_get_device;

int cudaMalloc(void **ptr, size_t size) {
  if (vgpu_held_if_suspended() != CUDA_SUCCESS) return 2;
  if (!interposing()) {
    if (!real_malloc) real_malloc = (cuda_malloc_fn)runtime_symbol("cudaMalloc");
    return real_malloc ? real_malloc(ptr, size) : 35 /* cudaErrorInsufficientDriver */;
  }
  if (!real_get_device) real_get_device = (cuda_int_fn)runtime_symbol("cudaGetDevice");
  int device = 0;
  if (real_get_device) real_get_device(&device);
  if (!ptr) return 1; /* cudaErrorInvalidValue */
  if (size == 0) {
    *ptr = NULL;
    return 0;
  }
  uint64_t p;
  if (alloc_sync(device, size, &p) != CUDA_SUCCESS) return 2; /* cudaErrorMemoryAllocation */
  *ptr = (void *)(uintptr_t)p;
  return 0;
}

int cudaFree(void *ptr) {
  if (vgpu_held_if_suspended() != CUDA_SUCCESS) return 1;
  if (ptr && g_backend == BACKEND_CUDA) {
    CUresult r = free_sync((uint64_t)(uintptr_t)ptr);
    if (r == CUDA_SUCCESS) return 0;
    if (r != CUDA_ERROR_NOT_FOUND) return 1; /* cudaErrorInvalidValue */
  }
  if (!real_free) real_free = (cuda_free_fn)runtime_symbol("cudaFree");
  return real_free ? real_free(ptr) : 35;
}

static int runtime_version(void) {
  static int version = -1;
  if (version < 0) {
    cuda_int_fn get = (cuda_int_fn)runtime_symbol("cudaRuntimeGetVersion");
    int v = 0;
    if (get) get(&v);
    version = v;
  }
  return version;
}

typedef int (*entry_fn)(const char *, void **, unsigned long long, int *);
typedef int (*entry_fn_11)(const char *, void **, unsigned long long);
typedef int (*entry_by_version_fn)(const char *, void **, unsigned int, unsigned long long, int *);

/* The runtime's driver lookup, with ours substituted (CUDA 12's signature; 11's has no
 * status, and CUDA 13's runtime has only the versioned one: then cudaErrorSymbolNotFound,
 * as a caller probing for it expects). */
int cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status) {
  if (vgpu_held_if_suspended() != CUDA_SUCCESS) return 500;
  static void *real;
  if (!real) real = runtime_symbol("cudaGetDriverEntryPoint");
  if (!real) return 500;
  int r = runtime_version() >= 12000 ? ((entry_fn)real)(symbol, fn, flags, status)
                                     : ((entry_fn_11)real)(symbol, fn, flags);
  if (r == 0 && fn) *fn = substitute(*fn);
  return r;
}

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status) {
  if (vgpu_held_if_suspended() != CUDA_SUCCESS) return 500;
  static entry_by_version_fn real;
  if (!real) real = (entry_by_version_fn)runtime_symbol("cudaGetDriverEntryPointByVersion");
  if (!real) return 500;
  int r = real(symbol, fn, version, flags, status);
  if (r == 0 && fn) *fn = substitute(*fn);
  return r;
}

/* 1 when this process's cudaMalloc is this library's (it was loaded with LD_PRELOAD).
 * The lookup goes through the main program's handle, which sees the global scope only:
 * RTLD_DEFAULT would also search this library's own scope when it was loaded with
 * RTLD_LOCAL (ctypes), and so always find its own cudaMalloc. */
int vgpu_preloaded(void) {
  void *main_program = dlopen(NULL, RTLD_NOW);
  void *found = main_program ? vgpu_real_dlsym(main_program, "cudaMalloc") : NULL;
  return found == (void *)cudaMalloc;
}
