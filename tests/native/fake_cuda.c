/*
 * A CUDA driver on host memory, for testing the pausable allocator on machines without
 * a GPU: built as libcuda.so.1 into a directory the tests put first on LD_LIBRARY_PATH.
 *
 * It implements the subset of the driver API the library calls and wraps, with the
 * driver's rules where the library relies on them: a physical allocation (cuMemCreate)
 * is a memfd, mapping it is mmap(MAP_SHARED | MAP_FIXED) into a reserved range
 * (cuMemAddressReserve: PROT_NONE), access comes with cuMemSetAccess, memory lives
 * while a handle or a mapping holds it, shareable handles are file descriptors, legacy
 * IPC refuses virtual-memory allocations, cuGetProcAddress hands out versioned and
 * per-thread-stream variants. "Device" memory is host memory, so tests read and write
 * it directly. fake_cuda_used() is the bytes of physical memory alive: NVML's figure.
 *
 * Test controls: fake_cuda_hold_events(1) keeps events not ready; fake_cuda_capture(1)
 * makes every stream look captured; FAKE_CUDA_MEMORY_BYTES in the environment is the
 * device's capacity (unset: none), or FAKE_CUDA_MEMORY_FILE names a file that holds it, read
 * at every allocation (a test's arbiter makes room by raising it, from another process),
 * and fake_cuda_limit(bytes) a limit of the test's on top
 * (0: none): a physical allocation (cuMemCreate, cuMemAlloc and the driver's own pools)
 * that would take the bytes alive past either answers CUDA_ERROR_OUT_OF_MEMORY. A kernel
 * launched is a host function, run on the launching thread (cuLaunchKernel).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The library's view of the driver: its types, and the prototypes of every entry point
 * of its table, so that each function here has the signature the library calls. */
#include "driver.h"
VGPU_DRIVER_ENTRIES(VGPU_DRIVER_PROTO, VGPU_DRIVER_PROTO, VGPU_DRIVER_PROTO_HELD)
CUresult cuDriverGetVersion(int *v);
CUresult cuDeviceGetCount(int *n);
CUresult cuMemAlloc(CUdeviceptr *dptr, unsigned int size);

/* The tests' controls. */
uint64_t fake_cuda_used(void);
void fake_cuda_hold_events(int on);
void fake_cuda_capture(int on);
void fake_cuda_limit(uint64_t bytes);
uint64_t fake_cuda_set_access_calls(void);

typedef CUmemGenericAllocationHandle CUhandle;

#define OK 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define INVALID_CONTEXT 201
#define NOT_FOUND 500
#define NOT_READY 600
#define NOT_SUPPORTED 801
#define GRANULE (2u << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t used = 0; /* physical bytes alive */
static uint64_t pool_used = 0;
static int hold_events = 0, capture = 0;
static uint64_t limit = 0; /* 0: none; else physical allocations refused past this many bytes alive */
static pthread_once_t capacity_once = PTHREAD_ONCE_INIT;
static uint64_t capacity = 0; /* FAKE_CUDA_MEMORY_BYTES; 0: none */
static const char *capacity_file = NULL; /* FAKE_CUDA_MEMORY_FILE, or NULL */
static uint64_t set_access_calls = 0;
static __thread void *current = NULL;

uint64_t fake_cuda_used(void) { return used; }
void fake_cuda_hold_events(int on) { hold_events = on; }
void fake_cuda_capture(int on) { capture = on; }
void fake_cuda_limit(uint64_t bytes) { limit = bytes; }
uint64_t fake_cuda_set_access_calls(void) { return set_access_calls; }

static void read_capacity(void) {
  const char *v = getenv("FAKE_CUDA_MEMORY_BYTES");
  capacity = v && *v ? strtoull(v, NULL, 0) : 0;
  v = getenv("FAKE_CUDA_MEMORY_FILE");
  capacity_file = v && *v ? v : NULL;
}

/* The capacity now: FAKE_CUDA_MEMORY_FILE's number where it is set (0, none, where the file
 * cannot be read: the test replaces it whole), else FAKE_CUDA_MEMORY_BYTES. */
static uint64_t capacity_now(void) {
  if (!capacity_file) return capacity;
  unsigned long long bytes = 0;
  FILE *f = fopen(capacity_file, "r");
  if (f) {
    if (fscanf(f, "%llu", &bytes) != 1) bytes = 0;
    fclose(f);
  }
  return bytes;
}

