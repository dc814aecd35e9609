/*
 * CUDA IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle) for memory
 * of ours.
 *
 * The driver's legacy IPC works on cuMemAlloc memory only: on virtual-memory
 * allocations cuIpcGetMemHandle fails with "invalid argument", so torch.multiprocessing,
 * Hogwild training and anything else built on it broke in a kernel with the pausable
 * allocator, with no pause at all. Segments of ours are made with a POSIX
 * file-descriptor handle type, and their IPC goes through shareable handles instead,
 * as PyTorch's own expandable segments share theirs:
 *
 *   - the exporter exports the segment's physical allocation as a file descriptor
 *     (cuMemExportToShareableHandle), keeps it open while the segment lives, and writes
 *     into the 64-byte IPC handle a magic word, its PID, a random token naming the
 *     export, the segment's size and the pointer's offset in it;
 *   - the importer (any process of the same user with this library: children inherit
 *     LD_PRELOAD) connects to the exporter's Unix socket, which passes the descriptor
 *     (SCM_RIGHTS) to callers of the exporter's own user (SO_PEERCRED) who name a live
 *     token; it imports the allocation (cuMemImportFromShareableHandle), maps it at
 *     addresses of its own, and returns them at the same offset. Opening one handle
 *     twice returns the same mapping.
 *
 * The socket's name is abstract (no file, so nothing to clean up, and every process of
 * the user can reach it without a directory both can write), and unguessable: the
 * exporter's PID and a random 64-bit nonce drawn when it starts serving, carried in the
 * handle. Abstract names have no owner, so no other user can be kept from binding a
 * name: being unable to know it first is what keeps one from taking it before the
 * exporter (its owner could not share), and both ends check the other (SO_PEERCRED)
 * before a byte passes: the exporter answers callers of its own uid alone, and the
 * importer accepts a descriptor only from the PID the handle names, of its own uid (a
 * process that took the name of an exporter that ended would otherwise hand it memory
 * of its choosing, and be sent the token).
 *
 * A socket rather than pidfd_getfd(2): that needs the right to ptrace the exporter,
 * which Yama's default (ptrace_scope 1) refuses to a child opening its parent's handle.
 *
 * An exported segment is shared: a peer maps its physical memory, so releasing it
 * would leave the peer on stale memory, and it is never paused. It stays on the card
 * while the rest of the kernel is paused (the driver cannot restore a process that
 * shares memory this way, so such a kernel is never suspended: pausing.py). Handles of
 * other processes' memory (legacy cuMemAlloc) go to the driver unchanged.
 */
#include "vmm.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <sys/un.h>
#include <unistd.h>

#define MAGIC "VGPUIPC1"

typedef struct {
  char magic[8];
  int32_t pid;
  int32_t device;
  uint64_t token;
  uint64_t size;
  uint64_t offset;
  uint64_t nonce; /* of the exporter's socket's name */
  char spare[16];
} Blob;
_Static_assert(sizeof(Blob) == sizeof(CUipcMemHandle), "an IPC handle is 64 bytes");

typedef struct {
  int32_t pid;
  uint64_t token;
  uint64_t base, size;
  CUmemGenericAllocationHandle real;
  int refs;
} Import;

uint64_t g_exported_bytes = 0, g_imported_bytes = 0;
static Import *g_imports = NULL;
static size_t g_nimports = 0, g_cap_imports = 0;
static int g_server_fd = -1;
static uint64_t g_server_nonce = 0;

static void socket_name(struct sockaddr_un *addr, socklen_t *len, int32_t pid, uint64_t nonce) {
  memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path + 1, sizeof addr->sun_path - 1, "jupyter-vgpu-ipc-%d-%016llx", (int)pid,
                   (unsigned long long)nonce);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* 64 random bits from the kernel's pool (waiting for it, once, if it is not ready yet). */
static int random_u64(uint64_t *out) {
  ssize_t got = getrandom(out, sizeof *out, GRND_NONBLOCK);
  if (got != (ssize_t)sizeof *out) got = getrandom(out, sizeof *out, 0);
  return got == (ssize_t)sizeof *out;
}

/* ---- the exporter's side ---------------------------------------------------------- */
/* A token naming an export: random, never 0. Never blocks: a machine just started may
 * not have its random pool ready (getrandom then fails with GRND_NONBLOCK), and a token
 * only has to be unguessable to other users' processes, which the socket refuses anyway. */
