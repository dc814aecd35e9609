/*
 * The driver's entry points that read or write device memory or put work on the GPU: one
 * line each, with its parameters and the arguments passing them on. held.c makes of this
 * list, for each entry point, the library's own function (the gate's hold around the
 * driver's: gate.c), the pointer to the driver's (resolved when libcuda is loaded), and
 * the entry of the table that hands ours out (interpose.c). An entry point the driver
 * lacks stays NULL and is never handed out.
 *
 * Names are the driver's exported symbols (cuda.h 12 and 13): the _v2 forms the headers
 * map the plain names to, and the per-thread default stream forms (_ptds, _ptsz).
 */
#ifndef JUPYTER_VGPU_HELD_H
#define JUPYTER_VGPU_HELD_H

#include "vmm.h"

typedef void *CUfunction;
typedef void *CUgraphExec;
typedef void *CUarray;
typedef unsigned int cuuint32_t;

#define P_LAUNCH CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm
#define A_LAUNCH f, gx, gy, gz, bx, by, bz, shm

#define VGPU_HELD_ENTRIES(X)                                                                                  \
  X(cuLaunchKernel, (P_LAUNCH, CUstream s, void **params, void **extra), (A_LAUNCH, s, params, extra))        \
  X(cuLaunchKernel_ptsz, (P_LAUNCH, CUstream s, void **params, void **extra), (A_LAUNCH, s, params, extra))   \
  X(cuLaunchKernelEx, (const void *config, CUfunction f, void **params, void **extra), (config, f, params, extra)) \
  X(cuLaunchKernelEx_ptsz, (const void *config, CUfunction f, void **params, void **extra),                   \
    (config, f, params, extra))                                                                               \
  X(cuLaunchCooperativeKernel, (P_LAUNCH, CUstream s, void **params), (A_LAUNCH, s, params))                  \
  X(cuLaunchCooperativeKernel_ptsz, (P_LAUNCH, CUstream s, void **params), (A_LAUNCH, s, params))             \
  X(cuLaunchCooperativeKernelMultiDevice, (void *list, unsigned n, unsigned flags), (list, n, flags))         \
  X(cuLaunch, (CUfunction f), (f))                                                                            \
  X(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h))                                                    \
  X(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s))                                \
  X(cuGraphLaunch, (CUgraphExec g, CUstream s), (g, s))                                                       \
  X(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s))                                                  \
  X(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                            \
  X(cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                       \
  X(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))                      \
  X(cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))                 \
  X(cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))    \
  X(cuMemcpyPeer_ptds, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n)) \
  X(cuMemcpyPeerAsync, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),     \
    (d, dc, s, sc, n, st))                                                                                    \
  X(cuMemcpyPeerAsync_ptsz, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st), \
    (d, dc, s, sc, n, st))                                                                                    \
  X(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *h, size_t n), (d, h, n))                                     \
  X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *h, size_t n), (d, h, n))                                \
  X(cuMemcpyDtoH_v2, (void *h, CUdeviceptr s, size_t n), (h, s, n))                                           \
  X(cuMemcpyDtoH_v2_ptds, (void *h, CUdeviceptr s, size_t n), (h, s, n))                                      \
  X(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                     \
  X(cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                                \
  X(cuMemcpyDtoA_v2, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n))                           \
  X(cuMemcpyDtoA_v2_ptds, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n))                      \
  X(cuMemcpyAtoD_v2, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n))                           \
  X(cuMemcpyAtoD_v2_ptds, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n))                      \
  X(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *h, size_t n, CUstream st), (d, h, n, st))              \
  X(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *h, size_t n, CUstream st), (d, h, n, st))         \
  X(cuMemcpyDtoHAsync_v2, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st))                    \
  X(cuMemcpyDtoHAsync_v2_ptsz, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st))               \
  X(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))              \
  X(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))         \
  X(cuMemcpy2D_v2, (const void *c), (c))                                                                      \
  X(cuMemcpy2D_v2_ptds, (const void *c), (c))                                                                 \
  X(cuMemcpy2DUnaligned_v2, (const void *c), (c))                                                             \
  X(cuMemcpy2DUnaligned_v2_ptds, (const void *c), (c))                                                        \
  X(cuMemcpy2DAsync_v2, (const void *c, CUstream st), (c, st))                                                \
  X(cuMemcpy2DAsync_v2_ptsz, (const void *c, CUstream st), (c, st))                                           \
  X(cuMemcpy3D_v2, (const void *c), (c))                                                                      \
  X(cuMemcpy3D_v2_ptds, (const void *c), (c))                                                                 \
  X(cuMemcpy3DAsync_v2, (const void *c, CUstream st), (c, st))                                                \
  X(cuMemcpy3DAsync_v2_ptsz, (const void *c, CUstream st), (c, st))                                           \
  X(cuMemcpy3DPeer, (const void *c), (c))                                                                     \
  X(cuMemcpy3DPeer_ptds, (const void *c), (c))                                                                \
  X(cuMemcpy3DPeerAsync, (const void *c, CUstream st), (c, st))                                               \
  X(cuMemcpy3DPeerAsync_ptsz, (const void *c, CUstream st), (c, st))                                          \
  X(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                     \
  X(cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                \
  X(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                                   \
  X(cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                              \
  X(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                     \
  X(cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                \
  X(cuMemsetD2D8_v2, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h), (d, p, v, w, h))         \
  X(cuMemsetD2D8_v2_ptds, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h), (d, p, v, w, h))    \
  X(cuMemsetD2D16_v2, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h), (d, p, v, w, h))       \
  X(cuMemsetD2D16_v2_ptds, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h), (d, p, v, w, h))  \
  X(cuMemsetD2D32_v2, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h), (d, p, v, w, h))         \
  X(cuMemsetD2D32_v2_ptds, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h), (d, p, v, w, h))    \
  X(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))                  \
  X(cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream st), (d, v, n, st))             \
  X(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))                \
  X(cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream st), (d, v, n, st))           \
  X(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))                  \
  X(cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream st), (d, v, n, st))             \
  X(cuMemsetD2D8Async, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream st),           \
    (d, p, v, w, h, st))                                                                                      \
  X(cuMemsetD2D8Async_ptsz, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream st),      \
    (d, p, v, w, h, st))                                                                                      \
  X(cuMemsetD2D16Async, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream st),         \
    (d, p, v, w, h, st))                                                                                      \
  X(cuMemsetD2D16Async_ptsz, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream st),    \
    (d, p, v, w, h, st))                                                                                      \
  X(cuMemsetD2D32Async, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream st),           \
    (d, p, v, w, h, st))                                                                                      \
  X(cuMemsetD2D32Async_ptsz, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream st),      \
    (d, p, v, w, h, st))                                                                                      \
  X(cuStreamWriteValue32_v2, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))           \
  X(cuStreamWriteValue32_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))      \
  X(cuStreamWriteValue64_v2, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))           \
  X(cuStreamWriteValue64_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))      \
  X(cuStreamWaitValue32_v2, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))            \
  X(cuStreamWaitValue32_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint32_t v, unsigned f), (st, a, v, f))       \
  X(cuStreamWaitValue64_v2, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))            \
  X(cuStreamWaitValue64_v2_ptsz, (CUstream st, CUdeviceptr a, cuuint64_t v, unsigned f), (st, a, v, f))       \
  X(cuStreamBatchMemOp_v2, (CUstream st, unsigned n, void *ops, unsigned f), (st, n, ops, f))                 \
  X(cuStreamBatchMemOp_v2_ptsz, (CUstream st, unsigned n, void *ops, unsigned f), (st, n, ops, f))

#define VGPU_HELD_FIELD(name, params, args) CUresult(*name) params;
typedef struct {
  VGPU_HELD_ENTRIES(VGPU_HELD_FIELD)
} HeldDriver;
#undef VGPU_HELD_FIELD

extern HeldDriver held_drv;

/* Resolve every entry point of the list in the loaded driver `lib` (vmm.c, at load). */
void held_resolve(void *lib);

#endif