/* 1 when size more bytes alive would pass the capacity or the test's limit (lock held). */
static int no_room(uint64_t size) {
  pthread_once(&capacity_once, read_capacity);
  uint64_t cap = capacity_now();
  return (limit && used + size > limit) || (cap && used + size > cap);
}

/* ---- physical allocations and mappings ---------------------------------------------- */
typedef struct {
  int fd;
  uint64_t size;
  int refs; /* handle references + mappings */
  CUmemAllocationProp prop;
} Phys;

typedef struct { uint64_t va, size; Phys *p; } Map;
static Map maps[65536];
static int nmaps = 0;

typedef struct { uint64_t ptr, size; int fd; } Legacy;
static Legacy legacy[65536];
static int nlegacy = 0;

static void drop(Phys *p) {
  if (--p->refs > 0) return;
  close(p->fd);
  used -= p->size;
  free(p);
}

static Phys *phys_new(uint64_t size) {
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    return NULL;
  }
  Phys *p = calloc(1, sizeof *p);
  p->fd = fd;
  p->size = size;
  p->refs = 1;
  used += size;
  return p;
}

/* ---- start-up and contexts ------------------------------------------------------------ */
CUresult cuInit(unsigned int flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal == 0 ? OK : 101; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) { (void)dev; *v = attr == 14 ? 32 : 0; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(uintptr_t)(0x2000 + dev); return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }
CUresult cuCtxGetDevice(int *dev) {
  if (!current) return INVALID_CONTEXT;
  *dev = (int)((uintptr_t)current - 0x2000);
  return OK;
}
CUresult cuCtxSynchronize(void) { return current ? OK : INVALID_CONTEXT; }

/* ---- the virtual-memory API ------------------------------------------------------------ */
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
  (void)p; (void)option;
  *g = GRANULE;
  return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
  (void)addr; (void)f;
  if (!align) align = GRANULE;
  uint8_t *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return OUT_OF_MEMORY;
  uint64_t start = ((uint64_t)(uintptr_t)raw + align - 1) / align * align;
  if (start > (uint64_t)(uintptr_t)raw) munmap(raw, start - (uint64_t)(uintptr_t)raw);
  uint64_t end = (uint64_t)(uintptr_t)raw + size + align;
  if (end > start + size) munmap((void *)(uintptr_t)(start + size), end - start - size);
  *ptr = start;
  return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  return munmap((void *)(uintptr_t)ptr, size) == 0 ? OK : INVALID_VALUE;
}

CUresult cuMemCreate(CUhandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
  (void)flags;
  if (!size || size % GRANULE) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (no_room(size)) {
    pthread_mutex_unlock(&lock);
    return OUT_OF_MEMORY;
  }
  Phys *p = phys_new(size);
  if (p) p->prop = *prop;
  pthread_mutex_unlock(&lock);
  if (!p) return OUT_OF_MEMORY;
  *h = (CUhandle)(uintptr_t)p;
  return OK;
}