static uint64_t new_token(void) {
  uint64_t token = 0;
  if (getrandom(&token, sizeof token, GRND_NONBLOCK) != (ssize_t)sizeof token) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    token = ((uint64_t)t.tv_nsec << 32) ^ (uint64_t)t.tv_sec ^ ((uint64_t)getpid() << 16) ^ (uint64_t)(uintptr_t)&t;
  }
  return token ? token : 1;
}

static int send_fd(int sock, int fd) {
  char byte = 0;
  struct iovec iov = {&byte, 1};
  char control[CMSG_SPACE(sizeof(int))];
  memset(control, 0, sizeof control);
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return sendmsg(sock, &msg, MSG_NOSIGNAL) == 1;
}

static void *serve(void *arg) {
  int listener = (int)(intptr_t)arg;
  for (;;) {
    int c = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return NULL; /* closed (fork, exit) */
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    struct timeval tv = {5, 0};
    uint64_t token = 0;
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    vgpu_trace("ipc: a request");
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == getuid() && cred.pid > 0 &&
        recv(c, &token, sizeof token, MSG_WAITALL) == (ssize_t)sizeof token) {
      pthread_mutex_lock(&g_lock);
      int fd = seg_export_fd(token);
      if (fd >= 0) send_fd(c, fd);
      pthread_mutex_unlock(&g_lock);
    }
    close(c);
  }
}

static int start_server(void) {
  if (g_server_fd >= 0) return 1;
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return 0;
  struct sockaddr_un addr;
  socklen_t len;
  int bound = 0;
  for (int tries = 0; tries < 8 && !bound; tries++) { /* a name in use: another nonce */
    if (!random_u64(&g_server_nonce)) break;
    socket_name(&addr, &len, getpid(), g_server_nonce);
    bound = bind(s, (struct sockaddr *)&addr, len) == 0;
    if (!bound && errno != EADDRINUSE) break;
  }
  if (!bound || listen(s, 64) != 0) {
    close(s);
    return 0;
  }
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* the thread takes no signal of the process */
  pthread_t thread;
  int ok = pthread_create(&thread, NULL, serve, (void *)(intptr_t)s) == 0;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (!ok) {
    close(s);
    return 0;
  }
  pthread_detach(thread);
  g_server_fd = s;
  return 1;
}

CUresult ipc_get_handle(CUipcMemHandle *handle, CUdeviceptr dptr) {
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  vgpu_trace("ipc: export %#llx", (unsigned long long)dptr);
  pthread_mutex_lock(&g_lock);
  Segment *s = seg_containing(dptr);
  CUresult r = CUDA_SUCCESS;
  if (!s || (s->flags & SEG_CACHED)) r = CUDA_ERROR_NOT_FOUND;
  else if (!s->mapped) r = CUDA_ERROR_ILLEGAL_STATE;
  else if (!(s->flags & SEG_FD) || !drv.cuMemExportToShareableHandle) r = CUDA_ERROR_NOT_SUPPORTED;
  else if (!start_server()) r = CUDA_ERROR_OPERATING_SYSTEM;
  else if (s->export_fd < 0) {
    int fd = -1;
    r = drv.cuMemExportToShareableHandle(&fd, s->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r == CUDA_SUCCESS) {
      uint64_t token = new_token();
      s->export_fd = fd;
      s->token = token;
      s->flags |= SEG_EXPORTED;
      g_exported_bytes += s->size;
    }
  }
  if (r == CUDA_SUCCESS) {
    Blob b;
    memset(&b, 0, sizeof b);
    memcpy(b.magic, MAGIC, 8);
    b.pid = getpid();
    b.device = s->device;
    b.token = s->token;
    b.size = s->size;
    b.offset = dptr - s->ptr;
    b.nonce = g_server_nonce;
    memcpy(handle, &b, sizeof b);
  }
  pthread_mutex_unlock(&g_lock);
  vgpu_trace("ipc: export %#llx: %d", (unsigned long long)dptr, r);
  return r;
}

/* The segment goes away: its export too (the lock is held). */
void ipc_forget(Segment *s) {
  if (s->export_fd < 0) return;
  close(s->export_fd);
  s->export_fd = -1;
  g_exported_bytes -= s->size;
}

/* ---- the importer's side ---------------------------------------------------------- */
/* 1 when the process at the other end of the connected socket s is process pid, of this
 * process's own user. */
