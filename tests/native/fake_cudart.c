/*
 * A CUDA runtime for the tests, built as libcudart.so.13 beside fake_cuda.c's driver.
 *
 * It reaches the driver as NVIDIA's runtime does: dlopen("libcuda.so.1"), one dlsym for
 * cuGetProcAddress_v2, and every other driver function through it (its table), so that
 * a test of the pausable allocator sees the allocations the runtime makes on its own
 * behalf (cudaMallocAsync, cudaMallocManaged) take the path they take on a GPU. Its
 * cudaGetDriverEntryPointByVersion is the one PyTorch calls for its driver functions.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

int cudaRuntimeGetVersion(int *v);
int cudaGetDevice(int *d);
int cudaSetDevice(int d);
int cudaMalloc(void **p, size_t size);
int cudaFree(void *p);
int cudaMallocAsync(void **p, size_t size, void *stream);
int cudaFreeAsync(void *p, void *stream);
int cudaMallocManaged(void **p, size_t size, unsigned int flags);
int cudaIpcGetMemHandle(void *handle, void *p);
int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status);

typedef int (*proc_fn)(const char *, void **, int, unsigned long long, int *);

static struct {
  proc_fn get;
  int (*init)(unsigned int);
  int (*retain)(void **, int);
  int (*set_current)(void *);
  int (*get_current)(void **);
  int (*alloc)(unsigned long long *, size_t);
  int (*free)(unsigned long long);
  int (*alloc_async)(unsigned long long *, size_t, void *);
  int (*free_async)(unsigned long long, void *);
  int (*managed)(unsigned long long *, size_t, unsigned int);
  int (*ipc_get)(void *, unsigned long long);
} rt;

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return;
  rt.get = (proc_fn)dlsym(lib, "cuGetProcAddress_v2");
  if (!rt.get) return;
#define GET(field, name) rt.get(name, (void **)&rt.field, 13000, 0, NULL)
  GET(init, "cuInit");
  GET(retain, "cuDevicePrimaryCtxRetain");
  GET(set_current, "cuCtxSetCurrent");
  GET(get_current, "cuCtxGetCurrent");
  GET(alloc, "cuMemAlloc");
  GET(free, "cuMemFree");
  GET(alloc_async, "cuMemAllocAsync");
  GET(free_async, "cuMemFreeAsync");
  GET(managed, "cuMemAllocManaged");
  GET(ipc_get, "cuIpcGetMemHandle");
#undef GET
  rt.init(0);
}

/* The runtime's lazy start-up: the primary context of device 0 becomes current. */
static int ready(void) {
  pthread_once(&once, load);
  if (!rt.get) return 0;
  void *ctx = NULL;
  rt.get_current(&ctx);
  if (!ctx) {
    rt.retain(&ctx, 0);
    rt.set_current(ctx);
  }
  return 1;
}

int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaGetDevice(int *d) { *d = 0; return 0; }
int cudaSetDevice(int d) { return d == 0 && ready() ? 0 : 101; }

int cudaMalloc(void **p, size_t size) {
  if (!ready()) return 35;
  unsigned long long d = 0;
  int r = rt.alloc(&d, size);
  *p = (void *)(uintptr_t)d;
  return r ? 2 : 0;
}

int cudaFree(void *p) { return ready() && rt.free((unsigned long long)(uintptr_t)p) == 0 ? 0 : 1; }

int cudaMallocAsync(void **p, size_t size, void *stream) {
  if (!ready()) return 35;
  unsigned long long d = 0;
  int r = rt.alloc_async(&d, size, stream);
  *p = (void *)(uintptr_t)d;
  return r ? 2 : 0;
}

int cudaFreeAsync(void *p, void *stream) {
  return ready() && rt.free_async((unsigned long long)(uintptr_t)p, stream) == 0 ? 0 : 1;
}

int cudaMallocManaged(void **p, size_t size, unsigned int flags) {
  if (!ready()) return 35;
  unsigned long long d = 0;
  int r = rt.managed(&d, size, flags ? flags : 1);
  *p = (void *)(uintptr_t)d;
  return r ? 2 : 0;
}

int cudaIpcGetMemHandle(void *handle, void *p) {
  return ready() && rt.ipc_get(handle, (unsigned long long)(uintptr_t)p) == 0 ? 0 : 1;
}

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status) {
  if (!ready()) return 35;
  int r = rt.get(symbol, fn, (int)version, flags, status);
  return r ? 500 : 0;
}
