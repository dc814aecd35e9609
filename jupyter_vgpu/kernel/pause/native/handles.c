/*
 * Allocations others make with the CUDA virtual-memory API (cuMemCreate, cuMemMap):
 * PyTorch's expandable segments, XLA's allocators, NCCL's buffers.
 *
 * The caller gets a handle of ours (VGPU_HANDLE_TAG, a slot and a generation), never
 * the driver's: pausing releases the driver's physical allocation and resuming creates
 * a new one, mapped again at every address the caller mapped it at, with the access
 * the caller set, while the caller keeps using the same handle. Every entry point that
 * takes or gives a handle is wrapped (interpose.c), so no handle of ours ever reaches
 * the driver. The driver's rules are kept: memory lives while the caller holds a
 * reference (create, retain, import) or a mapping of it.
 *
 * An allocation is a unit the engine pauses (vgpu_units) when it lies on a device, was
 * made in this process (not imported), has not been exported to another process, and
 * one mapping covers it whole (the engine reads and writes it there); the other
 * mappings of it are released and restored with it.
 */
#include "vmm.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
  int used;
  uint32_t gen;
  CUmemGenericAllocationHandle real; /* the driver's; 0 while paused */
  uint64_t size;                     /* bytes (0 when imported: unknown) */
  CUmemAllocationProp prop;
  int refs;     /* the caller's references */
  int maps;     /* live mappings */
  int exported; /* a shareable handle went to someone: never paused */
  int imported; /* another process's memory */
  int paused;
} Alloc;

typedef struct {
  uint64_t va, size, offset;
  uint32_t alloc; /* slot */
  int naccess;
  CUmemAccessDesc access[MAX_ACCESS];
} Mapping;

static Alloc *g_allocs = NULL;
static uint32_t g_nallocs = 0, g_cap_allocs = 0;
static Mapping *g_maps = NULL; /* sorted by va */
static size_t g_nmaps = 0, g_cap_maps = 0;

static CUmemGenericAllocationHandle tag(uint32_t slot) {
  return VGPU_HANDLE_TAG | ((uint64_t)(g_allocs[slot].gen & 0xffffu) << 32) | slot;
}

static Alloc *lookup(CUmemGenericAllocationHandle h, uint32_t *slot) {
  if ((h & 0xffff000000000000ULL) != VGPU_HANDLE_TAG) return NULL;
  uint32_t i = (uint32_t)(h & 0xffffffffu);
  if (i >= g_nallocs || !g_allocs[i].used || (g_allocs[i].gen & 0xffffu) != ((h >> 32) & 0xffffu)) return NULL;
  if (slot) *slot = i;
  return &g_allocs[i];
}

int handle_is_ours(CUmemGenericAllocationHandle h) {
  return (h & 0xffff000000000000ULL) == VGPU_HANDLE_TAG;
}

static int new_alloc(uint32_t *slot) {
  for (uint32_t i = 0; i < g_nallocs; i++)
    if (!g_allocs[i].used) { *slot = i; goto found; }
  if (g_nallocs == g_cap_allocs) {
    uint32_t cap = g_cap_allocs ? 2 * g_cap_allocs : 256;
    Alloc *grown = realloc(g_allocs, cap * sizeof *grown);
    if (!grown) return 0;
    g_allocs = grown;
    g_cap_allocs = cap;
  }
  *slot = g_nallocs++;
  g_allocs[*slot].gen = 0;
found: {
    uint32_t gen = g_allocs[*slot].gen + 1;
    memset(&g_allocs[*slot], 0, sizeof(Alloc));
    g_allocs[*slot].gen = gen;
    g_allocs[*slot].used = 1;
  }
  return 1;
}

/* The allocation is gone once nobody references or maps it. */
static void maybe_drop(Alloc *a) {
  if (a->refs > 0 || a->maps > 0) return;
  if (!a->paused && a->real) drv.cuMemRelease(a->real);
  a->used = 0;
}

