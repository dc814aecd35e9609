/*
 * Growth on demand: an allocation the driver refuses for lack of memory asks the node
 * arbiter for room before its caller sees the error.
 *
 * The arbiter grants a running cell what it holds plus a margin, and makes the rest of its
 * room when it grows (docs/design.md, "Growth on demand"). The ask is made here, in C, on
 * the allocating thread, over the library's own connection to the arbiter (the "grow
 * channel", vgpu_set_grow_channel): it never enters Python. The allocating thread may hold
 * a lock of another library (PyTorch's caching allocator's, always, for its own
 * allocations) that a thread holding Python's lock waits for (torch.cuda.memory_allocated):
 * an ask that needed Python's lock there would deadlock the process. It is made with no
 * lock of the library held (g_lock), so that the other threads (the pause engine's) go on
 * meanwhile. Never asked:
 *   - again from inside an ask on the same thread (the ask allocates no device memory; a
 *     signal handler's allocation, say, gets the error as it is);
 *   - by the machinery's threads (vgpu_gate_mine: the pause engine moving the memory, its
 *     work areas): what a pause or resume needs is the arbiter's to give before it starts.
 *     A resume's own new memory (vgpu_map, vgpu_map_many) never asks either: it does not
 *     take this path at all, and answers out of memory to the engine, which says so;
 *   - in a child of fork() (the channel is closed there, unsaid: the child is not the
 *     kernel the arbiter knows).
 *
 * The channel: a Unix stream socket to the arbiter, connected at the first ask, one JSON
 * object a line both ways:
 *   -> {"type":"channel","version":4,"for":"grow"}         once, first
 *   <- {"type":"ok"}   or   {"type":"error","message":"..."} (then the arbiter closes)
 *   -> {"type":"room","id":N,"for":"grow","bytes":B}        each ask, N = 1, 2, ... a process
 *   <- {"type":"wait","id":N,"message":"..."}               any number of them, then one of
 *   <- {"type":"grant","id":N}  {"type":"deny","id":N,...}  {"type":"failed","id":N,...}
 * grant: the allocation is made again; anything else: the caller gets the out-of-memory
 * error. Lines of another id are skipped. No line for JUPYTER_VGPU_GROW_SILENCE_S seconds
 * (60 unless set), an error, an end of the connection or a line past 64 KiB close the
 * channel and answer no room; the next ask connects again. One ask at a time: a second
 * thread waits for the first's answer, then asks itself.
 */
#include "vmm.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CHANNEL_PATH_MAX 107            /* sizeof sun_path, less its NUL */
#define CHANNEL_LINE_MAX (64 * 1024)    /* a line of the arbiter's, its newline aside */
#define CHANNEL_SILENCE_S 60.0          /* JUPYTER_VGPU_GROW_SILENCE_S overrides it */
#define CHANNEL_DEPTH_MAX 32            /* nesting of a value skipped in a line */

static uint64_t g_grow_asks = 0, g_grow_granted = 0;
static __thread int t_growing = 0;        /* this thread asks now */
static __thread int t_refused_device = 0; /* the physical allocation the driver refused last */
static __thread uint64_t t_refused_bytes = 0;

/* The channel. g_ask_lock serializes asks and owns the connection's traffic: the buffer,
 * the ids, closing the socket. g_chan_lock, held briefly, guards the path and the socket's
 * number, which vgpu_set_grow_channel changes while an ask may be under way. Order: ask,
 * then chan. Neither is g_lock, and neither is held while g_lock is taken. */
