/* pglua: a lua-compatible command line with MPI and the pipegoose runtime.
 *
 *   pglua [options] [script [args]]     (options as lua's: -e -l -i -v -E -W -- -)
 *
 * MPI starts before the script and finalises at exit. Any uncaught error
 * prints "[rank N] message" on stderr ("[ranks 0-3] message" once when every
 * rank fails alike; a traceback for internal errors and under PG_DEBUG=1),
 * then ends the whole job: MPI_Abort under mpirun (other ranks may be blocked
 * in a collective), exit status 1 alone. */
#define _GNU_SOURCE
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include "pg_clock.h"
#include "pg_machine.h"
#include "pg_comm.h"
#include "pg_context.h"
#include "pg_env.h"
#include "pg_error.h"

int luaopen_pipegoose_core(lua_State *L);

static const char *progname = "pglua";

static void usage(FILE *f) {
  fprintf(f,
          "usage: %s [options] [script [args]]\n"
          "Available options are:\n"
          "  -e stat   execute string 'stat'\n"
          "  -i        enter interactive mode after executing 'script'\n"
          "  -l mod    require library 'mod' into global 'mod'\n"
          "  -l g=mod  require library 'mod' into global 'g'\n"
          "  -v        show version information\n"
          "  -E        ignore environment variables\n"
          "  -W        turn warnings on\n"
          "  --        stop handling options\n"
          "  -         stop handling options and execute stdin\n"
          "  --help    show this help\n"
          "Run it under mpirun for several ranks: mpirun -np 4 %s recipe.lua\n",
          progname, progname);
}

/* ---- ending the job on error ----
 *
 * One report per job: a failing rank first agrees with the others, for up to
 * the grace period (PG_ABORT_GRACE seconds, default 1), on whether they all
 * failed and with which message: it sends a hash of its message to every
 * other rank over a communicator of its own (the others may be blocked in a
 * collective on theirs) and waits for theirs. Each group of ranks with one
 * message is then reported once, by its lowest rank, as "[ranks 0-3] message".
 * When not every rank failed in time (some are blocked, or still running),
 * each failing rank reports alone, "[rank 2] message", and tells the others it
 * has; before ending the job it lingers until every rank it has heard fail has
 * reported too, and until a grace period has passed with no new failure: the
 * first MPI_Abort ends every process, so without the linger a rank that fails
 * a moment later (two ranks whose watchdogs fire together, on a loaded
 * machine) would be killed before its message is out. The linger ends after
 * at most 3 grace periods plus LINGER_CAP_S, whatever the others do.
 *
 * Causes last: a rank whose failure followed a watchdog timeout
 * (pg_comm_timed_out: it was left waiting, most likely for a rank that
 * failed) is a consequence. Consequences are reported first, alone or in
 * groups, and the other failures after them, so that the last line of the
 * job's stderr is the one to read (scripts/mpirun.sh keeps it last).
 *
 * Tracebacks: an error raised on purpose (error(), assert(), a binding's
 * luaL_error: pipegoose's checks, a missing file) prints its message only.
 * An error Lua raises itself (attempt to index/call/compare a wrong value, a
 * built-in's "bad argument", a stack overflow), even when re-raised by a
 * pcall handler, is a bug somewhere and prints the traceback too; so does
 * every error under PG_DEBUG=1. */

static MPI_Comm report_comm = MPI_COMM_NULL; /* a duplicate of the world, for reports only */

/* What the message handler learned about the error being reported. */
static struct {
  int internal;
  char *traceback;
} failure;

static void sleep_seconds(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

/* main refused a bad value at start-up (pg_env_check_all): these cannot fail after it */
static double grace_seconds(void) {
  double v = 1.0;
  return pg_env_double("PG_ABORT_GRACE", &v) ? 1.0 : v;
}

static int debug_mode(void) {
  int on = 0;
  return pg_env_bool("PG_DEBUG", &on) ? 0 : on;
}

/* Polls a request until it completes (1) or `seconds` pass (0). */
static int wait_request(MPI_Request *req, double seconds) {
  double end = pg_wtime() + seconds;
  for (;;) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return 0;
    if (done) return 1;
    if (pg_wtime() >= end) return 0;
    sleep_seconds(1e-3);
  }
}

