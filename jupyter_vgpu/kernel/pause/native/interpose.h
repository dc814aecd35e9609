/* What interpose.c and held.c share: the table that hands the library's own entry points out. */
#ifndef JUPYTER_VGPU_INTERPOSE_H
#define JUPYTER_VGPU_INTERPOSE_H

#include <stddef.h>

/* One entry point of ours: its name, our function, and where the driver's is kept. */
typedef struct {
  const char *name;
  void *ours;
  void **real;
} Hook;

extern const Hook held_hooks[]; /* held.c: launches, copies, sets, stream memory operations */
extern const size_t held_hook_count;

#endif