static pthread_mutex_t g_ask_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_chan_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_path[CHANNEL_PATH_MAX + 1]; /* "": asking is off (chan lock) */
static int g_on = 0;                      /* g_path[0] != 0, read without a lock */
static unsigned g_gen = 0;                /* changes with the path (chan lock) */
static int g_fd = -1;                     /* the connection, or -1 (chan lock; closed under ask) */
static unsigned g_fd_gen = 0;             /* the g_gen it was connected for */
static uint64_t g_next_id = 0;            /* the last room's id (ask lock) */
static char g_buf[CHANNEL_LINE_MAX + 2];  /* bytes read, not taken yet (ask lock) */
static size_t g_have = 0, g_taken = 0;    /* g_buf[0, g_have) read; the first g_taken taken */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double silence_s(void) {
  const char *v = getenv("JUPYTER_VGPU_GROW_SILENCE_S");
  if (v && *v) {
    char *end = NULL;
    double s = strtod(v, &end);
    if (end != v && s > 0) return s;
  }
  return CHANNEL_SILENCE_S;
}

/* Wait until fd is ready for events or the deadline passes: 1 ready (or hung up, which
 * the read or write then says), 0 the deadline passed, -1 an error. */
static int ready(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0) return 0;
    struct pollfd p = {fd, events, 0};
    int ms = left > 3600 ? 3600000 : (int)(left * 1000) + 1;
    int n = poll(&p, 1, ms);
    if (n > 0) return 1;
    if (n < 0 && errno != EINTR) return -1;
  }
}

/* Close the connection (ask lock held): it is the channel's no more. */
static void channel_drop(int fd, const char *why) {
  pthread_mutex_lock(&g_chan_lock);
  if (g_fd == fd) g_fd = -1;
  pthread_mutex_unlock(&g_chan_lock);
  close(fd);
  g_have = g_taken = 0;
  vgpu_trace("grow channel: closed (%s)", why);
}

/* 0 when all of line was sent before the deadline; -1 otherwise. */
static int send_line(int fd, const char *line, double deadline) {
  size_t n = strlen(line), done = 0;
  while (done < n) {
    ssize_t k = send(fd, line + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      done += (size_t)k;
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (ready(fd, POLLOUT, deadline) != 1) return -1;
    } else {
      return -1;
    }
  }
  return 0;
}

/* The next line of the arbiter's, NUL-terminated in g_buf (valid until the next call), in
 * *line: 1; 0 no line before the deadline; -1 the connection ended or failed; -2 a line
 * past CHANNEL_LINE_MAX. */
static int read_line(int fd, double deadline, char **line) {
  if (g_taken) {
    memmove(g_buf, g_buf + g_taken, g_have - g_taken);
    g_have -= g_taken;
    g_taken = 0;
  }
  size_t scanned = 0;
  for (;;) {
    char *nl = memchr(g_buf + scanned, '\n', g_have - scanned);
    if (nl) {
      *nl = 0;
      *line = g_buf;
      g_taken = (size_t)(nl - g_buf) + 1;
      return 1;
    }
    scanned = g_have;
    if (g_have > CHANNEL_LINE_MAX) return -2;
    ssize_t k = recv(fd, g_buf + g_have, sizeof g_buf - 1 - g_have, MSG_DONTWAIT);
    if (k > 0) {
      g_have += (size_t)k;
    } else if (k == 0) {
      return -1;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int r = ready(fd, POLLIN, deadline);
      if (r != 1) return r;
    } else {
      return -1;
    }
  }
}

/* ---- a tiny scanner of one JSON object: its "type" (a string) and "id" (an integer) --- */
typedef struct {
  char type[16]; /* "" where absent; "?" where not a short plain string */
  int has_id;
  uint64_t id;
} Line;

static const char *skip_space(const char *p) {
  while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
  return p;
}

/* p at a string's opening quote: past its closing one, or NULL. */
static const char *skip_string(const char *p) {
  for (p++; *p != '"'; p++) {
    if (!*p) return NULL;
    if (*p == '\\' && !*++p) return NULL;
  }
  return p + 1;
}

