/*
 * Small and stream-ordered allocations, on segments of ours.
 *
 * Small: a segment is at least the allocation granularity (2 MiB on current GPUs),
 * and the driver packs small cuMemAlloc requests into larger blocks itself; so do we.
 * Requests under ARENA_LIMIT (1 MiB) take a slot of a 2 MiB chunk: slots are powers of
 * two from 512 bytes (cudaMalloc's 256-byte alignment holds), one size per chunk, a
 * bitmap of which are taken. A chunk is a segment of ours, paused and resumed whole.
 * An empty chunk is released unless it is the last of its size on its device.
 *
 * Stream-ordered (cuMemAllocAsync, cuMemAllocFromPoolAsync on a device's default pool,
 * and the runtime's cudaMallocAsync that reaches them): memory from segments of ours,
 * so that it pauses like any other. A free is stream-ordered: an event recorded on the
 * stream marks when the memory may be reused, and it is reclaimed once the event has
 * completed (at the next stream-ordered call, or when the engine collects before a
 * pause). Freed large segments are kept for reuse of the same size, as the driver's
 * pools keep theirs (PyTorch's async backend sets the pools' release threshold to
 * "never" and trims them in empty_cache), until a trim, a pause, or an allocation the
 * device has no room for. The default pools' figures (reserved, used, high-water
 * marks) include ours, so PyTorch's memory statistics read as in a plain process.
 * Inside a stream capture, and on pools other than a device's default (a pool the
 * caller made for its own properties), the driver allocates as usual: that memory is
 * counted as "let through" and cannot be paused (the kernel is suspended instead).
 */
#include "vmm.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK_BYTES (2u << 20)
#define MIN_SLOT 512u
#define CLASSES 12 /* 512 B .. 1 MiB */
#define MAX_DEVICES 64

struct Chunk {
  Segment *seg;
  int device, cls, async;
  uint32_t slot, nslots, used;
  uint64_t bits[CHUNK_BYTES / MIN_SLOT / 64];
  Chunk *next;
};

static Chunk *g_chunks = NULL;
uint64_t g_arena_bytes = 0;
uint64_t g_async_live_bytes = 0, g_async_cached_bytes = 0;

/* ---- small allocations -------------------------------------------------------------- */
static int class_of(uint64_t size) {
  int k = 0;
  while ((uint64_t)MIN_SLOT << k < size) k++;
  return k;
}

CUresult arena_alloc(int device, uint64_t size, int async, uint64_t *out) {
  int cls = class_of(size ? size : 1);
  Chunk *c = g_chunks;
  while (c && !(c->device == device && c->cls == cls && c->async == async && c->used < c->nslots &&
                c->seg->mapped))
    c = c->next;
  if (!c) {
    c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    Segment *s;
    CUresult r = seg_new(device, CHUNK_BYTES, async ? SEG_ASYNC : 0, &s);
    if (r != CUDA_SUCCESS) {
      free(c);
      return r;
    }
    c->seg = s;
    c->device = device;
    c->cls = cls;
    c->async = async;
    c->slot = MIN_SLOT << cls;
    c->nslots = (uint32_t)(s->size / c->slot);
    if (c->nslots > CHUNK_BYTES / MIN_SLOT) c->nslots = CHUNK_BYTES / MIN_SLOT;
    s->chunk = c;
    c->next = g_chunks;
    g_chunks = c;
    g_arena_bytes += s->size;
  }
  for (uint32_t w = 0; w * 64 < c->nslots; w++) {
    if (c->bits[w] == ~0ULL) continue;
    int b = __builtin_ctzll(~c->bits[w]);
    uint32_t i = w * 64 + (uint32_t)b;
    if (i >= c->nslots) break;
    c->bits[w] |= 1ULL << b;
    c->used++;
    *out = c->seg->ptr + (uint64_t)i * c->slot;
    if (async) g_async_live_bytes += c->slot;
    return CUDA_SUCCESS;
  }
  return CUDA_ERROR_OUT_OF_MEMORY; /* not reached: the chunk had a free slot */
}

