/*
 * Pausable device memory: cudaMalloc and cudaFree over the CUDA virtual-memory API.
 *
 * Loaded into a kernel with LD_PRELOAD, this library's cudaMalloc and cudaFree take the
 * place of the CUDA runtime's for every caller in the process: PyTorch's caching
 * allocator (every thread, every pool, CUDA-graph pools too), CuPy, and any library
 * that allocates with cudaMalloc. Every allocation is a reserved virtual address
 * range (cuMemAddressReserve) backed by one physical allocation (cuMemCreate) mapped
 * into it (cuMemMap, cuMemSetAccess). Pausing a segment unmaps and releases its
 * physical memory (cuMemUnmap, cuMemRelease) and keeps the address range reserved;
 * resuming creates new physical memory and maps it at the same addresses. Whoever
 * holds a pointer into the segment (a tensor, autograd, a compiled graph, DLPack,
 * another thread) sees the same addresses afterwards; the Python engine moves the
 * bytes out before a pause and back after a resume. The same design as vLLM's
 * CuMemAllocator and SGLang's torch_memory_saver (see docs/design.md for why this
 * project keeps its own: it must route every thread's allocations and hand the bytes
 * to its own codec).
 *
 * A second backend ("host") does the same with anonymous host memory: mmap reserves
 * the range, and pausing replaces its pages with an inaccessible mapping
 * (MAP_FIXED | PROT_NONE), which returns them to the operating system. It lets the
 * engine, the table and the codec path run, bit for bit, on machines without a GPU.
 *
 * No CUDA header or library is needed to build this file: the few driver types used
 * are declared below (their layout is the stable ABI of cuda.h since CUDA 10.2) and
 * the driver is opened with dlopen("libcuda.so.1") at vgpu_init.
 *
 * Thread safety: one mutex guards the segment table; the allocator entry points may
 * be called from any thread (PyTorch calls them with its own allocator lock held).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>

/* ---- the driver API subset (cuda.h) ------------------------------------------------ */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes; /* none = 0 */
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

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define VGPU_ERROR_NOT_INITIALISED 900
#define VGPU_ERROR_UNKNOWN_POINTER 901
#define VGPU_ERROR_BAD_STATE 902
#define VGPU_ERROR_NO_DRIVER 903
#define VGPU_ERROR_HOST 904

static struct {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxSetCurrent)(CUcontext);
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
  CUresult (*cuCtxSynchronize)(void);
} drv;

/* ---- the segment table ------------------------------------------------------------- */
typedef struct {
  uint64_t ptr;   /* start of the reserved range */
  uint64_t size;  /* bytes, a multiple of the granularity */
  int device;     /* CUDA ordinal (0 for the host backend) */
  int mapped;     /* 1: physical memory behind it; 0: paused */
  CUmemGenericAllocationHandle handle;
} Segment;

enum { BACKEND_NONE = 0, BACKEND_CUDA = 1, BACKEND_HOST = 2 };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_backend = BACKEND_NONE;
static Segment *g_segments = NULL;
static size_t g_count = 0, g_capacity = 0;
static uint64_t g_mapped_bytes = 0, g_paused_bytes = 0;
static uint64_t g_limit = 0; /* 0: none; else malloc refuses past this many mapped bytes */
static int g_last_error = 0;
static char g_message[256];

static void set_error(int code, const char *what) {
  g_last_error = code;
  snprintf(g_message, sizeof g_message, "%s failed with error %d", what, code);
}

static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

static Segment *find(uint64_t ptr) {
  for (size_t i = 0; i < g_count; i++)
    if (g_segments[i].ptr == ptr) return &g_segments[i];
  return NULL;
}

static int append(Segment s) {
  if (g_count == g_capacity) {
    size_t cap = g_capacity ? 2 * g_capacity : 64;
    Segment *grown = realloc(g_segments, cap * sizeof(Segment));
    if (!grown) return 0;
    g_segments = grown;
    g_capacity = cap;
  }
  g_segments[g_count++] = s;
  return 1;
}

static void remove_at(Segment *s) {
  size_t i = (size_t)(s - g_segments);
  g_segments[i] = g_segments[--g_count];
}