/* Ends the job with `code`. Alone: finalise and exit. Under mpirun: MPI_Abort
 * takes every rank down (some may be blocked in a collective). */
static _Noreturn void abort_job(int code) {
  fflush(stdout);
  fflush(stderr);
  if (pg_mpi_world_size() > 1) MPI_Abort(MPI_COMM_WORLD, code);
  pg_mpi_finalize();
  exit(code);
}

/* A failure with no message to agree on (os.exit(code), a bad command line):
 * the grace period lets other ranks that fail too print theirs first. */
static _Noreturn void end_job(int code) {
  fflush(stdout);
  fflush(stderr);
  if (pg_mpi_world_size() > 1) sleep_seconds(grace_seconds());
  abort_job(code);
}

static uint64_t fnv1a(const char *s, uint64_t h) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* The ranks r with hashes[r] == h as "0-3", "0,2", "0-2,5" in buf; returns how many. */
static int rank_list(const uint64_t *hashes, int n, uint64_t h, char *buf, size_t size) {
  int count = 0;
  size_t k = 0;
  buf[0] = 0;
  for (int r = 0; r < n; r++) {
    if (hashes[r] != h) continue;
    int last = r;
    while (last + 1 < n && hashes[last + 1] == h) last++;
    if (k < size) {
      int w = last > r ? snprintf(buf + k, size - k, "%s%d-%d", count ? "," : "", r, last)
                       : snprintf(buf + k, size - k, "%s%d", count ? "," : "", r);
      k += w > 0 ? (size_t)w : 0;
    }
    count += last - r + 1;
    r = last;
  }
  return count;
}

static void print_report(const char *who, const char *msg, int with_traceback) {
  fflush(stdout);
  fprintf(stderr, "[%s] %s: %s\n", who, progname, msg);
  if (with_traceback && failure.traceback) fprintf(stderr, "%s\n", failure.traceback);
  fflush(stderr);
}

/* The report's messages on report_comm: a failing rank's message hash, then
 * (when it reports alone) a notice that its report is out. */
enum { TAG_HASH = 1, TAG_REPORTED = 2 };
#define LINGER_CAP_S 5.0

/* What a failing rank knows of the others' reports: request r of `hash_req`
 * completes when rank r's hash arrives (in hashes[r]), of `done_req` when
 * rank r says its lone report is out. Static: still reachable when the job
 * ends with requests pending, for leak checkers. */
static struct {
  uint64_t *hashes, *msgs; /* msgs: each rank's (hash, 1 if its failure followed a watchdog timeout) */
  MPI_Request *hash_req, *done_req, *sends;
  char *heard, *reported; /* per rank: its hash came, its lone report is out */
  char *tokens_in;        /* per rank: where its notice lands (pending receives must not share a buffer) */
  char token;
} rep;