static Chunk *slot_of(uint64_t ptr, uint32_t *index) {
  Segment *s = seg_containing(ptr);
  if (!s || !s->chunk) return NULL;
  Chunk *c = s->chunk;
  uint64_t off = ptr - s->ptr;
  if (off % c->slot) return NULL;
  uint32_t i = (uint32_t)(off / c->slot);
  if (i >= c->nslots || !(c->bits[i / 64] & (1ULL << (i % 64)))) return NULL;
  *index = i;
  return c;
}

int arena_slot(uint64_t ptr, uint64_t *base, uint64_t *size) {
  Segment *s = seg_containing(ptr);
  if (!s || !s->chunk) return 0;
  Chunk *c = s->chunk;
  uint32_t i = (uint32_t)((ptr - s->ptr) / c->slot);
  if (i >= c->nslots || !(c->bits[i / 64] & (1ULL << (i % 64)))) return 0;
  *base = s->ptr + (uint64_t)i * c->slot;
  *size = c->slot;
  return 1;
}

static int last_of_kind(Chunk *c) {
  for (Chunk *o = g_chunks; o; o = o->next)
    if (o != c && o->device == c->device && o->cls == c->cls && o->async == c->async) return 0;
  return 1;
}

int arena_free(uint64_t ptr) {
  uint32_t i;
  Chunk *c = slot_of(ptr, &i);
  if (!c) return 0;
  c->bits[i / 64] &= ~(1ULL << (i % 64));
  c->used--;
  if (c->async) g_async_live_bytes -= c->slot;
  if (c->used == 0 && !last_of_kind(c)) seg_delete(c->seg); /* calls arena_chunk_released */
  return 1;
}

