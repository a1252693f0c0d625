/* pglua: a lua-compatible command line with MPI and the pipegoose runtime.
 *
 *   pglua [options] [script [args]]     (options as lua's: -e -l -i -v -E -W -- -)
 *
 * MPI starts before the script and finalises at exit. Any uncaught error
 * prints "[rank N] message" and a traceback on stderr, then ends the whole
 * job: MPI_Abort under mpirun (other ranks may be blocked in a collective),
 * exit status 1 alone. */
#define _GNU_SOURCE
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include "pg_machine.h"
#include "pg_context.h"

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

/* ---- ending the job on error ---- */

static void sleep_seconds(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

/* Ends the job with `code`. Alone: finalise and exit. Under mpirun: a short
 * grace period lets other ranks that hit the same error print it too, then
 * MPI_Abort takes every rank down (some may be blocked in a collective). */
static _Noreturn void end_job(int code) {
  fflush(stdout);
  fflush(stderr);
  if (pg_mpi_world_size() > 1) {
    const char *g = getenv("PG_ABORT_GRACE");
    sleep_seconds(g ? atof(g) : 0.5);
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  pg_mpi_finalize();
  exit(code);
}

static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static void report_and_abort(lua_State *L) {
  const char *msg = lua_tostring(L, -1);
  fprintf(stderr, "[rank %d] %s: %s\n", pg_mpi_world_rank(), progname, msg ? msg : "(no message)");
  end_job(1);
}

static int docall(lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  int status = lua_pcall(L, narg, nres, base);
  lua_remove(L, base);
  return status;
}

static void run_or_abort(lua_State *L, int status) {
  if (status == LUA_OK) status = docall(L, 0, 0);
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
  pg_mpi_finalize();
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
  pg_setup_threads();

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
      pg_mpi_finalize();
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
  pg_mpi_finalize();
  return 0;
}