/* Completes what has arrived; returns how many hashes newly came. */
static int poll_reports(int n, int me) {
  int news = 0;
  for (int r = 0; r < n; r++) {
    if (r == me) continue;
    int done = 0;
    if (!rep.heard[r] && MPI_Test(&rep.hash_req[r], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
      rep.heard[r] = 1;
      news++;
    }
    done = 0;
    if (!rep.reported[r] && MPI_Test(&rep.done_req[r], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done)
      rep.reported[r] = 1;
  }
  return news;
}

static int heard_all(int n, int me) {
  for (int r = 0; r < n; r++)
    if (r != me && !rep.heard[r]) return 0;
  return 1;
}

/* Posts the hash exchange; 0 when MPI or memory failed (the rank then reports alone at once). */
static int post_reports(int n, int me, uint64_t mine) {
  rep.hashes = calloc((size_t)n, sizeof *rep.hashes);
  rep.msgs = calloc((size_t)2 * (size_t)n, sizeof *rep.msgs);
  rep.hash_req = calloc((size_t)n, sizeof *rep.hash_req);
  rep.done_req = calloc((size_t)n, sizeof *rep.done_req);
  rep.sends = calloc((size_t)2 * (size_t)n, sizeof *rep.sends);
  rep.heard = calloc((size_t)n, 1);
  rep.reported = calloc((size_t)n, 1);
  rep.tokens_in = calloc((size_t)n, 1);
  if (!rep.hashes || !rep.msgs || !rep.hash_req || !rep.done_req || !rep.sends || !rep.heard || !rep.reported || !rep.tokens_in)
    return 0;
  rep.msgs[2 * me] = mine;
  rep.msgs[2 * me + 1] = (uint64_t)pg_comm_timed_out();
  rep.heard[me] = rep.reported[me] = 1;
  for (int r = 0; r < n; r++) {
    rep.hash_req[r] = rep.done_req[r] = rep.sends[r] = rep.sends[n + r] = MPI_REQUEST_NULL;
    if (r == me) continue;
    if (MPI_Irecv(&rep.msgs[2 * r], 2, MPI_UINT64_T, r, TAG_HASH, report_comm, &rep.hash_req[r]) != MPI_SUCCESS ||
        MPI_Irecv(&rep.tokens_in[r], 1, MPI_CHAR, r, TAG_REPORTED, report_comm, &rep.done_req[r]) != MPI_SUCCESS ||
        MPI_Isend(&rep.msgs[2 * me], 2, MPI_UINT64_T, r, TAG_HASH, report_comm, &rep.sends[r]) != MPI_SUCCESS)
      return 0;
  }
  return 1;
}

/* Tells every other rank that this one's report is out. */
static void notify_reported(int n, int me) {
  for (int r = 0; r < n; r++)
    if (r != me) MPI_Isend(&rep.token, 1, MPI_CHAR, r, TAG_REPORTED, report_comm, &rep.sends[n + r]);
}

/* Reports alone (unless `printed`), lingers (see the top of this section) and ends the job. A rank whose
 * failure followed a watchdog timeout prints at once; any other waits first for the reports of those it
 * has heard fail after a timeout, and until a grace period passes with no new failure, so that the cause is
 * printed after its consequences. */
static _Noreturn void report_alone(int n, int me, const char *who, const char *msg, int tb, int printed) {
  int consequence = (int)rep.msgs[2 * me + 1];
  if (printed) notify_reported(n, me);
  double grace = grace_seconds(), start = pg_wtime(), quiet_since = start;
  double cap = start + 3 * grace + LINGER_CAP_S;
  for (;;) {
    double now = pg_wtime();
    if (poll_reports(n, me)) quiet_since = now;
    int waiting = 0, waiting_timed_out = 0; /* ranks that failed but whose report is not out yet */
    for (int r = 0; r < n; r++)
      if (rep.heard[r] && !rep.reported[r]) {
        waiting++;
        waiting_timed_out += (int)rep.msgs[2 * r + 1];
      }
    int quiet = now - quiet_since >= grace;
    if (!printed && (consequence || (!waiting_timed_out && quiet) || now >= cap)) {
      print_report(who, msg, tb);
      notify_reported(n, me);
      printed = 1;
      continue;
    }
    if (printed && ((!waiting && (quiet || !consequence)) || now >= cap)) break;
    sleep_seconds(1e-3);
  }
  abort_job(1);
}

/* How a rank that ends normally leaves: it waits for every other rank to end
 * too (a non-blocking barrier on report_comm, polled) before it finalises MPI.
 * Open MPI 4.1's mpirun can hang for good when one rank aborts while another
 * is inside MPI_Finalize (seen on a loaded machine, the job never ending), so
 * no rank enters it before all have finished: one that hears of a failure
 * while it waits (a failing rank's hash, TAG_HASH) does not finalise, and
 * waits for that rank's abort to end it (exiting 1 by itself if none comes). */
static void finish_mpi(void) {
  MPI_Request req;
  if (report_comm != MPI_COMM_NULL && MPI_Ibarrier(report_comm, &req) == MPI_SUCCESS) {
    double nap = 1e-3; /* polls often at first (the ranks usually end together), then every 50 ms */
    for (;;) {
      int done = 0, failed = 0;
      if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) break;
      if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_HASH, report_comm, &failed, MPI_STATUS_IGNORE) == MPI_SUCCESS && failed) {
        fflush(stdout);
        fflush(stderr);
        sleep_seconds(3 * grace_seconds() + LINGER_CAP_S + 5); /* the failing rank's linger, and then some */
        _exit(1);
      }
      sleep_seconds(nap);
      if (nap < 0.05) nap *= 1.5;
    }
  }
  pg_mpi_finalize();
}