CUresult cuMemRelease(CUhandle h) {
  pthread_mutex_lock(&lock);
  drop((Phys *)(uintptr_t)h);
  pthread_mutex_unlock(&lock);
  return OK;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUhandle h, unsigned long long flags) {
  (void)flags;
  Phys *p = (Phys *)(uintptr_t)h;
  if (offset + size > p->size) return INVALID_VALUE;
  if (mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset) == MAP_FAILED)
    return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  p->refs++;
  maps[nmaps].va = va;
  maps[nmaps].size = size;
  maps[nmaps++].p = p;
  pthread_mutex_unlock(&lock);
  return OK;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&lock);
  CUresult r = INVALID_VALUE;
  for (int i = 0; i < nmaps; i++) {
    if (maps[i].va < va || maps[i].va >= va + size) continue;
    mmap((void *)(uintptr_t)maps[i].va, maps[i].size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    drop(maps[i].p);
    maps[i--] = maps[--nmaps];
    r = OK;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count) {
  (void)desc; (void)count;
  set_access_calls++;
  return mprotect((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE) == 0 ? OK : INVALID_VALUE;
}

CUresult cuMemRetainAllocationHandle(CUhandle *h, void *addr) {
  pthread_mutex_lock(&lock);
  CUresult r = INVALID_VALUE;
  for (int i = 0; i < nmaps; i++)
    if ((uint64_t)(uintptr_t)addr >= maps[i].va && (uint64_t)(uintptr_t)addr < maps[i].va + maps[i].size) {
      maps[i].p->refs++;
      *h = (CUhandle)(uintptr_t)maps[i].p;
      r = OK;
      break;
    }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUhandle h) {
  *prop = ((Phys *)(uintptr_t)h)->prop;
  return OK;
}

CUresult cuMemExportToShareableHandle(void *out, CUhandle h, int type, unsigned long long flags) {
  (void)flags;
  Phys *p = (Phys *)(uintptr_t)h;
  if (type != 1 || !(p->prop.requestedHandleTypes & 1)) return INVALID_VALUE;
  *(int *)out = dup(p->fd);
  return OK;
}

CUresult cuMemImportFromShareableHandle(CUhandle *h, void *os, int type) {
  if (type != 1) return INVALID_VALUE;
  struct stat st;
  int fd = dup((int)(intptr_t)os);
  if (fd < 0 || fstat(fd, &st) != 0) return INVALID_VALUE;
  Phys *p = calloc(1, sizeof *p);
  p->fd = fd;
  p->size = (uint64_t)st.st_size;
  p->refs = 1;
  p->prop.type = 1;
  p->prop.location.type = 1;
  *h = (CUhandle)(uintptr_t)p; /* the exporter's process counts the bytes */
  return OK;
}

/* ---- legacy allocations --------------------------------------------------------------- */
static CUresult legacy_alloc(CUdeviceptr *dptr, size_t size) {
  if (!current) return INVALID_CONTEXT;
  if (!size) return INVALID_VALUE;
  uint64_t n = (size + 4095) / 4096 * 4096;
  pthread_mutex_lock(&lock);
  int full = no_room(n);
  pthread_mutex_unlock(&lock);
  if (full) return OUT_OF_MEMORY;
  int fd = memfd_create("fake-cuda-legacy", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)n) != 0) return OUT_OF_MEMORY;
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  legacy[nlegacy].ptr = (uint64_t)(uintptr_t)p;
  legacy[nlegacy].size = n;
  legacy[nlegacy++].fd = fd;
  used += n;
  pthread_mutex_unlock(&lock);
  *dptr = (uint64_t)(uintptr_t)p;
  return OK;
}

static CUresult legacy_free(CUdeviceptr dptr) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < nlegacy; i++)
    if (legacy[i].ptr == dptr) {
      munmap((void *)(uintptr_t)dptr, legacy[i].size);
      close(legacy[i].fd);
      used -= legacy[i].size;
      legacy[i] = legacy[--nlegacy];
      pthread_mutex_unlock(&lock);
      return OK;
    }
  pthread_mutex_unlock(&lock);
  return INVALID_VALUE;
}

CUresult cuMemAlloc(CUdeviceptr *dptr, unsigned int size) { (void)dptr; (void)size; return NOT_SUPPORTED; } /* the 32-bit ABI */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) { return legacy_alloc(dptr, size); }
CUresult cuMemFree_v2(CUdeviceptr dptr) { return dptr ? legacy_free(dptr) : OK; }
CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned int e) {
  (void)e;
  *pitch = (w + 31) / 32 * 32;
  return legacy_alloc(d, *pitch * h);
}
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t size, unsigned int flags) { (void)flags; return legacy_alloc(d, size); }

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr) {
  pthread_mutex_lock(&lock);
  CUresult r = NOT_FOUND;
  for (int i = 0; i < nlegacy && r; i++)
    if (dptr >= legacy[i].ptr && dptr < legacy[i].ptr + legacy[i].size) {
      if (base) *base = legacy[i].ptr;
      if (size) *size = legacy[i].size;
      r = OK;
    }
  for (int i = 0; i < nmaps && r; i++)
    if (dptr >= maps[i].va && dptr < maps[i].va + maps[i].size) {
      if (base) *base = maps[i].va;
      if (size) *size = maps[i].size;
      r = OK;
    }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  CUdeviceptr base;
  size_t size;
  CUresult r = cuMemGetAddressRange_v2(&base, &size, ptr);
  if (r) return INVALID_VALUE;
  int is_legacy = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < nlegacy; i++) is_legacy |= legacy[i].ptr == base;
  pthread_mutex_unlock(&lock);
  if (attr == 2) *(unsigned int *)data = 2; /* device memory */
  else if (attr == 10) *(unsigned char *)data = (unsigned char)is_legacy;
  else if (attr == 11) *(CUdeviceptr *)data = base;
  else if (attr == 12) *(size_t *)data = size;
  else return INVALID_VALUE;
  return OK;
}

CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr) {
  for (unsigned int i = 0; i < n; i++) {
    CUresult r = cuPointerGetAttribute(data[i], attrs[i], ptr);
    if (r) return r;
  }
  return OK;
}

/* Legacy IPC: cuMemAlloc memory only, as the driver does. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dptr) {
  pthread_mutex_lock(&lock);
  CUresult r = INVALID_VALUE;
  for (int i = 0; i < nlegacy; i++)
    if (legacy[i].ptr == dptr) {
      memset(h, 0, sizeof *h);
      memcpy(h->reserved, "FAKELEGACY", 10);
      r = OK;
    }
  pthread_mutex_unlock(&lock);
  return r;
}
CUresult cuIpcOpenMemHandle(CUdeviceptr *d, CUipcMemHandle h, unsigned int f) { (void)d; (void)h; (void)f; return NOT_SUPPORTED; }
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *d, CUipcMemHandle h, unsigned int f) { (void)d; (void)h; (void)f; return NOT_SUPPORTED; }
CUresult cuIpcCloseMemHandle(CUdeviceptr d) { (void)d; return INVALID_VALUE; }

/* ---- streams, events and stream-ordered allocations --------------------------------- */
CUresult cuEventCreate(void **ev, unsigned int flags) { (void)flags; *ev = malloc(8); return OK; }
CUresult cuEventRecord(void *ev, void *stream) { (void)ev; (void)stream; return OK; }
CUresult cuEventRecord_ptsz(void *ev, void *stream) { (void)ev; (void)stream; return OK; }
CUresult cuEventQuery(void *ev) { (void)ev; return hold_events ? NOT_READY : OK; }
CUresult cuEventDestroy_v2(void *ev) { free(ev); return OK; }
CUresult cuStreamIsCapturing(void *s, int *status) { (void)s; *status = capture; return OK; }
CUresult cuStreamIsCapturing_ptsz(void *s, int *status) { (void)s; *status = capture; return OK; }
CUresult cuDeviceGetDefaultMemPool(void **pool, int dev) { *pool = (void *)(uintptr_t)(0x1000 + dev); return OK; }
CUresult cuDeviceGetMemPool(void **pool, int dev) { *pool = (void *)(uintptr_t)(0x1000 + dev); return OK; }

static CUresult pool_alloc(CUdeviceptr *d, size_t size) {
  CUresult r = legacy_alloc(d, size);
  if (r == OK) pool_used += (size + 4095) / 4096 * 4096;
  return r;
}
static CUresult pool_free(CUdeviceptr d) {
  CUdeviceptr base;
  size_t size;
  if (cuMemGetAddressRange_v2(&base, &size, d) == OK) pool_used -= size;
  return legacy_free(d);
}
CUresult cuMemAllocAsync(CUdeviceptr *d, size_t size, void *s) { (void)s; return pool_alloc(d, size); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t size, void *s) { (void)s; return pool_alloc(d, size); }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t size, void *p, void *s) { (void)p; (void)s; return pool_alloc(d, size); }
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t size, void *p, void *s) { (void)p; (void)s; return pool_alloc(d, size); }
CUresult cuMemFreeAsync(CUdeviceptr d, void *s) { (void)s; return pool_free(d); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, void *s) { (void)s; return pool_free(d); }
CUresult cuMemPoolTrimTo(void *pool, size_t keep) { (void)pool; (void)keep; return OK; }
CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) {
  (void)pool;
  *(uint64_t *)value = (attr >= 5 && attr <= 8) ? pool_used : 0;
  return OK;
}
CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) { (void)pool; (void)attr; (void)value; return OK; }

/* ---- work on the "device" ------------------------------------------------------------ */
/* A kernel here is a host function, run at once on the launching thread with the
 * launch's parameters: what it writes into "device" memory lands there before the launch
 * returns, and memory that is not mapped (a paused segment) faults as a GPU would. */