/* ---- CUDA backend ------------------------------------------------------------------ */
static int load_driver(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return 0;
#define SYM(name) if (!(*(void **)&drv.name = dlsym(lib, #name))) return 0
  SYM(cuInit); SYM(cuDeviceGet); SYM(cuCtxGetCurrent); SYM(cuCtxSetCurrent);
  SYM(cuDevicePrimaryCtxRetain); SYM(cuMemGetAllocationGranularity); SYM(cuMemAddressReserve);
  SYM(cuMemAddressFree); SYM(cuMemCreate); SYM(cuMemRelease); SYM(cuMemMap); SYM(cuMemUnmap);
  SYM(cuMemSetAccess); SYM(cuCtxSynchronize);
#undef SYM
  return drv.cuInit(0) == CUDA_SUCCESS;
}

/* The driver API needs a current context; threads PyTorch never touched have none. */
static CUresult ensure_context(int device) {
  CUcontext ctx = NULL;
  CUresult r = drv.cuCtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS || ctx) return r;
  CUdevice dev;
  if ((r = drv.cuDeviceGet(&dev, device)) != CUDA_SUCCESS) return r;
  if ((r = drv.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) return r;
  return drv.cuCtxSetCurrent(ctx);
}

static void props(CUmemAllocationProp *p, int device) {
  memset(p, 0, sizeof *p);
  p->type = 1;
  p->location.type = 1;
  p->location.id = device;
}

static CUresult granularity(int device, size_t *out) {
  CUmemAllocationProp p;
  props(&p, device);
  return drv.cuMemGetAllocationGranularity(out, &p, 0);
}

/* Physical memory for [ptr, ptr + size), mapped read-write. */
static CUresult cuda_back(Segment *s) {
  CUmemAllocationProp p;
  props(&p, s->device);
  CUresult r = drv.cuMemCreate(&s->handle, s->size, &p, 0);
  if (r != CUDA_SUCCESS) return r;
  if ((r = drv.cuMemMap(s->ptr, s->size, 0, s->handle, 0)) != CUDA_SUCCESS) {
    drv.cuMemRelease(s->handle);
    return r;
  }
  CUmemAccessDesc access = {{1, s->device}, 3};
  if ((r = drv.cuMemSetAccess(s->ptr, s->size, &access, 1)) != CUDA_SUCCESS) {
    drv.cuMemUnmap(s->ptr, s->size);
    drv.cuMemRelease(s->handle);
  }
  return r;
}

static CUresult cuda_unback(Segment *s) {
  CUresult r = drv.cuMemUnmap(s->ptr, s->size);
  if (r != CUDA_SUCCESS) return r;
  return drv.cuMemRelease(s->handle);
}

