/*
 * Pausable device memory: every device allocation of a process over the CUDA
 * virtual-memory API, whichever API makes it.
 *
 * Loaded into a kernel with LD_PRELOAD (interpose.c), the library takes the place of
 * the CUDA runtime's cudaMalloc and cudaFree and of the driver's allocation entry
 * points, however a caller reaches them: linked directly, through dlsym, through
 * cuGetProcAddress or the runtime's cudaGetDriverEntryPoint (how the runtime itself,
 * PyTorch's driver calls, CuPy and JAX find the driver). Three kinds of memory result:
 *
 *   - segments of ours (this file): each cudaMalloc, cuMemAlloc and large
 *     stream-ordered allocation is a reserved virtual address range
 *     (cuMemAddressReserve) with one physical allocation (cuMemCreate) mapped into it.
 *     Allocations under 1 MiB share 2 MiB segments (arena.c), as the driver packs
 *     small allocations itself.
 *   - allocations others make with cuMemCreate (PyTorch's expandable segments, XLA,
 *     NCCL): the caller gets a handle of ours standing for the driver's (handles.c), so
 *     that the physical memory behind every mapping of it can be released and created
 *     again under the same handle and addresses.
 *   - memory shared with other processes through CUDA IPC (ipc.c): exported segments
 *     stay on the card (a peer maps them), imported ones belong to their exporter.
 *
 * Pausing a unit releases its physical memory (cuMemUnmap, cuMemRelease) and keeps its
 * addresses reserved; resuming creates new physical memory and maps it at the same
 * addresses. Whoever holds a pointer (a tensor, autograd, a CUDA graph, DLPack,
 * another thread) sees the same addresses afterwards; the Python engine moves the
 * bytes out before a pause and back after a resume. The same design as vLLM's
 * CuMemAllocator and SGLang's torch_memory_saver (docs/design.md says why this project
 * keeps its own: it must route every allocation of every thread and library, and hand
 * the bytes to its own codec).
 *
 * A second backend ("host") does the same with anonymous host memory: mmap reserves
 * the range, and pausing replaces its pages with an inaccessible mapping
 * (MAP_FIXED | PROT_NONE), which returns them to the operating system. It lets the
 * engine, the table and the codec path run, bit for bit, on machines without a GPU.
 *
 * Thread safety: one mutex guards every table; the entry points may be called from any
 * thread (PyTorch calls them with its own allocator lock held). After fork() the child
 * gets a fresh mutex (CUDA cannot be used in a child of a CUDA process anyway).
 */
#include "vmm.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

Driver drv;
int g_backend = BACKEND_NONE;
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t g_mapped_bytes = 0, g_paused_bytes = 0;
static Segment **g_segments = NULL; /* sorted by ptr; pointers stay valid while listed */
static size_t g_count = 0, g_capacity = 0;
static int g_fd_handles = 1; /* segments ask for POSIX fd handles (CUDA IPC) until refused */

static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

void vgpu_trace(const char *fmt, ...) {
  static int on = -1;
  if (on < 0) {
    const char *v = getenv("JUPYTER_VGPU_TRACE");
    on = v && *v && strcmp(v, "0") != 0;
  }
  if (!on) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "jupyter-vgpu[%d]: %s\n", (int)getpid(), line);
}

/* ---- the driver -------------------------------------------------------------------- */

static pthread_once_t g_resolved_once = PTHREAD_ONCE_INIT;
static int g_resolved = 0;
static __thread int t_resolving = 0; /* libcuda's own start-up may look symbols up through us */

/* Every entry point of the table: those the library needs first (a driver without one
 * of them is no driver to it), then the rest where the driver has them. */
