/* Shared by stubs.S and interpose.c: how many stubs there are, and the gate's modes. */
#ifndef JUPYTER_VGPU_STUBS_H
#define JUPYTER_VGPU_STUBS_H

#define VGPU_STUBS 2048 /* driver entry points handed out at most (CUDA 13 has about 700) */
#define VGPU_STUB_BYTES 32

#define VGPU_PRESENT 0
#define VGPU_PAUSED 1
#define VGPU_SUSPENDED 2

#endif