/* p at a value: past it, or NULL. */
static const char *skip_value(const char *p, int depth) {
  p = skip_space(p);
  if (*p == '"') return skip_string(p);
  if (*p == '{' || *p == '[') {
    char close = *p == '{' ? '}' : ']';
    if (depth >= CHANNEL_DEPTH_MAX) return NULL;
    p = skip_space(p + 1);
    if (*p == close) return p + 1;
    for (;;) {
      if (close == '}') {
        if (*(p = skip_space(p)) != '"' || !(p = skip_string(p))) return NULL;
        if (*(p = skip_space(p)) != ':') return NULL;
        p++;
      }
      if (!(p = skip_value(p, depth + 1))) return NULL;
      p = skip_space(p);
      if (*p == close) return p + 1;
      if (*p != ',') return NULL;
      p++;
    }
  }
  const char *start = p; /* a number, true, false or null */
  while ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || *p == '-' || *p == '+' || *p == '.' ||
         (*p >= 'A' && *p <= 'Z'))
    p++;
  return p > start ? p : NULL;
}

/* 1 when text is one JSON object (fields in any order, spaces anywhere between tokens),
 * with what it says in *out; 0 when it is not. */
static int scan_line(const char *text, Line *out) {
  memset(out, 0, sizeof *out);
  const char *p = skip_space(text);
  if (*p != '{') return 0;
  p = skip_space(p + 1);
  if (*p == '}') return *skip_space(p + 1) == 0;
  for (;;) {
    p = skip_space(p);
    if (*p != '"') return 0;
    const char *key = p + 1;
    if (!(p = skip_string(p))) return 0;
    size_t klen = (size_t)(p - 1 - key);
    if (*(p = skip_space(p)) != ':') return 0;
    p = skip_space(p + 1);
    const char *value = p;
    if (!(p = skip_value(p, 0))) return 0;
    size_t vlen = (size_t)(p - value);
    if (klen == 4 && memcmp(key, "type", 4) == 0) {
      int plain = *value == '"' && vlen - 2 < sizeof out->type && !memchr(value + 1, '\\', vlen - 2);
      if (plain) {
        memcpy(out->type, value + 1, vlen - 2);
        out->type[vlen - 2] = 0;
      } else {
        strcpy(out->type, "?");
      }
    } else if (klen == 2 && memcmp(key, "id", 2) == 0) {
      uint64_t id = 0;
      size_t i = 0;
      for (; i < vlen && value[i] >= '0' && value[i] <= '9' && id <= (UINT64_MAX - 9) / 10; i++)
        id = id * 10 + (uint64_t)(value[i] - '0');
      out->has_id = vlen > 0 && i == vlen;
      out->id = out->has_id ? id : 0;
    }
    p = skip_space(p);
    if (*p == '}') return *skip_space(p + 1) == 0;
    if (*p != ',') return 0;
    p++;
  }
}

/* ---- the channel --------------------------------------------------------------------- */

/* The connection, open and accepted (ask lock held), connecting when there is none; -1
 * when asking is off or the arbiter cannot be reached or refuses. */