static int peer_is(int s, int32_t pid) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  return getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid == pid && cred.uid == getuid();
}

static int fetch_fd(int32_t pid, uint64_t nonce, uint64_t token) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  struct sockaddr_un addr;
  socklen_t len;
  socket_name(&addr, &len, pid, nonce);
  struct timeval tv = {10, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  int fd = -1;
  if (connect(s, (struct sockaddr *)&addr, len) == 0 && peer_is(s, pid) &&
      send(s, &token, sizeof token, MSG_NOSIGNAL) == (ssize_t)sizeof token) {
    char byte;
    struct iovec iov = {&byte, 1};
    char control[CMSG_SPACE(sizeof(int))];
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    if (recvmsg(s, &msg, MSG_CMSG_CLOEXEC) == 1) {
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  close(s);
  return fd;
}

CUresult ipc_open(CUdeviceptr *out, const CUipcMemHandle *handle) {
  Blob b;
  memcpy(&b, handle, sizeof b);
  if (memcmp(b.magic, MAGIC, 8) != 0) return CUDA_ERROR_NOT_FOUND;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_lock);
  for (size_t i = 0; i < g_nimports; i++)
    if (g_imports[i].pid == b.pid && g_imports[i].token == b.token) {
      g_imports[i].refs++;
      *out = g_imports[i].base + b.offset;
      pthread_mutex_unlock(&g_lock);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&g_lock);
  int device;
  CUresult r = current_device(&device);
  if (r != CUDA_SUCCESS) return r;
  vgpu_trace("ipc: open an export of process %d", (int)b.pid);
  int fd = fetch_fd(b.pid, b.nonce, b.token);
  vgpu_trace("ipc: descriptor %d from process %d", fd, (int)b.pid);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE; /* the exporter is gone, or freed the memory */
  CUmemGenericAllocationHandle real;
  r = drv.cuMemImportFromShareableHandle(&real, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);
  if (r != CUDA_SUCCESS) return r;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = 1;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t g = 0;
  drv.cuMemGetAllocationGranularity(&g, &prop, 0);
  CUdeviceptr va = 0;
  r = drv.cuMemAddressReserve(&va, b.size, g, 0, 0);
  if (r == CUDA_SUCCESS && (r = drv.cuMemMap(va, b.size, 0, real, 0)) != CUDA_SUCCESS) drv.cuMemAddressFree(va, b.size);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((r = drv.cuMemSetAccess(va, b.size, &access, 1)) != CUDA_SUCCESS) {
      drv.cuMemUnmap(va, b.size);
      drv.cuMemAddressFree(va, b.size);
    }
  }
  if (r != CUDA_SUCCESS) {
    drv.cuMemRelease(real);
    return r;
  }
  pthread_mutex_lock(&g_lock);
  if (VGPU_ROOM(g_imports, g_nimports, g_cap_imports, 16)) {
    Import imp = {b.pid, b.token, va, b.size, real, 1};
    g_imports[g_nimports++] = imp;
    g_imported_bytes += b.size;
    *out = va + b.offset;
  } else {
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_unlock(&g_lock);
  if (r != CUDA_SUCCESS) {
    drv.cuMemUnmap(va, b.size);
    drv.cuMemAddressFree(va, b.size);
    drv.cuMemRelease(real);
  }
  vgpu_trace("ipc: opened at %#llx: %d", (unsigned long long)va, r);
  return r;
}

CUresult ipc_close(CUdeviceptr dptr) {
  pthread_mutex_lock(&g_lock);
  for (size_t i = 0; i < g_nimports; i++) {
    Import *imp = &g_imports[i];
    if (dptr < imp->base || dptr >= imp->base + imp->size) continue;
    if (--imp->refs == 0) {
      Import gone = *imp;
      g_imports[i] = g_imports[--g_nimports];
      g_imported_bytes -= gone.size;
      pthread_mutex_unlock(&g_lock);
      drv.cuMemUnmap(gone.base, gone.size);
      drv.cuMemAddressFree(gone.base, gone.size);
      drv.cuMemRelease(gone.real);
      return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&g_lock);
  return CUDA_ERROR_NOT_FOUND;
}

/* A child of fork() neither serves its parent's exports nor keeps their socket. */
void fork_child_reset(void) {
  if (g_server_fd >= 0) close(g_server_fd);
  g_server_fd = -1;
}