void arena_chunk_released(Chunk *c) {
  for (Chunk **p = &g_chunks; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  g_arena_bytes -= c->seg->size;
  free(c);
}

/* ---- stream-ordered allocations ---------------------------------------------------- */
typedef struct {
  uint64_t ptr;
  CUevent ev;  /* NULL: freed inside a stream capture; reclaimed at the next collect */
} Pending;

typedef struct {
  uint64_t ptr, size;
} Through;

static Pending *g_pending = NULL;
static size_t g_npending = 0, g_cap_pending = 0;
static Segment **g_cache = NULL;
static size_t g_ncache = 0, g_cap_cache = 0;
static Through *g_through = NULL; /* let through to the driver: (ptr, size) */
static size_t g_nthrough = 0, g_cap_through = 0;
static CUmemoryPool g_default_pool[MAX_DEVICES];
static uint64_t g_live[MAX_DEVICES], g_cached[MAX_DEVICES], g_high_used[MAX_DEVICES],
    g_high_reserved[MAX_DEVICES];

static CUmemoryPool default_pool(int device) {
  if (device < 0 || device >= MAX_DEVICES || !drv.cuDeviceGetDefaultMemPool) return NULL;
  if (!g_default_pool[device]) {
    CUdevice dev;
    if (drv.cuDeviceGet(&dev, device) == CUDA_SUCCESS) drv.cuDeviceGetDefaultMemPool(&g_default_pool[device], dev);
  }
  return g_default_pool[device];
}

static int device_of_pool(CUmemoryPool pool) {
  for (int d = 0; d < MAX_DEVICES; d++)
    if (g_default_pool[d] && g_default_pool[d] == pool) return d;
  return -1;
}

static void note_high(int d) {
  if (d < 0 || d >= MAX_DEVICES) return;
  if (g_live[d] > g_high_used[d]) g_high_used[d] = g_live[d];
  if (g_live[d] + g_cached[d] > g_high_reserved[d]) g_high_reserved[d] = g_live[d] + g_cached[d];
}

static int capturing(CUstream stream, int ptsz) {
  CUresult (*fn)(CUstream, int *) = ptsz ? drv.cuStreamIsCapturing_ptsz : drv.cuStreamIsCapturing;
  int status = 0;
  return fn && fn(stream, &status) == CUDA_SUCCESS && status != 0;
}

static void let_through(uint64_t ptr, uint64_t size) {
  if (VGPU_ROOM(g_through, g_nthrough, g_cap_through, 64)) {
    g_through[g_nthrough].ptr = ptr;
    g_through[g_nthrough++].size = size;
    g_passthrough_bytes += size;
  }
}

static int forget_through(uint64_t ptr) {
  for (size_t i = 0; i < g_nthrough; i++)
    if (g_through[i].ptr == ptr) {
      g_passthrough_bytes -= g_through[i].size;
      g_through[i] = g_through[--g_nthrough];
      return 1;
    }
  return 0;
}

/* Give back one reclaimed stream-ordered allocation (the lock is held). */
static void reclaim(uint64_t ptr, int release) {
  Segment *s = seg_containing(ptr);
  if (!s) return;
  if (s->chunk) {
    int d = s->device;
    uint64_t slot = s->chunk->slot;
    if (arena_free(ptr) && d < MAX_DEVICES) g_live[d] -= slot;
    return;
  }
  int d = s->device < MAX_DEVICES ? s->device : 0;
  g_live[d] -= s->size;
  g_async_live_bytes -= s->size;
  if (release || !s->mapped || !VGPU_ROOM(g_cache, g_ncache, g_cap_cache, 64)) {
    seg_delete(s);
    return;
  }
  s->flags |= SEG_CACHED;
  g_cache[g_ncache++] = s;
  g_cached[d] += s->size;
  g_async_cached_bytes += s->size;
}

int async_reclaim_now(uint64_t ptr) {
  Segment *s = seg_containing(ptr);
  if (!s || !(s->flags & SEG_ASYNC) || (s->flags & SEG_CACHED)) return 0;
  reclaim(ptr, 0);
  return 1;
}

static void drop_cache(int device) {
  size_t k = 0;
  for (size_t i = 0; i < g_ncache; i++) {
    Segment *s = g_cache[i];
    if (device >= 0 && s->device != device) {
      g_cache[k++] = s;
      continue;
    }
    int d = s->device < MAX_DEVICES ? s->device : 0;
    g_cached[d] -= s->size;
    g_async_cached_bytes -= s->size;
    seg_delete(s);
  }
  g_ncache = k;
}

void async_collect(int release) {
  size_t k = 0;
  for (size_t i = 0; i < g_npending; i++) {
    Pending p = g_pending[i];
    int done = p.ev ? drv.cuEventQuery(p.ev) == CUDA_SUCCESS : release;
    if (!done && !release) {
      g_pending[k++] = p;
      continue;
    }
    if (p.ev) drv.cuEventDestroy_v2(p.ev);
    reclaim(p.ptr, release);
  }
  g_npending = k;
  if (release) {
    drop_cache(-1);
    for (Chunk *c = g_chunks, *next; c; c = next) { /* empty chunks hold nothing */
      next = c->next;
      if (c->used == 0 && c->seg->mapped) seg_delete(c->seg);
    }
  }
}

CUresult async_alloc(uint64_t *out, size_t size) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  int device;
  CUresult r = current_device(&device);
  if (r != CUDA_SUCCESS) return r;
  pthread_mutex_lock(&g_lock);
  async_collect(0);
  if (size < ARENA_LIMIT) {
    r = arena_alloc(device, size, 1, out);
    if (r == CUDA_SUCCESS && device < MAX_DEVICES) g_live[device] += MIN_SLOT << class_of(size ? size : 1);
  } else {
    Segment *s = NULL;
    for (size_t i = 0; i < g_ncache; i++) /* a freed segment of the same size */
      if (g_cache[i]->device == device && g_cache[i]->size >= size &&
          g_cache[i]->size - size < (2u << 20)) {
        s = g_cache[i];
        g_cache[i] = g_cache[--g_ncache];
        s->flags &= ~SEG_CACHED;
        g_cached[device < MAX_DEVICES ? device : 0] -= s->size;
        g_async_cached_bytes -= s->size;
        break;
      }
    if (!s) {
      r = seg_new(device, size, SEG_ASYNC, &s);
      if (r == CUDA_ERROR_OUT_OF_MEMORY && g_ncache) { /* what the cache holds is the room */
        drop_cache(device);
        r = seg_new(device, size, SEG_ASYNC, &s);
      }
    }
    if (s) {
      *out = s->ptr;
      g_live[device < MAX_DEVICES ? device : 0] += s->size;
      g_async_live_bytes += s->size;
      r = CUDA_SUCCESS;
    }
  }
  note_high(device);
  pthread_mutex_unlock(&g_lock);
  return r;
}