static int channel_open(double silence) {
  char path[CHANNEL_PATH_MAX + 1];
  pthread_mutex_lock(&g_chan_lock);
  int fd = g_fd;
  unsigned gen = g_gen;
  int stale = fd >= 0 && g_fd_gen != gen;
  memcpy(path, g_path, sizeof path);
  pthread_mutex_unlock(&g_chan_lock);
  if (stale) channel_drop(fd, "the channel's path changed");
  else if (fd >= 0) return fd;
  if (!path[0]) return -1;

  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    vgpu_trace("grow channel: no socket (%s)", strerror(errno));
    return -1;
  }
  struct sockaddr_un addr;
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  memcpy(addr.sun_path, path, strlen(path) + 1);
  int rc;
  do rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
  while (rc < 0 && errno == EINTR);
  if (rc < 0) { /* a Unix socket connects at once or not at all (EAGAIN: its backlog is full) */
    vgpu_trace("grow channel: connecting to %s failed (%s)", path, strerror(errno));
    close(fd);
    return -1;
  }
  pthread_mutex_lock(&g_chan_lock);
  int current = g_gen == gen;
  if (current) {
    g_fd = fd;
    g_fd_gen = gen;
  }
  pthread_mutex_unlock(&g_chan_lock);
  if (!current) { /* the path changed while connecting */
    close(fd);
    return -1;
  }
  g_have = g_taken = 0;
  vgpu_trace("grow channel: connected to %s", path);

  double deadline = now_s() + silence;
  if (send_line(fd, "{\"type\":\"channel\",\"version\":4,\"for\":\"grow\"}\n", deadline) != 0) {
    channel_drop(fd, "the channel line could not be sent");
    return -1;
  }
  char *text = NULL;
  int got = read_line(fd, deadline, &text);
  Line l;
  if (got == 1 && scan_line(text, &l) && strcmp(l.type, "ok") == 0) {
    vgpu_trace("grow channel: accepted");
    return fd;
  }
  if (got == 1) vgpu_trace("grow channel: refused: %.300s", text);
  channel_drop(fd, got == 1    ? "refused"
                   : got == 0  ? "no answer to the channel line in time"
                   : got == -2 ? "an answer line too long"
                               : "the arbiter closed the connection");
  return -1;
}

/* Ask the arbiter for room for bytes more; 1 when it granted them. */
static int channel_ask(int device, uint64_t bytes) {
  pthread_mutex_lock(&g_ask_lock);
  double silence = silence_s();
  int granted = 0;
  int fd = channel_open(silence);
  if (fd >= 0) {
    uint64_t id = ++g_next_id;
    char ask[160];
    snprintf(ask, sizeof ask, "{\"type\":\"room\",\"id\":%llu,\"for\":\"grow\",\"bytes\":%llu}\n",
             (unsigned long long)id, (unsigned long long)bytes);
    vgpu_trace("grow channel: asking for %llu bytes on device %d (id %llu)", (unsigned long long)bytes, device,
               (unsigned long long)id);
    double deadline = now_s() + silence;
    const char *dropped = NULL;
    if (send_line(fd, ask, deadline) != 0) dropped = "the ask could not be sent";
    while (!dropped) {
      char *text = NULL;
      int got = read_line(fd, deadline, &text);
      if (got != 1) {
        dropped = got == 0    ? "no line from the arbiter in time"
                  : got == -2 ? "a line too long"
                              : "the arbiter closed the connection";
        break;
      }
      deadline = now_s() + silence;
      Line l;
      if (!scan_line(text, &l)) {
        vgpu_trace("grow channel: a line skipped, not one JSON object: %.200s", text);
        continue;
      }
      if (strcmp(l.type, "error") == 0 && (!l.has_id || l.id == id)) {
        vgpu_trace("grow channel: error: %.300s", text);
        dropped = "the arbiter answered an error";
        break;
      }
      if (!l.has_id || l.id != id) continue; /* another ask's, or no ask's */
      if (strcmp(l.type, "wait") == 0) {
        vgpu_trace("grow channel: waiting (id %llu): %.300s", (unsigned long long)id, text);
        continue;
      }
      granted = strcmp(l.type, "grant") == 0;
      vgpu_trace("grow channel: answered %s (id %llu)", l.type, (unsigned long long)id);
      break;
    }
    if (dropped) {
      channel_drop(fd, dropped);
    } else { /* turned off or moved meanwhile (vgpu_set_grow_channel could not close it) */
      pthread_mutex_lock(&g_chan_lock);
      int stale = g_fd == fd && g_fd_gen != g_gen;
      pthread_mutex_unlock(&g_chan_lock);
      if (stale) channel_drop(fd, "the channel's path changed");
    }
  }
  pthread_mutex_unlock(&g_ask_lock);
  return granted;
}

/* ---- the allocation paths' side (vmm.h) --------------------------------------------- */

void grow_start(Growth *g) {
  g->asks = 0;
  t_refused_bytes = 0;
}

void grow_refused(int device, uint64_t bytes) {
  t_refused_device = device;
  t_refused_bytes = bytes;
}