/* Index of the first mapping with va >= addr. */
static size_t lower_map(uint64_t addr) {
  size_t lo = 0, hi = g_nmaps;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_maps[mid].va < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static Mapping *map_containing(uint64_t addr) {
  size_t i = lower_map(addr + 1);
  if (i == 0) return NULL;
  Mapping *m = &g_maps[i - 1];
  return addr < m->va + m->size ? m : NULL;
}

static int add_map(Mapping m) {
  if (!VGPU_ROOM(g_maps, g_nmaps, g_cap_maps, 256)) return 0;
  size_t i = lower_map(m.va);
  memmove(g_maps + i + 1, g_maps + i, (g_nmaps - i) * sizeof *g_maps);
  g_maps[i] = m;
  g_nmaps++;
  return 1;
}

/* ---- the wrapped entry points ------------------------------------------------------ */

/* A handle of ours for the driver's allocation real, which the caller holds one reference
 * to: size 0 when unknown (imported). The driver's reference is released if none can be
 * made. */
static CUresult adopt(CUmemGenericAllocationHandle real, uint64_t size, const CUmemAllocationProp *prop,
                      int imported, CUmemGenericAllocationHandle *out) {
  pthread_mutex_lock(&g_lock);
  uint32_t slot;
  if (!new_alloc(&slot)) {
    pthread_mutex_unlock(&g_lock);
    drv.cuMemRelease(real);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Alloc *a = &g_allocs[slot];
  a->real = real;
  a->size = size;
  a->prop = *prop;
  a->refs = 1;
  a->imported = imported;
  *out = tag(slot);
  pthread_mutex_unlock(&g_lock);
  return CUDA_SUCCESS;
}

CUresult handles_create(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                        unsigned long long flags) {
  if (!out || !prop) return CUDA_ERROR_INVALID_VALUE;
  CUmemGenericAllocationHandle real;
  CUresult r;
  Growth g; /* device memory the driver refuses asks for room first (grow.c) */
  grow_start(&g);
  do {
    r = drv.cuMemCreate(&real, size, prop, flags);
    if (r == CUDA_ERROR_OUT_OF_MEMORY && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
      grow_refused(prop->location.id, size);
  } while (grow_again(&g, r));
  grow_end(&g, r);
  if (r != CUDA_SUCCESS) return r;
  return adopt(real, size, prop, 0, out);
}

CUresult handles_release(CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&g_lock);
  Alloc *a = lookup(h, NULL);
  if (!a || a->refs <= 0) {
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_INVALID_VALUE;
  }
  a->refs--;
  maybe_drop(a);
  pthread_mutex_unlock(&g_lock);
  return CUDA_SUCCESS;
}

CUresult handles_map_range(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                           unsigned long long flags) {
  pthread_mutex_lock(&g_lock);
  uint32_t slot;
  Alloc *a = lookup(h, &slot);
  CUresult r;
  if (!a) r = CUDA_ERROR_INVALID_HANDLE;
  else if (a->paused) r = CUDA_ERROR_ILLEGAL_STATE;
  else if ((r = drv.cuMemMap(va, size, offset, a->real, flags)) == CUDA_SUCCESS) {
    Mapping m = {va, size, offset, slot, 0, {{{0, 0}, 0}}};
    if (!add_map(m)) {
      drv.cuMemUnmap(va, size);
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      a->maps++;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

/* 1 when [va, va + size) holds a mapping of ours. */
int handles_covers(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&g_lock);
  size_t i = lower_map(va);
  int ours = (i < g_nmaps && g_maps[i].va < va + size) || map_containing(va) != NULL;
  pthread_mutex_unlock(&g_lock);
  return ours;
}

CUresult handles_unmap_range(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&g_lock);
  CUresult r = CUDA_SUCCESS;
  size_t i = lower_map(va);
  while (i < g_nmaps && g_maps[i].va < va + size) {
    Mapping m = g_maps[i];
    Alloc *a = &g_allocs[m.alloc];
    if (!a->paused) {
      CUresult u = drv.cuMemUnmap(m.va, m.size);
      if (u != CUDA_SUCCESS) { r = u; i++; continue; }
    }
    memmove(g_maps + i, g_maps + i + 1, (g_nmaps - i - 1) * sizeof *g_maps);
    g_nmaps--;
    a->maps--;
    maybe_drop(a);
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

/* Record the access set on our mappings inside [va, va + size) (after the driver took it). */
CUresult handles_set_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count) {
  pthread_mutex_lock(&g_lock);
  size_t i = lower_map(va);
  CUresult r = CUDA_SUCCESS;
  for (size_t j = i; j < g_nmaps && g_maps[j].va < va + size; j++)
    if (g_allocs[g_maps[j].alloc].paused) r = CUDA_ERROR_ILLEGAL_STATE;
  if (r == CUDA_SUCCESS) r = drv.cuMemSetAccess(va, size, desc, count);
  for (; r == CUDA_SUCCESS && i < g_nmaps && g_maps[i].va < va + size; i++) {
    Mapping *m = &g_maps[i];
    for (size_t d = 0; d < count; d++) {
      int k = 0;
      while (k < m->naccess && (m->access[k].location.type != desc[d].location.type ||
                                m->access[k].location.id != desc[d].location.id))
        k++;
      if (k == m->naccess && k < MAX_ACCESS) m->naccess++;
      if (k < MAX_ACCESS) m->access[k] = desc[d];
    }
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

CUresult handles_retain(CUmemGenericAllocationHandle *out, void *addr) {
  pthread_mutex_lock(&g_lock);
  Mapping *m = map_containing((uint64_t)(uintptr_t)addr);
  CUresult r = CUDA_ERROR_NOT_FOUND;
  if (m) {
    g_allocs[m->alloc].refs++;
    *out = tag(m->alloc);
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&g_lock);
  return r; /* CUDA_ERROR_NOT_FOUND: not ours, ask the driver */
}

CUresult handles_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&g_lock);
  Alloc *a = lookup(h, NULL);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (a) {
    *prop = a->prop;
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

CUresult handles_export(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
  pthread_mutex_lock(&g_lock);
  Alloc *a = lookup(h, NULL);
  CUresult r;
  if (!a) r = CUDA_ERROR_INVALID_VALUE;
  else if (a->paused) r = CUDA_ERROR_ILLEGAL_STATE;
  else if ((r = drv.cuMemExportToShareableHandle(out, a->real, type, flags)) == CUDA_SUCCESS)
    a->exported = 1; /* another process may map it now: it stays on the card */
  pthread_mutex_unlock(&g_lock);
  return r;
}

CUresult handles_import(CUmemGenericAllocationHandle *out, void *os_handle, int type) {
  CUmemGenericAllocationHandle real;
  CUresult r = drv.cuMemImportFromShareableHandle(&real, os_handle, type);
  if (r != CUDA_SUCCESS) return r;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  if (drv.cuMemGetAllocationPropertiesFromHandle) drv.cuMemGetAllocationPropertiesFromHandle(&prop, real);
  return adopt(real, 0, &prop, 1, out);
}

/* ---- units for the engine (the lock is held by the caller) ------------------------- */

static int pausable(const Alloc *a) {
  return a->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE && !a->exported && !a->imported;
}

/* The mapping through which the engine reads and writes a, or NULL: one covering it whole. */
static Mapping *window(uint32_t slot) {
  for (size_t i = 0; i < g_nmaps; i++)
    if (g_maps[i].alloc == slot && g_maps[i].offset == 0 && g_maps[i].size == g_allocs[slot].size)
      return &g_maps[i];
  return NULL;
}

size_t handles_units(uint64_t *ptrs, uint64_t *sizes, int *devices, int *flags, size_t n) {
  size_t k = 0;
  for (uint32_t i = 0; i < g_nallocs; i++) {
    Alloc *a = &g_allocs[i];
    if (!a->used || a->imported || a->maps == 0 || a->prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
      continue;
    Mapping *w = window(i);
    if (!w) continue; /* counted as "cannot be paused" by handles_figures */
    if (k < n) {
      ptrs[k] = w->va;
      sizes[k] = a->size;
      devices[k] = a->prop.location.id;
      flags[k] = (a->paused ? 0 : UNIT_MAPPED) | UNIT_OTHERS | (pausable(a) ? UNIT_PAUSABLE : UNIT_EXPORTED);
    }
    k++;
  }
  return k;
}

static Alloc *by_window(uint64_t va, uint32_t *slot) {
  Mapping *m = map_containing(va);
  if (!m || m->va != va || m->offset != 0 || m->size != g_allocs[m->alloc].size) return NULL;
  *slot = m->alloc;
  return &g_allocs[m->alloc];
}

int handles_unmap(uint64_t va) {
  uint32_t slot;
  Alloc *a = by_window(va, &slot);
  if (!a) return -1;
  if (a->paused || !pausable(a)) return VGPU_ERROR_BAD_STATE;
  CUresult r = ensure_context(a->prop.location.id);
  for (size_t i = 0; r == CUDA_SUCCESS && i < g_nmaps; i++) {
    if (g_maps[i].alloc != slot) continue;
    r = drv.cuMemUnmap(g_maps[i].va, g_maps[i].size);
    if (r != CUDA_SUCCESS) { /* map back what was unmapped: the unit stays as it was */
      for (size_t j = 0; j < i; j++)
        if (g_maps[j].alloc == slot) {
          drv.cuMemMap(g_maps[j].va, g_maps[j].size, g_maps[j].offset, a->real, 0);
          if (g_maps[j].naccess) drv.cuMemSetAccess(g_maps[j].va, g_maps[j].size, g_maps[j].access, g_maps[j].naccess);
        }
      return r;
    }
  }
  if (r != CUDA_SUCCESS) return r;
  drv.cuMemRelease(a->real);
  a->real = 0;
  a->paused = 1;
  return 0;
}

int handles_map(uint64_t va) { return handles_map_unset(va, NULL, NULL); }

/* New physical memory behind every mapping of the paused allocation whose window is va;
 * with note NULL the access is set here, else note() is told each mapping's access to
 * set (vgpu_map_many sets it once per run of adjacent mappings). */
int handles_map_unset(uint64_t va, AccessNote note, void *ctx) {
  uint32_t slot;
  Alloc *a = by_window(va, &slot);
  if (!a) return -1;
  if (!a->paused) return VGPU_ERROR_BAD_STATE;
  CUresult r = ensure_context(a->prop.location.id);
  CUmemGenericAllocationHandle real = 0;
  if (r == CUDA_SUCCESS) r = drv.cuMemCreate(&real, a->size, &a->prop, 0);
  if (r != CUDA_SUCCESS) return r;
  size_t i;
  for (i = 0; i < g_nmaps; i++) {
    Mapping *m = &g_maps[i];
    if (m->alloc != slot) continue;
    r = drv.cuMemMap(m->va, m->size, m->offset, real, 0);
    if (r == CUDA_SUCCESS && m->naccess && !note) {
      r = drv.cuMemSetAccess(m->va, m->size, m->access, m->naccess);
      if (r != CUDA_SUCCESS) drv.cuMemUnmap(m->va, m->size);
    }
    if (r != CUDA_SUCCESS) break;
  }
  if (r != CUDA_SUCCESS) { /* unmap what was mapped: the unit stays paused */
    for (size_t j = 0; j < i; j++)
      if (g_maps[j].alloc == slot) drv.cuMemUnmap(g_maps[j].va, g_maps[j].size);
    drv.cuMemRelease(real);
    return r;
  }
  if (note)
    for (i = 0; i < g_nmaps; i++)
      if (g_maps[i].alloc == slot && g_maps[i].naccess)
        note(ctx, g_maps[i].va, g_maps[i].size, g_maps[i].access, g_maps[i].naccess);
  a->real = real;
  a->paused = 0;
  return 0;
}

void handles_figures(uint64_t *mapped, uint64_t *paused, uint64_t *exported, uint64_t *imported,
                     uint64_t *other) {
  for (uint32_t i = 0; i < g_nallocs; i++) {
    Alloc *a = &g_allocs[i];
    if (!a->used) continue;
    if (a->imported) { *imported += a->size; continue; }
    if (a->paused) { *paused += a->size; continue; }
    if (a->prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) continue; /* host memory: not the card's */
    if (a->exported) *exported += a->size;
    else if (a->maps && !window(i)) *other += a->size;
    else *mapped += a->size;
  }
}
