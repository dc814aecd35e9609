/*
 * The library's own form of every HELD entry point of the driver's table (driver.h): the
 * gate's hold around the driver's (gate.c), so that no launch, copy, set or stream memory
 * operation of any thread reaches the driver while the kernel's memory is away, and each
 * starts its way back instead. interpose.c hands them out, from the same table.
 */
#include "vmm.h"

#define VGPU_HOLD(name, params, args)                                           \
  CUresult name params {                                                        \
    if (!vgpu_resolve_driver() || !drv.name) return CUDA_ERROR_NOT_INITIALIZED; \
    CUresult r = vgpu_held_enter();                                             \
    if (r != CUDA_SUCCESS) return r;                                            \
    r = drv.name args;                                                          \
    vgpu_held_leave();                                                          \
    return r;                                                                   \
  }
VGPU_DRIVER_ENTRIES(VGPU_NONE2, VGPU_NONE2, VGPU_HOLD)
#undef VGPU_HOLD