static void resolve(void) {
  t_resolving = 1;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  t_resolving = 0;
  if (!lib) return;
#define SYM(name) (*(void **)&drv.name = vgpu_real_dlsym(lib, #name))
#define NEEDED(name, need, params) if (need && !SYM(name)) return;
#define OPTIONAL(name, need, params) if (!need) SYM(name);
#define OPTIONAL_HELD(name, params, args) SYM(name);
  VGPU_DRIVER_ENTRIES(NEEDED, NEEDED, VGPU_NONE2)
  VGPU_DRIVER_ENTRIES(OPTIONAL, OPTIONAL, OPTIONAL_HELD)
#undef OPTIONAL_HELD
#undef OPTIONAL
#undef NEEDED
#undef SYM
  __atomic_store_n(&g_resolved, 1, __ATOMIC_RELEASE);
}

int vgpu_resolve_driver(void) {
  if (t_resolving) return 0;
  pthread_once(&g_resolved_once, resolve);
  return g_resolved;
}

/* ---- errors: the calling thread's last ---------------------------------------------- */
/* Per thread: a thread that reads its last error (vmm.py, after a call of its own failed)
 * never reads another thread's, made meanwhile. */
static __thread int t_error = 0;
static __thread char t_words[256];

void set_error(int code, const char *fmt, ...) {
  t_error = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_words, sizeof t_words, fmt, ap);
  va_end(ap);
}

/* The calling thread's last error: a CUresult or one of the library's own (900-904). */
int vgpu_last_error(void) { return t_error; }

/* The library's words for the calling thread's last error: what failed, and why where
 * the library knows more than the code says. */
const char *vgpu_last_message(void) { return t_words; }

/* The driver answers questions about its errors through the library's handle on it, when
 * it is loaded (never loaded for this) and the process is not suspended (the driver's
 * checkpoint would hold the call). */
static int driver_answers(void) {
  return __atomic_load_n(&g_resolved, __ATOMIC_ACQUIRE) &&
         __atomic_load_n(&g_vgpu_away, __ATOMIC_SEQ_CST) != VGPU_SUSPENDED;
}

/* The name of an error code the library returned (CUDA_ERROR_OUT_OF_MEMORY): its own
 * first, whose numbers the driver uses for other errors; else the driver's
 * (cuGetErrorName); else the name the library knows it by; else NULL. */
const char *vgpu_error_name(int code) {
#define OWN(name, value, words) if (code == value) return #name;
  VGPU_OWN_ERRORS(OWN)
#undef OWN
  const char *name = NULL;
  if (driver_answers() && drv.cuGetErrorName && drv.cuGetErrorName(code, &name) == CUDA_SUCCESS && name)
    return name;
#define KNOWN(known, value) if (code == value) return #known;
  VGPU_CUDA_ERRORS(KNOWN)
#undef KNOWN
  return NULL;
}

/* The words for an error code the library returned ("out of memory"): its own first,
 * else the driver's (cuGetErrorString); else NULL. */
const char *vgpu_error_string(int code) {
#define OWN(name, value, words) if (code == value) return words;
  VGPU_OWN_ERRORS(OWN)
#undef OWN
  const char *text = NULL;
  if (driver_answers() && drv.cuGetErrorString && drv.cuGetErrorString(code, &text) == CUDA_SUCCESS && text)
    return text;
  return NULL;
}

/* 0 when the driver is there and initialised; else the error, with words. */
static int load_driver(void) {
  if (!vgpu_resolve_driver()) {
    set_error(VGPU_ERROR_NO_DRIVER, "libcuda.so.1 cannot be loaded, or lacks an entry point the library needs");
    return VGPU_ERROR_NO_DRIVER;
  }
  CUresult r = drv.cuInit(0);
  if (r == CUDA_SUCCESS) return 0;
  const char *name = vgpu_error_name(r);
  set_error(VGPU_ERROR_NO_DRIVER, "cuInit answered %s (%d)", name ? name : "an error", r);
  return VGPU_ERROR_NO_DRIVER;
}

/* The driver API needs a current context; threads PyTorch never touched have none. */
CUresult ensure_context(int device) {
  CUcontext ctx = NULL;
  CUresult r = drv.cuCtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS || ctx) return r;
  CUdevice dev;
  if ((r = drv.cuDeviceGet(&dev, device)) != CUDA_SUCCESS) return r;
  if ((r = drv.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) return r;
  return drv.cuCtxSetCurrent(ctx);
}