/* Reports the error on top of the stack (once per group of ranks that failed alike) and ends the job. */
static _Noreturn void report_and_abort(lua_State *L) {
  const char *msg = lua_tostring(L, -1);
  if (!msg) msg = "(no message)";
  int tb = failure.internal || debug_mode(), n = pg_mpi_world_size(), me = pg_mpi_world_rank();
  char who[256];
  snprintf(who, sizeof who, "rank %d", me);
  if (n == 1 || report_comm == MPI_COMM_NULL) {
    print_report(who, msg, tb);
    end_job(1);
  }
  /* one group: one message, with or without a traceback, after a watchdog timeout or not */
  uint64_t mine = fnv1a(msg, 0xcbf29ce484222325ull) ^ (uint64_t)tb ^ ((uint64_t)pg_comm_timed_out() << 1);
  if (!post_reports(n, me, mine)) {
    print_report(who, msg, tb);
    abort_job(1);
  }
  double end = pg_wtime() + grace_seconds();
  for (poll_reports(n, me); !heard_all(n, me) && pg_wtime() < end; poll_reports(n, me)) sleep_seconds(1e-3);
  if (!heard_all(n, me)) report_alone(n, me, who, msg, tb, 0); /* not every rank failed in time */
  /* Every rank failed. One that failed first may have given up waiting and reported alone already (its
   * notice is here): then so does this one. */
  for (int r = 0; r < n; r++)
    if (r != me && rep.reported[r]) report_alone(n, me, who, msg, tb, 0);
  /* The lowest rank of each group with one message reports it: first the groups whose failure followed a
   * watchdog timeout (ranks left waiting for one that failed), then, after a barrier, the others, so that the
   * cause is printed after its consequences: the last line is the one to read. Every report is out before any
   * rank ends the job, and one rank aborts it (one notice from mpirun). A barrier that does not complete
   * means another rank reported alone after all (its notice came late): say this one's message alone unless
   * it is out, and linger as that rank does. */
  for (int r = 0; r < n; r++) rep.hashes[r] = rep.msgs[2 * r];
  char list[200];
  int count = rank_list(rep.hashes, n, mine, list, sizeof list);
  int lowest = me == atoi(list), printed = 0;
  char group[256];
  snprintf(group, sizeof group, "%s %s", count > 1 ? "ranks" : "rank", list);
  for (int consequence = 1; consequence >= 0; consequence--) {
    if (lowest && (int)rep.msgs[2 * me + 1] == consequence) {
      print_report(group, msg, tb);
      printed = 1;
    }
    MPI_Request req;
    if (MPI_Ibarrier(report_comm, &req) != MPI_SUCCESS || !wait_request(&req, grace_seconds() + 1.0))
      report_alone(n, me, who, msg, tb, printed);
  }
  if (me != 0) sleep_seconds(10); /* rank 0's abort ends this process; if it does not, end it here */
  abort_job(1);
}

/* Lua's own wordings of the errors it raises (and of its libraries' argument
 * checks): a message carrying one is internal wherever it was raised or re-raised. */
static int lua_wording(const char *msg) {
  static const char *const words[] = {"attempt to ", "bad argument #", "stack overflow", "table index is ",
                                      "number has no integer representation", "'for' initial value", "'for' limit",
                                      "'for' step", "object length is not", "error in error handling", NULL};
  for (const char *const *w = words; *w; w++)
    if (strstr(msg, *w)) return 1;
  return 0;
}

/* Runs at the error, with its stack intact: records whether the error is
 * internal (see above) and the traceback; returns the message. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) msg = lua_tostring(L, -1);
    else msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    failure.internal = 1; /* not a message: nobody meant to report it */
  } else {
    lua_Debug ar; /* level 1 raised it: a C function (error, assert, a binding) raises on purpose, the VM does not */
    int by_c = lua_getstack(L, 1, &ar) && lua_getinfo(L, "S", &ar) && ar.what[0] == 'C';
    failure.internal = !by_c || lua_wording(msg);
  }
  luaL_traceback(L, L, NULL, 1);
  free(failure.traceback);
  failure.traceback = strdup(lua_tostring(L, -1));
  lua_pop(L, 1);
  lua_pushstring(L, msg);
  return 1;
}