typedef void (*FakeKernel)(void **params);
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, void *stream, void **params, void **extra) {
  (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shm; (void)stream; (void)extra;
  if (!f) return INVALID_VALUE;
  ((FakeKernel)f)(params);
  return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { memcpy((void *)(uintptr_t)d, h, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr s, size_t n) { memcpy(h, (void *)(uintptr_t)s, n); return OK; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { memset((void *)(uintptr_t)d, v, n); return OK; }

/* ---- errors -------------------------------------------------------------------------- */
/* The driver's names and words for the errors the stand-in returns. */
static const struct { CUresult code; const char *name, *text; } errors[] = {
    {OK, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

static CUresult error_entry(CUresult code, const char **out, int text) {
  for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
    if (errors[i].code == code) {
      *out = text ? errors[i].text : errors[i].name;
      return OK;
    }
  *out = NULL;
  return INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult code, const char **name) { return error_entry(code, name, 0); }
CUresult cuGetErrorString(CUresult code, const char **text) { return error_entry(code, text, 1); }

/* ---- cuGetProcAddress --------------------------------------------------------------- */

/* The driver's own table: a lookup never goes through dlsym (which the library wraps). */
#define E(name) {#name, (void *)name}
static const struct { const char *name; void *fn; } table[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGet), E(cuDeviceGetCount), E(cuDeviceGetAttribute),
    E(cuDevicePrimaryCtxRetain), E(cuCtxSetCurrent), E(cuCtxGetCurrent), E(cuCtxGetDevice), E(cuCtxSynchronize),
    E(cuMemGetAllocationGranularity), E(cuMemAddressReserve), E(cuMemAddressFree), E(cuMemCreate),
    E(cuMemRelease), E(cuMemMap), E(cuMemUnmap), E(cuMemSetAccess), E(cuMemRetainAllocationHandle),
    E(cuMemGetAllocationPropertiesFromHandle), E(cuMemExportToShareableHandle),
    E(cuMemImportFromShareableHandle), E(cuMemAlloc_v2), E(cuMemFree_v2), E(cuMemAllocPitch_v2),
    E(cuMemAllocManaged), E(cuMemGetAddressRange_v2), E(cuPointerGetAttribute), E(cuPointerGetAttributes),
    E(cuIpcGetMemHandle), E(cuIpcOpenMemHandle_v2), E(cuIpcCloseMemHandle), E(cuEventCreate),
    E(cuEventRecord), E(cuEventRecord_ptsz), E(cuEventQuery), E(cuEventDestroy_v2), E(cuStreamIsCapturing),
    E(cuStreamIsCapturing_ptsz), E(cuDeviceGetDefaultMemPool), E(cuDeviceGetMemPool), E(cuMemAllocAsync),
    E(cuMemAllocAsync_ptsz), E(cuMemAllocFromPoolAsync), E(cuMemAllocFromPoolAsync_ptsz), E(cuMemFreeAsync),
    E(cuMemFreeAsync_ptsz), E(cuMemPoolTrimTo), E(cuMemPoolGetAttribute), E(cuMemPoolSetAttribute),
    E(cuLaunchKernel), E(cuMemcpyHtoD_v2), E(cuMemcpyDtoH_v2), E(cuMemsetD8_v2), E(cuGetErrorName),
    E(cuGetErrorString),
};
#undef E

static CUresult lookup(const char *symbol, void **pfn, int version, unsigned long long flags) {
  static const char *ptsz[] = {"cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocFromPoolAsync", "cuEventRecord",
                               "cuStreamIsCapturing"};
  static const char *v2[] = {"cuMemAlloc", "cuMemFree", "cuMemAllocPitch", "cuMemGetAddressRange",
                             "cuIpcOpenMemHandle", "cuEventDestroy", "cuMemcpyHtoD", "cuMemcpyDtoH",
                             "cuMemsetD8"};
  char name[128];
  *pfn = NULL;
  if (strlen(symbol) > 100) return NOT_FOUND;
  strcpy(name, symbol);
  if (strcmp(symbol, "cuGetProcAddress") == 0) {
    *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    return OK;
  }
  if (strcmp(symbol, "cuMemAlloc") == 0 && version < 3020) {
    *pfn = (void *)cuMemAlloc;
    return OK;
  }
  for (size_t i = 0; i < sizeof v2 / sizeof *v2; i++)
    if (strcmp(symbol, v2[i]) == 0) strcat(name, "_v2");
  if (flags & 2)
    for (size_t i = 0; i < sizeof ptsz / sizeof *ptsz; i++)
      if (strcmp(symbol, ptsz[i]) == 0) strcat(name, "_ptsz");
  for (size_t i = 0; i < sizeof table / sizeof *table; i++)
    if (strcmp(table[i].name, name) == 0) *pfn = table[i].fn;
  return *pfn ? OK : NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  return lookup(symbol, pfn, version, flags);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
  CUresult r = lookup(symbol, pfn, version, flags);
  if (status) *status = r == OK ? 0 : 1;
  return r;
}