CUresult current_device(int *device) {
  CUcontext ctx = NULL;
  CUresult r = drv.cuCtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS) return r;
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  CUdevice dev = 0;
  r = drv.cuCtxGetDevice(&dev);
  *device = dev;
  return r;
}

static void props(CUmemAllocationProp *p, int device, int fd) {
  memset(p, 0, sizeof *p);
  p->type = 1;
  p->requestedHandleTypes = fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
  p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->location.id = device;
}

static CUresult granularity(int device, uint64_t *out) {
  CUmemAllocationProp p;
  props(&p, device, 0);
  size_t g = 0;
  CUresult r = drv.cuMemGetAllocationGranularity(&g, &p, 0);
  *out = g ? g : (2u << 20);
  return r;
}

/* ---- the segment table ------------------------------------------------------------- */

/* Index of the first segment whose ptr is > addr. */
static size_t upper(uint64_t addr) {
  size_t lo = 0, hi = g_count;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_segments[mid]->ptr <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

Segment *seg_containing(uint64_t addr) {
  size_t i = upper(addr);
  if (i == 0) return NULL;
  Segment *s = g_segments[i - 1];
  return addr < s->ptr + s->size ? s : NULL;
}

static Segment *seg_at(uint64_t ptr) {
  Segment *s = seg_containing(ptr);
  return s && s->ptr == ptr ? s : NULL;
}

static int insert(Segment *s) {
  if (!VGPU_ROOM(g_segments, g_count, g_capacity, 256)) return 0;
  size_t i = upper(s->ptr);
  memmove(g_segments + i + 1, g_segments + i, (g_count - i) * sizeof *g_segments);
  g_segments[i] = s;
  g_count++;
  return 1;
}

static void unlist(Segment *s) {
  size_t i = upper(s->ptr);
  if (i == 0 || g_segments[i - 1] != s) return;
  memmove(g_segments + i - 1, g_segments + i, (g_count - i) * sizeof *g_segments);
  g_count--;
}

/* Physical memory for the segment's range, mapped; access not set yet (CUDA backend). */
static CUresult seg_back_unset(Segment *s) {
  CUmemAllocationProp p;
  props(&p, s->device, (s->flags & SEG_FD) != 0);
  CUresult r = drv.cuMemCreate(&s->handle, s->size, &p, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) grow_refused(s->device, s->size);
  if (r != CUDA_SUCCESS) return r;
  if ((r = drv.cuMemMap(s->ptr, s->size, 0, s->handle, 0)) != CUDA_SUCCESS) drv.cuMemRelease(s->handle);
  return r;
}

/* Physical memory for the segment's range, mapped read-write. */
static CUresult seg_back(Segment *s) {
  if (g_backend == BACKEND_HOST) {
    void *p = mmap((void *)(uintptr_t)s->ptr, s->size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? VGPU_ERROR_HOST : CUDA_SUCCESS;
  }
  CUresult r = seg_back_unset(s);
  if (r != CUDA_SUCCESS) return r;
  CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, s->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if ((r = drv.cuMemSetAccess(s->ptr, s->size, &access, 1)) != CUDA_SUCCESS) {
    drv.cuMemUnmap(s->ptr, s->size);
    drv.cuMemRelease(s->handle);
  }
  return r;
}

static CUresult seg_unback(Segment *s) {
  if (g_backend == BACKEND_HOST) {
    void *p = mmap((void *)(uintptr_t)s->ptr, s->size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? VGPU_ERROR_HOST : CUDA_SUCCESS;
  }
  CUresult r = drv.cuMemUnmap(s->ptr, s->size);
  if (r != CUDA_SUCCESS) return r;
  return drv.cuMemRelease(s->handle);
}

/* A new mapped segment of at least size bytes (the lock is held). */
CUresult seg_new(int device, uint64_t size, int flags, Segment **out) {
  Segment *s = calloc(1, sizeof *s);
  if (!s) return VGPU_ERROR_HOST;
  s->device = device;
  s->export_fd = -1;
  s->flags = flags;
  CUresult r;
  if (g_backend == BACKEND_HOST) {
    s->size = round_up(size, 2u << 20);
    void *p = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { free(s); return VGPU_ERROR_HOST; }
    s->ptr = (uint64_t)(uintptr_t)p;
  } else if (g_backend == BACKEND_CUDA) {
    uint64_t g;
    if ((r = ensure_context(device)) != CUDA_SUCCESS || (r = granularity(device, &g)) != CUDA_SUCCESS) {
      free(s);
      return r;
    }
    s->size = round_up(size, g);
    if ((r = drv.cuMemAddressReserve((CUdeviceptr *)&s->ptr, s->size, g, 0, 0)) != CUDA_SUCCESS) {
      free(s);
      return r;
    }
    if (g_fd_handles) s->flags |= SEG_FD;
    r = seg_back(s);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && (s->flags & SEG_FD)) {
      g_fd_handles = 0; /* this driver or platform refuses shareable handles: ask for none */
      s->flags &= ~SEG_FD;
      r = seg_back(s);
    }
    if (r != CUDA_SUCCESS) {
      drv.cuMemAddressFree(s->ptr, s->size);
      free(s);
      return r;
    }
  } else {
    free(s);
    return VGPU_ERROR_NOT_INITIALISED;
  }
  if (!insert(s)) {
    if (g_backend == BACKEND_CUDA) { seg_unback(s); drv.cuMemAddressFree(s->ptr, s->size); }
    else munmap((void *)(uintptr_t)s->ptr, s->size);
    free(s);
    return VGPU_ERROR_HOST;
  }
  s->mapped = 1;
  g_mapped_bytes += s->size;
  *out = s;
  return CUDA_SUCCESS;
}

/* Free a segment, mapped or paused (the lock is held; the caller synchronized). */
void seg_delete(Segment *s) {
  unlist(s);
  ipc_forget(s);
  if (s->chunk) arena_chunk_released(s->chunk);
  if (g_backend == BACKEND_CUDA) {
    if (s->mapped) seg_unback(s);
    drv.cuMemAddressFree(s->ptr, s->size);
  } else {
    munmap((void *)(uintptr_t)s->ptr, s->size);
  }
  if (s->mapped) g_mapped_bytes -= s->size;
  else g_paused_bytes -= s->size;
  free(s);
}

/* The descriptor of the CUDA IPC export named token, or -1 (the lock is held). */
int seg_export_fd(uint64_t token) {
  for (size_t i = 0; i < g_count; i++)
    if (g_segments[i]->export_fd >= 0 && g_segments[i]->token == token) return g_segments[i]->export_fd;
  return -1;
}

/* ---- entry points for the engine (vmm.py) ------------------------------------------ */

/* Select the backend: 1 = CUDA (opens libcuda), 2 = host. Returns 0 or an error code. */
int vgpu_init(int backend) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  if (g_backend != BACKEND_NONE && g_backend != backend) {
    rc = VGPU_ERROR_BAD_STATE;
    set_error(rc, "backend %d was chosen before backend %d", g_backend, backend);
  } else if (backend == BACKEND_CUDA && g_backend == BACKEND_NONE) {
    rc = load_driver(); /* its words say why */
  } else if (backend != BACKEND_CUDA && backend != BACKEND_HOST) {
    rc = VGPU_ERROR_BAD_STATE;
    set_error(rc, "there is no backend %d", backend);
  }
  if (!rc) g_backend = backend;
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* A new mapped segment of at least size bytes on device (PyTorch's pluggable-allocator
 * malloc signature: void* (size_t size, int device, cudaStream_t)); NULL on failure. */
void *vgpu_malloc(ssize_t size, int device, void *stream) {
  (void)stream;
  Segment *s = NULL;
  uint64_t ptr = 0;
  CUresult r;
  Growth g;
  grow_start(&g);
  do {
    pthread_mutex_lock(&g_lock);
    r = g_backend == BACKEND_NONE ? VGPU_ERROR_NOT_INITIALISED : seg_new(device, (uint64_t)size, 0, &s);
    if (r == CUDA_SUCCESS) ptr = s->ptr;
    pthread_mutex_unlock(&g_lock);
  } while (grow_again(&g, r));
  grow_end(&g, r);
  if (r != CUDA_SUCCESS) set_error(r, "a segment of %zd bytes on device %d", size, device);
  return (void *)(uintptr_t)ptr;
}

/* Free the segment at ptr, mapped or paused (the pluggable allocator's free signature). */
void vgpu_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size; (void)stream; (void)device;
  pthread_mutex_lock(&g_lock);
  Segment *s = seg_at((uint64_t)(uintptr_t)ptr);
  int dev = s ? s->device : 0;
  pthread_mutex_unlock(&g_lock);
  if (!s) {
    set_error(VGPU_ERROR_UNKNOWN_POINTER, "freeing %p: no segment of ours starts there", ptr);
    return;
  }
  if (g_backend == BACKEND_CUDA) { /* cudaFree's contract; without the lock (see free_sync) */
    ensure_context(dev);
    drv.cuCtxSynchronize();
  }
  pthread_mutex_lock(&g_lock);
  s = seg_at((uint64_t)(uintptr_t)ptr);
  if (s) seg_delete(s);
  else set_error(VGPU_ERROR_UNKNOWN_POINTER, "freeing %p: another thread freed it meanwhile", ptr);
  pthread_mutex_unlock(&g_lock);
}

/* Release the physical memory of the unit at ptr; its addresses stay reserved. */
int vgpu_unmap(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  const char *why = "";
  Segment *s = seg_at(ptr);
  if (!s) {
    rc = handles_unmap(ptr);
    if (rc < 0) rc = VGPU_ERROR_UNKNOWN_POINTER;
    if (rc == VGPU_ERROR_BAD_STATE) why = ": paused already, or shared with another process";
  } else if (!s->mapped || (s->flags & (SEG_EXPORTED | SEG_CACHED))) {
    rc = VGPU_ERROR_BAD_STATE;
    why = !s->mapped                    ? ": paused already"
          : (s->flags & SEG_EXPORTED) ? ": shared with another process (CUDA IPC)"
                                        : ": freed, kept for reuse";
  } else {
    if (g_backend == BACKEND_CUDA) rc = ensure_context(s->device);
    if (!rc) rc = seg_unback(s);
    if (!rc) { s->mapped = 0; g_mapped_bytes -= s->size; g_paused_bytes += s->size; }
  }
  if (rc) set_error(rc, "releasing the unit at %#llx%s", (unsigned long long)ptr, why);
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* New physical memory behind the paused unit at ptr, at the same addresses.
 * Returns 2 (CUDA_ERROR_OUT_OF_MEMORY) when the device has no room: nothing changes. */
int vgpu_map(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int rc = 0;
  Segment *s = seg_at(ptr);
  if (!s) {
    rc = handles_map(ptr);
    if (rc < 0) rc = VGPU_ERROR_UNKNOWN_POINTER;
  } else if (s->mapped) rc = VGPU_ERROR_BAD_STATE;
  else {
    if (g_backend == BACKEND_CUDA) rc = ensure_context(s->device);
    if (!rc) rc = seg_back(s);
    if (!rc) { s->mapped = 1; g_mapped_bytes += s->size; g_paused_bytes -= s->size; }
  }
  if (rc)
    set_error(rc, "mapping the unit at %#llx%s", (unsigned long long)ptr,
              rc == VGPU_ERROR_BAD_STATE ? ": mapped already" : "");
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* ---- many units at once ------------------------------------------------------------ */
typedef struct {
  uint64_t va, size;
  int count;
  CUmemAccessDesc access[MAX_ACCESS];
} Run;

typedef struct {
  Run *runs;
  size_t n, cap;
  int failed;
} Runs;

static void note_run(void *ctx, uint64_t va, uint64_t size, const CUmemAccessDesc *access, int count) {
  Runs *rs = ctx;
  if (!VGPU_ROOM(rs->runs, rs->n, rs->cap, 256)) {
    rs->failed = 1;
    return;
  }
  Run *r = &rs->runs[rs->n++];
  r->va = va;
  r->size = size;
  r->count = count < MAX_ACCESS ? count : MAX_ACCESS;
  memcpy(r->access, access, (size_t)r->count * sizeof *access);
}

static int by_va(const void *a, const void *b) {
  uint64_t x = ((const Run *)a)->va, y = ((const Run *)b)->va;
  return x < y ? -1 : x > y;
}

static int same_access(const Run *a, const Run *b) {
  return a->count == b->count && memcmp(a->access, b->access, (size_t)a->count * sizeof *a->access) == 0;
}

/* Map the paused units at ptrs[0..n) again, all or none: on failure every unit this call
 * mapped is released again and the error is returned (2: the device has no room). Access
 * is set once per run of adjacent units with the same access: PyTorch's expandable
 * segments are pages of 20 MiB side by side, and on the H100 a unit's create, map and
 * access cost about 55 us together, a third of it the access. */
int vgpu_map_many(const uint64_t *ptrs, size_t n) {
  if (g_backend != BACKEND_CUDA) {
    for (size_t i = 0; i < n; i++) {
      int rc = vgpu_map(ptrs[i]);
      if (rc) {
        while (i--) vgpu_unmap(ptrs[i]);
        return rc;
      }
    }
    return 0;
  }
  pthread_mutex_lock(&g_lock);
  Runs rs = {NULL, 0, 0, 0};
  int rc = 0;
  size_t done = 0;
  for (; done < n && !rc; done++) {
    Segment *s = seg_at(ptrs[done]);
    if (!s) {
      rc = handles_map_unset(ptrs[done], note_run, &rs);
      if (rc < 0) rc = VGPU_ERROR_UNKNOWN_POINTER;
    } else if (s->mapped) {
      rc = VGPU_ERROR_BAD_STATE;
    } else if (!(rc = ensure_context(s->device)) && !(rc = seg_back_unset(s))) {
      s->mapped = 1;
      g_mapped_bytes += s->size;
      g_paused_bytes -= s->size;
      CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, s->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
      note_run(&rs, s->ptr, s->size, &access, 1);
    }
    if (rc) break;
  }
  if (!rc && rs.failed) rc = VGPU_ERROR_HOST;
  if (!rc) {
    qsort(rs.runs, rs.n, sizeof *rs.runs, by_va);
    for (size_t i = 0; i < rs.n && !rc;) {
      size_t j = i + 1;
      uint64_t end = rs.runs[i].va + rs.runs[i].size;
      while (j < rs.n && rs.runs[j].va == end && same_access(&rs.runs[i], &rs.runs[j])) end += rs.runs[j++].size;
      rc = drv.cuMemSetAccess(rs.runs[i].va, end - rs.runs[i].va, rs.runs[i].access, (size_t)rs.runs[i].count);
      i = j;
    }
  }
  if (rc) { /* release what this call mapped: every unit stays paused */
    for (size_t i = 0; i < done; i++) {
      Segment *s = seg_at(ptrs[i]);
      if (s && s->mapped) {
        drv.cuMemUnmap(s->ptr, s->size);
        drv.cuMemRelease(s->handle);
        s->mapped = 0;
        g_mapped_bytes -= s->size;
        g_paused_bytes += s->size;
      } else if (!s) {
        handles_unmap(ptrs[i]);
      }
    }
    if (done < n)
      set_error(rc, "mapping %zu paused units: the unit at %#llx%s", n, (unsigned long long)ptrs[done],
                rc == VGPU_ERROR_BAD_STATE ? " is mapped already" : "");
    else
      set_error(rc, "mapping %zu paused units: setting their access", n);
  }
  free(rs.runs);
  pthread_mutex_unlock(&g_lock);
  return rc;
}

/* Copy up to n units into the arrays (address, bytes, device, UNIT_* flags); returns
 * how many units there are: the segments of ours (cached ones left out: they hold
 * nothing), then every allocation made with cuMemCreate by others that is mapped
 * somewhere, at the address of a mapping that covers it whole. */
size_t vgpu_units(uint64_t *ptrs, uint64_t *sizes, int *devices, int *flags, size_t n) {
  pthread_mutex_lock(&g_lock);
  size_t k = 0;
  for (size_t i = 0; i < g_count; i++) {
    Segment *s = g_segments[i];
    if (s->flags & SEG_CACHED) continue;
    if (k < n) {
      ptrs[k] = s->ptr;
      sizes[k] = s->size;
      devices[k] = s->device;
      flags[k] = (s->mapped ? UNIT_MAPPED : 0) | (s->chunk ? UNIT_CHUNK : 0) |
                 ((s->flags & SEG_ASYNC) ? UNIT_ASYNC : 0) |
                 ((s->flags & SEG_EXPORTED) ? UNIT_EXPORTED : UNIT_PAUSABLE);
    }
    k++;
  }
  k += handles_units(k < n ? ptrs + k : NULL, k < n ? sizes + k : NULL, k < n ? devices + k : NULL,
                     k < n ? flags + k : NULL, k < n ? n - k : 0);
  pthread_mutex_unlock(&g_lock);
  return k;
}

/* Reap finished stream-ordered frees and let go of memory that holds nothing (freed
 * segments kept for reuse, empty chunks); the caller synchronized the device. */
void vgpu_collect(void) {
  pthread_mutex_lock(&g_lock);
  async_collect(1);
  pthread_mutex_unlock(&g_lock);
}

/* Figures, bytes, each byte in one of them: [0] segments of ours mapped and pausable,
 * [1] paused, [2] others' cuMemCreate memory mapped and pausable, [3] paused, [4] memory
 * exported through CUDA IPC (never paused), [5] other processes' memory imported here,
 * [6] managed (unified) memory, [7] memory let through to the driver (stream-ordered
 * allocations inside a graph capture, or from a pool of the caller's), [8] others'
 * cuMemCreate memory no single mapping covers, [9] stream-ordered allocations live (a
 * part of [0]), [10] freed stream-ordered segments kept for reuse (they hold nothing),
 * [11] chunks of small allocations (a part of [0]). Returns how many it wrote (at most n). */
size_t vgpu_figures(uint64_t *out, size_t n) {
  uint64_t f[12] = {0};
  pthread_mutex_lock(&g_lock);
  handles_figures(&f[2], &f[3], &f[4], &f[5], &f[8]);
  f[0] = g_mapped_bytes - g_exported_bytes - g_async_cached_bytes;
  f[1] = g_paused_bytes;
  f[4] += g_exported_bytes;
  f[5] += g_imported_bytes;
  f[6] = g_managed_bytes;
  f[7] = g_passthrough_bytes;
  f[9] = g_async_live_bytes;
  f[10] = g_async_cached_bytes;
  f[11] = g_arena_bytes;
  pthread_mutex_unlock(&g_lock);
  size_t k = n < 12 ? n : 12;
  memcpy(out, f, k * sizeof *out);
  return k;
}

uint64_t vgpu_mapped_bytes(void) { return g_mapped_bytes; }
int vgpu_backend(void) { return g_backend; }

/* ---- fork ------------------------------------------------------------------------- */
static void child_after_fork(void) {
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  g_lock = fresh;
  grow_fork_child(); /* the child is not the kernel the arbiter knows */
  fork_child_reset();
}

static void before_fork(void) { pthread_mutex_lock(&g_lock); }
static void parent_after_fork(void) { pthread_mutex_unlock(&g_lock); }

__attribute__((constructor)) static void at_load(void) {
  pthread_atfork(before_fork, parent_after_fork, child_after_fork);
}