/* ---- host backend ------------------------------------------------------------------ */
static int host_map(Segment *s, int prot) {
  void *p = mmap((void *)(uintptr_t)s->ptr, s->size, prot,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? errno : 0;
}

/* ---- entry points ------------------------------------------------------------------ */

/* Select the backend: 1 = CUDA (opens libcuda), 2 = host. Returns 0 or an error code. */
int vgpu_init(int backend) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  if (g_backend != BACKEND_NONE && g_backend != backend) rc = VGPU_ERROR_BAD_STATE;
  else if (backend == BACKEND_CUDA && g_backend == BACKEND_NONE && !load_driver())
    rc = VGPU_ERROR_NO_DRIVER;
  else if (backend != BACKEND_CUDA && backend != BACKEND_HOST) rc = VGPU_ERROR_BAD_STATE;
  else g_backend = backend;
  if (rc) set_error(rc, "vgpu_init");
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* Mapped bytes above which vgpu_malloc refuses (0: no limit). */
void vgpu_set_limit(uint64_t bytes) { g_limit = bytes; }

/* PyTorch's pluggable-allocator malloc: void* (size_t size, int device, cudaStream_t). */
void *vgpu_malloc(ssize_t size, int device, void *stream) {
  (void)stream;
  void *out = NULL;
  pthread_mutex_lock(&g_lock);
  Segment s = {0, 0, device, 1, 0};
  if (g_backend == BACKEND_CUDA) {
    size_t g = 0;
    CUresult r = ensure_context(device);
    if (r == CUDA_SUCCESS) r = granularity(device, &g);
    if (r != CUDA_SUCCESS) { set_error(r, "granularity"); goto done; }
    s.size = round_up((uint64_t)size, g);
    if (g_limit && g_mapped_bytes + s.size > g_limit) {
      set_error(CUDA_ERROR_OUT_OF_MEMORY, "limit");
      goto done;
    }
    if ((r = drv.cuMemAddressReserve((CUdeviceptr *)&s.ptr, s.size, g, 0, 0)) != CUDA_SUCCESS) {
      set_error(r, "cuMemAddressReserve");
      goto done;
    }
    if ((r = cuda_back(&s)) != CUDA_SUCCESS) {
      drv.cuMemAddressFree(s.ptr, s.size);
      set_error(r, "cuMemCreate/cuMemMap");
      goto done;
    }
  } else if (g_backend == BACKEND_HOST) {
    s.size = round_up((uint64_t)size, 2u << 20);
    if (g_limit && g_mapped_bytes + s.size > g_limit) {
      set_error(CUDA_ERROR_OUT_OF_MEMORY, "limit");
      goto done;
    }
    void *p = mmap(NULL, s.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { set_error(VGPU_ERROR_HOST, "mmap"); goto done; }
    s.ptr = (uint64_t)(uintptr_t)p;
  } else {
    set_error(VGPU_ERROR_NOT_INITIALISED, "vgpu_malloc");
    goto done;
  }
  if (!append(s)) {
    if (g_backend == BACKEND_CUDA) { cuda_unback(&s); drv.cuMemAddressFree(s.ptr, s.size); }
    else munmap((void *)(uintptr_t)s.ptr, s.size);
    set_error(VGPU_ERROR_HOST, "table");
    goto done;
  }
  g_mapped_bytes += s.size;
  out = (void *)(uintptr_t)s.ptr;
done:
  pthread_mutex_unlock(&g_lock);
  return out;
}

/* PyTorch's pluggable-allocator free: void (void* ptr, size_t size, int device, cudaStream_t). */
void vgpu_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size; (void)stream;
  pthread_mutex_lock(&g_lock);
  Segment *s = find((uint64_t)(uintptr_t)ptr);
  if (!s) { set_error(VGPU_ERROR_UNKNOWN_POINTER, "vgpu_free"); goto done; }
  if (g_backend == BACKEND_CUDA) {
    ensure_context(device);
    drv.cuCtxSynchronize(); /* cudaFree's contract: work still using the memory finishes first */
    if (s->mapped) cuda_unback(s);
    drv.cuMemAddressFree(s->ptr, s->size);
  } else {
    munmap((void *)(uintptr_t)s->ptr, s->size);
  }
  if (s->mapped) g_mapped_bytes -= s->size; else g_paused_bytes -= s->size;
  remove_at(s);
done:
  pthread_mutex_unlock(&g_lock);
}

/* Release the physical memory of the segment starting at ptr; its addresses stay reserved. */
int vgpu_unmap(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  Segment *s = find(ptr);
  if (!s) rc = VGPU_ERROR_UNKNOWN_POINTER;
  else if (!s->mapped) rc = VGPU_ERROR_BAD_STATE;
  else if (g_backend == BACKEND_CUDA) {
    rc = ensure_context(s->device);
    if (!rc) rc = cuda_unback(s);
  } else rc = host_map(s, PROT_NONE);
  if (rc) set_error(rc, "unmap");
  else { s->mapped = 0; g_mapped_bytes -= s->size; g_paused_bytes += s->size; }
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* New physical memory behind the paused segment at ptr, at the same addresses.
 * Returns 2 (CUDA_ERROR_OUT_OF_MEMORY) when the device has no room: nothing changes. */
int vgpu_map(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  Segment *s = find(ptr);
  if (!s) rc = VGPU_ERROR_UNKNOWN_POINTER;
  else if (s->mapped) rc = VGPU_ERROR_BAD_STATE;
  else if (g_backend == BACKEND_CUDA) {
    rc = ensure_context(s->device);
    if (!rc) rc = cuda_back(s);
  } else rc = host_map(s, PROT_READ | PROT_WRITE);
  if (rc) set_error(rc, "map");
  else { s->mapped = 1; g_mapped_bytes += s->size; g_paused_bytes -= s->size; }
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* Copy up to n segments into the arrays; returns how many segments there are. */
size_t vgpu_segments(uint64_t *ptrs, uint64_t *sizes, int *devices, int *mapped, size_t n) {
  pthread_mutex_lock(&g_lock);
  size_t count = g_count;
  for (size_t i = 0; i < count && i < n; i++) {
    ptrs[i] = g_segments[i].ptr;
    sizes[i] = g_segments[i].size;
    devices[i] = g_segments[i].device;
    mapped[i] = g_segments[i].mapped;
  }
  pthread_mutex_unlock(&g_lock);
  return count;
}

uint64_t vgpu_mapped_bytes(void) { return g_mapped_bytes; }
uint64_t vgpu_paused_bytes(void) { return g_paused_bytes; }
int vgpu_backend(void) { return g_backend; }
int vgpu_last_error(void) { return g_last_error; }
const char *vgpu_last_message(void) { return g_message; }

/* ---- the CUDA runtime's cudaMalloc and cudaFree, interposed (LD_PRELOAD) ----------- */
#include <link.h>

typedef int (*cuda_malloc_fn)(void **, size_t);
typedef int (*cuda_free_fn)(void *);
typedef int (*cuda_get_device_fn)(int *);
static cuda_free_fn real_free;
static cuda_malloc_fn real_malloc;
static cuda_get_device_fn real_get_device;

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
  return lib ? dlsym(lib, name) : NULL;
}

/* 0: not decided; 1: allocations go through the table; -1: pass through. */
static int g_interpose = 0;

static int interposing(void) {
  if (g_interpose == 0) {
    const char *off = getenv("JUPYTER_VGPU_PAUSABLE");
    g_interpose = (off && strcmp(off, "0") == 0) ? -1 : 1;
    if (g_interpose == 1 && g_backend == BACKEND_NONE && vgpu_init(BACKEND_CUDA) != 0) g_interpose = -1;
  }
  return g_interpose == 1 && g_backend == BACKEND_CUDA;
}

int cudaMalloc(void **ptr, size_t size) {
  if (!interposing()) {
    if (!real_malloc) real_malloc = (cuda_malloc_fn)runtime_symbol("cudaMalloc");
    return real_malloc ? real_malloc(ptr, size) : 35 /* cudaErrorInsufficientDriver */;
  }
  if (!real_get_device) real_get_device = (cuda_get_device_fn)runtime_symbol("cudaGetDevice");
  int device = 0;
  if (real_get_device) real_get_device(&device);
  if (size == 0) { *ptr = NULL; return 0; }
  void *p = vgpu_malloc((ssize_t)size, device, NULL);
  if (!p) return 2; /* cudaErrorMemoryAllocation */
  *ptr = p;
  return 0;
}

int cudaFree(void *ptr) {
  if (ptr && g_backend == BACKEND_CUDA) {
    pthread_mutex_lock(&g_lock);
    Segment *s = find((uint64_t)(uintptr_t)ptr);
    int device = s ? s->device : 0;
    pthread_mutex_unlock(&g_lock);
    if (s) {
      vgpu_free(ptr, 0, device, NULL);
      return 0;
    }
  }
  if (!real_free) real_free = (cuda_free_fn)runtime_symbol("cudaFree");
  return real_free ? real_free(ptr) : 35;
}

/* 1 when this process's cudaMalloc is this library's (it was loaded with LD_PRELOAD).
 * The lookup goes through the main program's handle, which sees the global scope only:
 * RTLD_DEFAULT would also search this library's own scope when it was loaded with
 * RTLD_LOCAL (ctypes), and so always find its own cudaMalloc. */
int vgpu_preloaded(void) {
  void *main_program = dlopen(NULL, RTLD_NOW);
  void *found = main_program ? dlsym(main_program, "cudaMalloc") : NULL;
  return found == (void *)cudaMalloc;
}