CUresult async_free(uint64_t ptr, CUstream stream, int ptsz) {
  pthread_mutex_lock(&g_lock);
  Segment *s = seg_containing(ptr);
  if (!s || !(s->flags & SEG_ASYNC) || (s->flags & SEG_CACHED)) {
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_NOT_FOUND;
  }
  CUresult r = CUDA_SUCCESS;
  if (VGPU_ROOM(g_pending, g_npending, g_cap_pending, 64)) {
    Pending p = {ptr, NULL};
    if (!capturing(stream, ptsz)) {
      CUresult (*record)(CUevent, CUstream) = ptsz ? drv.cuEventRecord_ptsz : drv.cuEventRecord;
      if (!record || drv.cuEventCreate(&p.ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) p.ev = NULL;
      else if (record(p.ev, stream) != CUDA_SUCCESS) {
        drv.cuEventDestroy_v2(p.ev);
        p.ev = NULL;
      }
      if (!p.ev) { /* no event: wait for the device (without the lock), then reclaim */
        pthread_mutex_unlock(&g_lock);
        drv.cuCtxSynchronize();
        pthread_mutex_lock(&g_lock);
        if (async_reclaim_now(ptr) == 0) r = CUDA_ERROR_INVALID_VALUE;
        pthread_mutex_unlock(&g_lock);
        return r;
      }
    }
    g_pending[g_npending++] = p;
  } else {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  async_collect(0);
  pthread_mutex_unlock(&g_lock);
  return r;
}

/* Stream-ordered allocations the driver makes (captures, others' pools): counted. */
void async_let_through(uint64_t ptr, uint64_t size) {
  pthread_mutex_lock(&g_lock);
  let_through(ptr, size);
  pthread_mutex_unlock(&g_lock);
}

int async_forget_through(uint64_t ptr) {
  pthread_mutex_lock(&g_lock);
  int found = forget_through(ptr);
  pthread_mutex_unlock(&g_lock);
  return found;
}

int async_should_let_through(CUstream stream, int ptsz, CUmemoryPool pool) {
  if (capturing(stream, ptsz)) return 1;
  int device;
  if (current_device(&device) != CUDA_SUCCESS) return 1; /* the driver gives its own error */
  pthread_mutex_lock(&g_lock);
  CUmemoryPool ours = default_pool(device);
  pthread_mutex_unlock(&g_lock);
  if (!ours) return 1;
  if (pool) return pool != ours;
  CUmemoryPool current = NULL;
  if (drv.cuDeviceGetMemPool) {
    CUdevice dev;
    if (drv.cuDeviceGet(&dev, device) == CUDA_SUCCESS) drv.cuDeviceGetMemPool(&current, dev);
  }
  return current && current != ours; /* the caller chose a pool of its own */
}

void async_pool_figures(CUmemoryPool pool, int attr, uint64_t *value) {
  pthread_mutex_lock(&g_lock);
  int d = device_of_pool(pool);
  if (d >= 0) {
    if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) *value += g_live[d] + g_cached[d];
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT) *value += g_live[d];
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) *value += g_high_reserved[d];
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) *value += g_high_used[d];
  }
  pthread_mutex_unlock(&g_lock);
}

void async_pool_reset_high(CUmemoryPool pool, int attr) {
  pthread_mutex_lock(&g_lock);
  int d = device_of_pool(pool);
  if (d >= 0 && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) g_high_reserved[d] = g_live[d] + g_cached[d];
  if (d >= 0 && attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) g_high_used[d] = g_live[d];
  pthread_mutex_unlock(&g_lock);
}

void async_trim(CUmemoryPool pool, size_t keep) {
  pthread_mutex_lock(&g_lock);
  int d = device_of_pool(pool);
  if (d >= 0) {
    async_collect(0);
    if (g_live[d] + g_cached[d] > keep) drop_cache(d);
  }
  pthread_mutex_unlock(&g_lock);
}
