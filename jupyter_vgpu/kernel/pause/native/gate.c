/*
 * The gate: no thread of the process reaches memory that is away, and every thread that
 * tries starts the kernel's way back instead of faulting or freezing.
 *
 * A kernel's memory leaves the card while the kernel is idle, but its code may still run:
 * an asyncio task, a tornado callback, a timer, a thread. A GPU call of such code would
 * touch released memory (paused: an illegal address kills the CUDA context) or block
 * inside the driver's checkpoint lock (suspended: with the event-loop thread blocked, the
 * message that would bring the kernel back is never handled). So the library sits at the
 * driver's entry points and, while the kernel is away, holds the calling thread before
 * the driver sees the call:
 *
 *   - VGPU_PRESENT: every call goes through.
 *   - VGPU_PAUSED (set before a pause begins, until its resume has ended): calls that
 *     read or write device memory or put work on the GPU (launches, copies, sets, stream
 *     memory operations, graph launches, pointer queries; held.c) wait; the calls that
 *     only allocate go through (new memory of the allocator's, on the card); a free of
 *     memory of the allocator's is deferred until the kernel is back (the pause engine
 *     may be moving it), and succeeds at once.
 *   - VGPU_SUSPENDED (the driver's checkpoint holds the process): every call waits, each
 *     driver entry point handed out included (stubs.S), since the driver's lock would
 *     block it anyway, with no way back.
 *
 * A waiting thread releases the GIL while it waits (when it holds it: a C extension's
 * call), so that the kernel's own threads can run the way back, and starts that way back
 * once per away period: the first call held writes to an eventfd the kernel's wake
 * thread reads (pausing.py), which asks the node arbiter for room and resumes or restores
 * the kernel; the calls then go on. If the way back fails (no room before the arbiter's
 * queue timeout), the calls held return an error and vgpu_last_message says why, rather
 * than waiting forever.
 *
 * The machinery's calls (the pause engine's, while it pauses or resumes: vgpu_gate_mine)
 * never wait: they are what moves the memory. A pause closes
 * the gate before it looks at the memory, and waits for the calls already inside the
 * driver to return (vgpu_gate_close): no launch or copy can slip in between the pause's
 * snapshot of what is live and its copy.
 */
#include "vmm.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* Read by the stubs (stubs.S) on every call they stand for: a plain int, atomically. */
__attribute__((visibility("hidden"))) int g_vgpu_away = VGPU_PRESENT;

static long g_inflight = 0;      /* memory calls inside the driver now (atomic) */
static __thread int t_mine = 0;  /* this thread is the machinery's: never held */
static pthread_mutex_t g_gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cond;
static pthread_once_t g_cond_once = PTHREAD_ONCE_INIT;
static int g_wanted_fd = -1;
static int g_wanted = 0;        /* the way back was asked for in this away period */
static CUresult g_failed = 0;   /* the way back failed: held calls return this */
static char g_failed_why[256];  /* and leave this as their thread's last message */
static long g_waiting = 0;      /* threads waiting now */
static uint64_t g_waiting_since_ns = 0, g_held_total = 0;

static void make_cond(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&g_gate_cond, &a);
  pthread_condattr_destroy(&a);
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int away(void) { return __atomic_load_n(&g_vgpu_away, __ATOMIC_SEQ_CST); }

/* ---- the GIL: released while a thread of Python's waits here ---------------------- */
typedef int (*gil_check_fn)(void);
typedef void *(*save_fn)(void);
typedef void (*restore_fn)(void *);
static gil_check_fn py_gil_check;
static save_fn py_save;
static restore_fn py_restore;
static pthread_once_t g_python_once = PTHREAD_ONCE_INIT;

static void find_python(void) {
  *(void **)&py_gil_check = vgpu_real_dlsym(RTLD_DEFAULT, "PyGILState_Check");
  *(void **)&py_save = vgpu_real_dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
  *(void **)&py_restore = vgpu_real_dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
  if (!py_gil_check || !py_save || !py_restore) py_gil_check = NULL;
}

/* Wait while the gate is closed to calls of this kind (suspended_only: a call that only
 * the driver's checkpoint stops). 0 to go on, or the error to return. */
static CUresult wait_here(int suspended_only) {
  pthread_once(&g_cond_once, make_cond);
  pthread_once(&g_python_once, find_python);
  void *gil = NULL;
  if (py_gil_check && py_gil_check()) gil = py_save();
  vgpu_trace("gate: a call waits (%s; the GIL %s)", suspended_only ? "suspended" : "away", gil ? "let go" : "not held");
  pthread_mutex_lock(&g_gate_lock);
  if (g_waiting++ == 0) g_waiting_since_ns = now_ns();
  g_held_total++;
  if (!g_wanted && g_wanted_fd >= 0) {
    uint64_t one = 1;
    ssize_t ignored = write(g_wanted_fd, &one, sizeof one);
    (void)ignored;
    g_wanted = 1;
  }
  CUresult r = 0;
  for (;;) {
    int a = away();
    if (a == VGPU_PRESENT || (suspended_only && a != VGPU_SUSPENDED)) break;
    if (g_failed) {
      r = g_failed;
      break;
    }
    pthread_cond_wait(&g_gate_cond, &g_gate_lock);
  }
  g_waiting--;
  char why[sizeof g_failed_why];
  if (r) memcpy(why, g_failed_why, sizeof why);
  pthread_mutex_unlock(&g_gate_lock);
  if (r) set_error(r, "%s", why);
  if (gil) py_restore(gil);
  return r;
}