/* After an attempt that answered r (no lock held): 1 when the attempt should be made
 * again, the arbiter having made room for the physical allocation the driver refused. */
int grow_again(Growth *g, CUresult r) {
  uint64_t bytes = t_refused_bytes;
  int device = t_refused_device;
  t_refused_bytes = 0;
  if (r != CUDA_ERROR_OUT_OF_MEMORY || !bytes || t_growing || g->asks >= GROW_TRIES || vgpu_machinery())
    return 0;
  if (!__atomic_load_n(&g_on, __ATOMIC_ACQUIRE)) return 0;
  g->asks++;
  __atomic_add_fetch(&g_grow_asks, 1, __ATOMIC_RELAXED);
  vgpu_trace("grow: %llu bytes on device %d refused; asking for room (ask %d)", (unsigned long long)bytes,
             device, g->asks);
  t_growing = 1;
  int made = channel_ask(device, bytes);
  t_growing = 0;
  t_refused_bytes = 0;
  vgpu_trace("grow: %s", made ? "room made, trying again" : "no room");
  return made;
}

void grow_end(Growth *g, CUresult r) {
  if (r == CUDA_SUCCESS && g->asks) __atomic_add_fetch(&g_grow_granted, 1, __ATOMIC_RELAXED);
}

/* A child of fork(): asking is off, the parent's connection closed here without a word
 * (the parent's stays open), the figures zero. */
void grow_fork_child(void) {
  pthread_mutex_t fresh_ask = PTHREAD_MUTEX_INITIALIZER, fresh_chan = PTHREAD_MUTEX_INITIALIZER;
  g_ask_lock = fresh_ask;
  g_chan_lock = fresh_chan;
  if (g_fd >= 0) close(g_fd);
  g_fd = -1;
  g_path[0] = 0;
  g_on = 0;
  g_gen++;
  g_have = g_taken = 0;
  g_next_id = 0;
  g_grow_asks = g_grow_granted = 0;
}

/* ---- what vmm.py calls --------------------------------------------------------------- */

/* Ask the arbiter listening at socket_path for room whenever the driver refuses a physical
 * allocation of the process for lack of memory (the protocol: the comment at the top).
 * NULL or "": asking is off, and the channel is closed (by the ask under way, if any, when
 * it ends: it is answered no room at once). The path is copied; the connection is made at
 * the first ask. Returns 0, or -1 (nothing changed) for a path longer than 107 bytes. */
int vgpu_set_grow_channel(const char *socket_path) {
  const char *path = socket_path ? socket_path : "";
  size_t n = strlen(path);
  if (n > CHANNEL_PATH_MAX) return -1;
  int mine = pthread_mutex_trylock(&g_ask_lock) == 0; /* no ask under way */
  pthread_mutex_lock(&g_chan_lock);
  if (strcmp(g_path, path) != 0) {
    memcpy(g_path, path, n + 1);
    g_gen++;
    __atomic_store_n(&g_on, n > 0, __ATOMIC_RELEASE);
    if (g_fd >= 0 && mine) {
      close(g_fd);
      g_fd = -1;
      g_have = g_taken = 0;
    } else if (g_fd >= 0) {
      shutdown(g_fd, SHUT_RDWR); /* the ask under way ends, and closes it */
    }
  }
  pthread_mutex_unlock(&g_chan_lock);
  if (mine) pthread_mutex_unlock(&g_ask_lock);
  vgpu_trace("grow channel: %s%s", n ? "asking at " : "off", path);
  return 0;
}

/* [0] asks, [1] allocations that succeeded after asking; since the library was loaded (in
 * a child of fork(), since the fork). */
void vgpu_grow_figures(uint64_t *out2) {
  out2[0] = __atomic_load_n(&g_grow_asks, __ATOMIC_RELAXED);
  out2[1] = __atomic_load_n(&g_grow_granted, __ATOMIC_RELAXED);
}
