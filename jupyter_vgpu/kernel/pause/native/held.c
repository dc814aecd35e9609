/*
 * The library's own form of every driver entry point of held.h: the gate's hold around
 * the driver's (gate.c), so that no launch, copy, set or stream memory operation of any
 * thread reaches the driver while the kernel's memory is away, and each starts its way
 * back instead. Also the table interpose.c hands them out from.
 */
#include "held.h"

#include "interpose.h"

HeldDriver held_drv;

void held_resolve(void *lib) {
#define RESOLVE(name, params, args) *(void **)&held_drv.name = vgpu_real_dlsym(lib, #name);
  VGPU_HELD_ENTRIES(RESOLVE)
#undef RESOLVE
}

#define WRAP(name, params, args)                                      \
  CUresult name params {                                              \
    if (!vgpu_resolve_driver() || !held_drv.name) return CUDA_ERROR_NOT_INITIALIZED; \
    CUresult r = vgpu_held_enter();                                   \
    if (r != CUDA_SUCCESS) return r;                                  \
    r = held_drv.name args;                                           \
    vgpu_held_leave();                                                \
    return r;                                                         \
  }
VGPU_HELD_ENTRIES(WRAP)
#undef WRAP

const Hook held_hooks[] = {
#define HOOK(name, params, args) {#name, (void *)name, (void **)&held_drv.name},
    VGPU_HELD_ENTRIES(HOOK)
#undef HOOK
};
const size_t held_hook_count = sizeof held_hooks / sizeof *held_hooks;