CUresult vgpu_held_enter(void) {
  if (t_mine) return CUDA_SUCCESS;
  for (;;) {
    __atomic_add_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST);
    if (away() == VGPU_PRESENT) return CUDA_SUCCESS;
    vgpu_held_leave();
    CUresult r = wait_here(0);
    if (r) return r;
  }
}

void vgpu_held_leave(void) {
  if (t_mine) return;
  if (__atomic_sub_fetch(&g_inflight, 1, __ATOMIC_SEQ_CST) == 0 && away() != VGPU_PRESENT) {
    pthread_once(&g_cond_once, make_cond);
    pthread_mutex_lock(&g_gate_lock);
    pthread_cond_broadcast(&g_gate_cond); /* a closing pause waits for the last one out */
    pthread_mutex_unlock(&g_gate_lock);
  }
}

CUresult vgpu_held_if_suspended(void) {
  if (t_mine || away() != VGPU_SUSPENDED) return CUDA_SUCCESS;
  return wait_here(1);
}

int vgpu_free_deferred(void) { return !t_mine && away() != VGPU_PRESENT; }

int vgpu_machinery(void) { return t_mine; }

/* The stubs' slow path (stubs.S): a call of a driver entry point while suspended. */
__attribute__((visibility("hidden"))) CUresult vgpu_stub_hold(int index) {
  (void)index;
  return vgpu_held_if_suspended();
}

/* ---- the machinery's side ---------------------------------------------------------- */
/* Mark the calling thread as the machinery's (on: 1) or not (0); returns what it was. */
int vgpu_gate_mine(int on) {
  int was = t_mine;
  t_mine = on;
  return was;
}

int vgpu_gate_wanted_fd(void) {
  pthread_mutex_lock(&g_gate_lock);
  if (g_wanted_fd < 0) g_wanted_fd = eventfd(0, EFD_CLOEXEC);
  int fd = g_wanted_fd;
  pthread_mutex_unlock(&g_gate_lock);
  return fd;
}

/* Close the gate (mode: VGPU_PAUSED or VGPU_SUSPENDED), then wait up to timeout_ms for
 * the memory calls already inside the driver to return. 0 when they did; otherwise the
 * gate is open again and VGPU_ERROR_BAD_STATE says a call did not return in time. */
int vgpu_gate_close(int mode, int timeout_ms) {
  pthread_once(&g_cond_once, make_cond);
  pthread_mutex_lock(&g_gate_lock);
  if (away() == VGPU_PRESENT) {
    g_wanted = 0;
    g_failed = 0;
  }
  __atomic_store_n(&g_vgpu_away, mode, __ATOMIC_SEQ_CST);
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += timeout_ms / 1000;
  until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  int r = 0;
  while (__atomic_load_n(&g_inflight, __ATOMIC_SEQ_CST) > 0) {
    if (pthread_cond_timedwait(&g_gate_cond, &g_gate_lock, &until) == ETIMEDOUT &&
        __atomic_load_n(&g_inflight, __ATOMIC_SEQ_CST) > 0) {
      __atomic_store_n(&g_vgpu_away, VGPU_PRESENT, __ATOMIC_SEQ_CST);
      pthread_cond_broadcast(&g_gate_cond);
      set_error(VGPU_ERROR_BAD_STATE, "closing the gate: a GPU call of another thread did not return in time");
      r = VGPU_ERROR_BAD_STATE;
      break;
    }
  }
  pthread_mutex_unlock(&g_gate_lock);
  return r;
}

/* Set the gate's mode (a suspended kernel whose process the driver restored: VGPU_PAUSED),
 * letting through what the new mode allows. */
void vgpu_gate_set(int mode) {
  pthread_once(&g_cond_once, make_cond);
  pthread_mutex_lock(&g_gate_lock);
  __atomic_store_n(&g_vgpu_away, mode, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&g_gate_cond);
  pthread_mutex_unlock(&g_gate_lock);
}

/* Open the gate: the kernel is back. What was freed meanwhile goes now. */
void vgpu_gate_open(void) {
  vgpu_gate_set(VGPU_PRESENT);
  pthread_mutex_lock(&g_gate_lock);
  g_wanted = 0;
  g_failed = 0;
  pthread_mutex_unlock(&g_gate_lock);
  frees_reap_deferred();
}

/* The way back failed: every call held in this away period returns `code`, and so does
 * every one made before the gate opens; `why` is the message each leaves in its thread. */
void vgpu_gate_fail(int code, const char *why) {
  pthread_once(&g_cond_once, make_cond);
  pthread_mutex_lock(&g_gate_lock);
  g_failed = code ? code : CUDA_ERROR_OUT_OF_MEMORY;
  snprintf(g_failed_why, sizeof g_failed_why, "%s", why && *why ? why : "bringing the kernel back failed");
  pthread_cond_broadcast(&g_gate_cond);
  pthread_mutex_unlock(&g_gate_lock);
}

/* The gate now: its mode, the threads waiting and since when (seconds, monotonic clock),
 * calls held since the library was loaded, and whether the way back was asked for. */
void vgpu_gate_figures(int *mode, long *waiting, double *since, uint64_t *held_total, int *wanted) {
  pthread_mutex_lock(&g_gate_lock);
  if (mode) *mode = away();
  if (waiting) *waiting = g_waiting;
  if (since) *since = g_waiting ? (double)g_waiting_since_ns / 1e9 : 0.0;
  if (held_total) *held_total = g_held_total;
  if (wanted) *wanted = g_wanted;
  pthread_mutex_unlock(&g_gate_lock);
}