static int docall(lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  int status = lua_pcall(L, narg, nres, base);
  lua_remove(L, base);
  return status;
}

/* A chunk that does not load (a syntax error, no such file) is the user's error: no traceback. */
static void load_failed(void) {
  failure.internal = 0;
  free(failure.traceback);
  failure.traceback = NULL;
}

static void run_or_abort(lua_State *L, int status) {
  if (status == LUA_OK) status = docall(L, 0, 0);
  else load_failed();
  if (status != LUA_OK) report_and_abort(L);
}

/* os.exit replacement: success finalises MPI; failure ends the whole job. */
static int os_exit(lua_State *L) {
  int code;
  if (lua_isboolean(L, 1)) code = lua_toboolean(L, 1) ? EXIT_SUCCESS : EXIT_FAILURE;
  else code = (int)luaL_optinteger(L, 1, EXIT_SUCCESS);
  if (lua_toboolean(L, 2)) lua_close(L);
  if (code != EXIT_SUCCESS) end_job(code);
  fflush(stdout);
  finish_mpi();
  exit(code);
}

/* ---- package.path: find lua/ next to the binary or under the prefix ---- */

static int has_init(const char *root) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/pipegoose/init.lua", root);
  return access(p, R_OK) == 0;
}

static void add_lua_path(lua_State *L) {
  char exe[PATH_MAX], root[PATH_MAX * 2] = "";
  const char *env = getenv("PIPEGOOSE_LUA_DIR");
  if (env && has_init(env)) snprintf(root, sizeof root, "%s", env);
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (!*root && n > 0) {
    exe[n] = 0;
    char *dir = dirname(exe);
    /* in the source tree (./pglua, build/pglua) or installed (PREFIX/bin/pglua) */
    const char *cands[] = {"%s/lua", "%s/../lua", "%s/../share/lua/5.4"};
    for (int i = 0; i < 3 && !*root; i++) {
      char c[PATH_MAX * 2];
      snprintf(c, sizeof c, cands[i], dir);
      if (has_init(c)) snprintf(root, sizeof root, "%s", c);
    }
  }
  if (!*root) return;
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "path");
  lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", root, root, lua_tostring(L, -1));
  lua_setfield(L, -3, "path");
  lua_pop(L, 2);
}

static void preload_core(lua_State *L) {
  luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
  lua_pushcfunction(L, luaopen_pipegoose_core);
  lua_setfield(L, -2, "pipegoose.core");
  lua_pop(L, 1);
  lua_getglobal(L, "os");
  lua_pushcfunction(L, os_exit);
  lua_setfield(L, -2, "exit");
  lua_pop(L, 1);
}

/* ---- the command line ---- */

static void create_arg_table(lua_State *L, char **argv, int argc, int script) {
  lua_createtable(L, argc - script, script + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");
}

static int push_script_args(lua_State *L) {
  if (lua_getglobal(L, "arg") != LUA_TTABLE) luaL_error(L, "'arg' is not a table");
  int n = (int)luaL_len(L, -1);
  luaL_checkstack(L, n + 3, "too many arguments to script");
  for (int i = 1; i <= n; i++) lua_rawgeti(L, -i, i);
  lua_remove(L, -n - 1);
  return n;
}

static void run_script(lua_State *L, const char *fname) {
  if (fname && !strcmp(fname, "-")) fname = NULL; /* stdin */
  int status = luaL_loadfile(L, fname);
  if (status == LUA_OK) {
    int n = push_script_args(L);
    status = docall(L, n, LUA_MULTRET);
  } else {
    load_failed();
  }
  if (status != LUA_OK) report_and_abort(L);
}

static void require_lib(lua_State *L, const char *spec) {
  const char *eq = strchr(spec, '=');
  char global[256];
  const char *mod = spec;
  if (eq) {
    snprintf(global, sizeof global, "%.*s", (int)(eq - spec), spec);
    mod = eq + 1;
  } else {
    snprintf(global, sizeof global, "%s", spec);
    char *dash = strchr(global, '-');
    if (dash) *dash = 0;
  }
  lua_getglobal(L, "require");
  lua_pushstring(L, mod);
  if (docall(L, 1, 1) != LUA_OK) report_and_abort(L);
  lua_setglobal(L, global);
}

static void repl(lua_State *L) {
  char line[4096];
  int tty = isatty(0);
  for (;;) {
    if (tty) {
      fputs("> ", stdout);
      fflush(stdout);
    }
    if (!fgets(line, sizeof line, stdin)) break;
    /* Try as an expression first, then as a statement. */
    const char *ret = lua_pushfstring(L, "return %s", line);
    int status = luaL_loadbuffer(L, ret, strlen(ret), "=stdin");
    lua_remove(L, -2);
    if (status != LUA_OK) {
      lua_pop(L, 1);
      status = luaL_loadbuffer(L, line, strlen(line), "=stdin");
    }
    int base = lua_gettop(L);
    if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
    if (status != LUA_OK) {
      fprintf(stderr, "%s\n", lua_tostring(L, -1));
      if ((failure.internal || debug_mode()) && failure.traceback) fprintf(stderr, "%s\n", failure.traceback);
      load_failed(); /* the next line's syntax error has no traceback */
      lua_settop(L, base - 1);
      continue;
    }
    int n = lua_gettop(L) - base + 1;
    if (n > 0) {
      lua_getglobal(L, "print");
      lua_insert(L, -n - 1);
      if (docall(L, n, 0) != LUA_OK) {
        fprintf(stderr, "%s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
      }
    }
    lua_settop(L, base - 1);
  }
  if (tty) fputs("\n", stdout);
}

static void print_version(void) {
  printf("pipegoose %s on %s  (MPI world of %d)\n", PG_VERSION, LUA_RELEASE, pg_mpi_world_size());
  fflush(stdout);
}

/* OpenMP threads waiting at the end of a parallel region spin by default
 * (libgomp: ~300k iterations) before they sleep. On a machine shared with
 * other jobs a spinning thread holds a core that the thread it waits for
 * needs: the default model's training step ran 1.95x slower than with
 * sleeping threads (2 cores, 2 other busy processes; scripts/bench.lua's
 * step, median of 5 paired runs), while sleeping costs one futex wake per
 * region (a few microseconds, a few hundred regions per step). libgomp reads
 * the policy when it loads, before main, so pglua sets it and executes itself
 * again, once. A policy the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT) is
 * kept; PG_DEFAULT_WAIT_POLICY=1 tells child processes that pglua chose it. */
/* The same restart sets OPENBLAS_CORETYPE when OpenBLAS fell back to its
 * generic kernels on a CPU that can do better (pg_machine.h);
 * PG_DEFAULT_BLAS_CORE=<core> says pglua chose it (a child whose
 * OPENBLAS_CORETYPE differs was given another by its caller). */
static void restart_with_defaults(char **argv) {
  int policy = !getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT");
  const char *core = getenv("OPENBLAS_CORETYPE") ? NULL : pg_machine_blas_core();
  if (!policy && !core) return;
  if (policy && (setenv("OMP_WAIT_POLICY", "passive", 1) || setenv("PG_DEFAULT_WAIT_POLICY", "1", 1))) return;
  if (core && (setenv("OPENBLAS_CORETYPE", core, 1) || setenv("PG_DEFAULT_BLAS_CORE", core, 1))) return;
  execv("/proc/self/exe", argv);
  /* no /proc or no exec: run on with the libraries' defaults */
  if (policy) {
    unsetenv("OMP_WAIT_POLICY");
    unsetenv("PG_DEFAULT_WAIT_POLICY");
  }
  if (core) {
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv("PG_DEFAULT_BLAS_CORE");
  }
}

int main(int argc, char **argv) {
  restart_with_defaults(argv);
  if (argv[0] && argv[0][0]) progname = argv[0];
  if (pg_mpi_init(&argc, &argv)) {
    fprintf(stderr, "%s: %s\n", progname, "could not initialise MPI");
    return 1;
  }
  /* Every environment variable pipegoose reads, checked before anything uses one (pg_env.h). The ranks
   * agree, so that a value bad on some ranks only still ends all of them, and the lowest bad rank says
   * it, once. */
  {
    int me = pg_mpi_world_rank(), first_bad = pg_env_check_all() ? me : INT_MAX;
    if (pg_mpi_world_size() > 1 &&
        MPI_Allreduce(MPI_IN_PLACE, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS)
      first_bad = me;
    if (first_bad != INT_MAX) {
      if (first_bad == me) fprintf(stderr, "%s: %s\n", progname, pg_error());
      pg_mpi_finalize();
      return 1;
    }
  }
  if (pg_setup_threads() < 0) {
    fprintf(stderr, "%s: %s\n", progname, pg_error());
    pg_mpi_finalize();
    return 1;
  }
  /* collective, so here while every rank runs the same code: the communicator error reports agree over */
  if (pg_mpi_world_size() > 1 && MPI_Comm_dup(MPI_COMM_WORLD, &report_comm) != MPI_SUCCESS) report_comm = MPI_COMM_NULL;

  lua_State *L = luaL_newstate();
  if (!L) {
    fprintf(stderr, "%s: cannot create the Lua state: not enough memory\n", progname);
    end_job(1);
  }
  /* First pass over the options: find the script and the flags that change set-up. */
  int script = 0, want_version = 0, interactive = 0, ignore_env = 0, has_e = 0, stdin_script = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-') {
      script = i;
      break;
    }
    if (!strcmp(a, "--")) {
      if (i + 1 < argc) script = i + 1;
      break;
    }
    if (!strcmp(a, "-")) {
      script = i;
      stdin_script = 1;
      break;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      lua_close(L);
      finish_mpi();
      return 0;
    }
    if (!strcmp(a, "-v")) want_version = 1;
    else if (!strcmp(a, "-i")) interactive = want_version = 1;
    else if (!strcmp(a, "-E")) ignore_env = 1;
    else if (!strcmp(a, "-W")) {
    } else if (!strncmp(a, "-e", 2) || !strncmp(a, "-l", 2)) {
      has_e |= a[1] == 'e';
      if (!a[2] && ++i >= argc) {
        fprintf(stderr, "%s: '%s' needs argument\n", progname, a);
        usage(stderr);
        lua_close(L);
        end_job(1);
      }
    } else {
      fprintf(stderr, "%s: unrecognized option '%s'\n", progname, a);
      usage(stderr);
      lua_close(L);
      end_job(1);
    }
  }
  if (want_version) print_version();

  luaL_openlibs(L);
  preload_core(L);
  add_lua_path(L);
  create_arg_table(L, argv, argc, script); /* no script: arg[0] is the interpreter, as lua does */
  if (!ignore_env) {
    const char *init = getenv("LUA_INIT_5_4");
    if (!init) init = getenv("LUA_INIT");
    if (init) {
      int st = init[0] == '@' ? luaL_loadfile(L, init + 1) : luaL_loadbuffer(L, init, strlen(init), "=LUA_INIT");
      run_or_abort(L, st);
    }
  }
  /* Second pass: run -e and -l in order. */
  int last = script ? script : argc;
  for (int i = 1; i < last; i++) {
    const char *a = argv[i];
    if (!strncmp(a, "-e", 2)) {
      const char *code = a[2] ? a + 2 : argv[++i];
      run_or_abort(L, luaL_loadbuffer(L, code, strlen(code), "=(command line)"));
    } else if (!strncmp(a, "-l", 2)) {
      require_lib(L, a[2] ? a + 2 : argv[++i]);
    } else if (!strcmp(a, "-W")) {
      lua_warning(L, "@on", 0);
    }
  }
  if (script) run_script(L, stdin_script ? "-" : argv[script]);
  if (interactive) repl(L);
  else if (!script && !has_e && !want_version) {
    if (isatty(0)) {
      print_version();
      repl(L);
    } else {
      run_script(L, "-");
    }
  }
  lua_close(L);
  finish_mpi();
  return 0;
}
