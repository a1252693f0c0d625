#define _POSIX_C_SOURCE 200809L
#include "pg_env.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pg_error.h"

enum kind { NUMBER = 'd', INTEGER = 'l', BOOLEAN = 'b', CHOICE = 'c', THREADS = 't', PATH = 'p' };

typedef struct {
  const char *name;
  enum kind kind;
  double min, max, def; /* NUMBER, INTEGER (integral values), BOOLEAN (0/1) */
  const char *const *choices; /* CHOICE: NULL-terminated, the first is the default */
  const char *expects; /* how the error says what is wanted */
} env_var;

static const char *const BF16_GEMM[] = {"auto", "onednn", "fallback", NULL};
static const char *const PROGRESS[] = {"auto", "tty", "plain", NULL};

/* Every variable pipegoose parses. OMP_WAIT_POLICY, GOMP_SPINCOUNT and
 * OPENBLAS_CORETYPE are only tested for being set (their libraries parse
 * them); PIPEGOOSE_LUA_DIR is a path. */
static const env_var VARS[] = {
    {"PG_ABORT_GRACE", NUMBER, 0, 3600, 1, NULL, "a number of seconds from 0 to 3600"},
    {"PG_COLLECTIVE_TIMEOUT", NUMBER, 0, 1e9, 600, NULL, "a number of seconds (0: no limit)"},
    {"PG_DEBUG", BOOLEAN, 0, 1, 0, NULL, "a boolean (1/0, true/false, yes/no, on/off)"},
    {"PG_SHM", BOOLEAN, 0, 1, 1, NULL, "a boolean (1/0, true/false, yes/no, on/off)"},
    {"PG_BF16_GEMM", CHOICE, 0, 0, 0, BF16_GEMM, "one of auto, onednn, fallback"},
    {"PG_CUBLASLT", BOOLEAN, 0, 1, 1, NULL, "a boolean (1/0, true/false, yes/no, on/off)"},
    {"PG_FLASH_BF16", BOOLEAN, 0, 1, 1, NULL, "a boolean (1/0, true/false, yes/no, on/off)"},
    {"PG_PROGRESS", CHOICE, 0, 0, 0, PROGRESS, "one of auto, tty, plain"},
    {"PG_HOST_MAP_FILE", PATH, 0, 0, 0, NULL, "a file name (scripts/mpirun.sh sets it)"},
    {"PG_RANKS_PER_NODE", INTEGER, 1, 1 << 20, 0, NULL, "a positive integer (ranks per emulated node)"},
    {"OMP_NUM_THREADS", THREADS, 0, 1 << 16, 0, NULL, "a positive integer (or OpenMP's comma list of them)"},
};
enum { NVARS = sizeof VARS / sizeof VARS[0] };

static const env_var *find(const char *name, enum kind k1, enum kind k2) {
  for (int i = 0; i < NVARS; i++)
    if (!strcmp(VARS[i].name, name)) {
      if (VARS[i].kind != k1 && VARS[i].kind != k2) {
        pg_fail("%s is not read as that type (pg_env.c's table)", name);
        return NULL;
      }
      return &VARS[i];
    }
  pg_fail("%s is not an environment variable pipegoose reads (pg_env.c's table)", name);
  return NULL;
}

static int bad(const env_var *v, const char *s) {
  return pg_fail("%s: expected %s, got '%.200s'", v->name, v->expects, s);
}

static const char *value(const env_var *v) {
  const char *s = getenv(v->name);
  return s && *s ? s : NULL;
}

/* A whole decimal integer of [min, max] (no sign games, no trailing text). */
static int parse_long(const char *s, double min, double max, long *out) {
  char *end = NULL;
  errno = 0;
  long n = strtol(s, &end, 10);
  if (end == s || *end || errno || (double)n < min || (double)n > max) return -1;
  *out = n;
  return 0;
}

static int get_double(const env_var *v, double *out) {
  const char *s = value(v);
  *out = v->def;
  if (!s) return PG_OK;
  /* decimal only: strtod also takes leading blanks, hex ("0x10" = 16) and "inf" */
  if (strspn(s, "0123456789.eE+-") != strlen(s)) return bad(v, s);
  char *end = NULL;
  errno = 0;
  double x = strtod(s, &end);
  if (end == s || *end || errno || !isfinite(x) || x < v->min || x > v->max) return bad(v, s);
  *out = x;
  return PG_OK;
}

static int get_long(const env_var *v, long *out) {
  const char *s = value(v);
  *out = (long)v->def;
  if (!s) return PG_OK;
  if (v->kind == THREADS) {
    /* "8" or "8,4": each a positive integer; this level's is the first */
    long first = 0, n;
    const char *p = s;
    for (int k = 0;; k++) {
      char part[32];
      size_t len = strcspn(p, ",");
      if (len == 0 || len >= sizeof part) return bad(v, s);
      memcpy(part, p, len);
      part[len] = 0;
      if (parse_long(part, 1, v->max, &n)) return bad(v, s);
      if (k == 0) first = n;
      if (!p[len]) break;
      p += len + 1;
    }
    *out = first;
    return PG_OK;
  }
  long n;
  if (parse_long(s, v->min, v->max, &n)) return bad(v, s);
  *out = n;
  return PG_OK;
}

static int get_bool(const env_var *v, int *out) {
  static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
  const char *s = value(v);
  *out = v->def != 0;
  if (!s) return PG_OK;
  for (int i = 0; i < 4; i++) {
    if (!strcmp(s, yes[i])) return *out = 1, PG_OK;
    if (!strcmp(s, no[i])) return *out = 0, PG_OK;
  }
  return bad(v, s);
}

static int get_choice(const env_var *v, const char **out) {
  const char *s = value(v);
  *out = v->choices[0];
  if (!s) return PG_OK;
  for (int i = 0; v->choices[i]; i++)
    if (!strcmp(s, v->choices[i])) return *out = v->choices[i], PG_OK;
  return bad(v, s);
}

/* Any file name; a newline would break the one-line-per-rank files written to it. */
static int get_path(const env_var *v, const char **out) {
  const char *s = value(v);
  *out = NULL;
  if (!s) return PG_OK;
  if (strchr(s, '\n')) return bad(v, s);
  return *out = s, PG_OK;
}

int pg_env_path(const char *name, const char **out) {
  const env_var *v = find(name, PATH, PATH);
  return v ? get_path(v, out) : PG_ERR;
}

int pg_env_double(const char *name, double *out) {
  const env_var *v = find(name, NUMBER, NUMBER);
  return v ? get_double(v, out) : PG_ERR;
}

int pg_env_long(const char *name, long *out) {
  const env_var *v = find(name, INTEGER, THREADS);
  return v ? get_long(v, out) : PG_ERR;
}

int pg_env_bool(const char *name, int *out) {
  const env_var *v = find(name, BOOLEAN, BOOLEAN);
  return v ? get_bool(v, out) : PG_ERR;
}

int pg_env_choice(const char *name, const char **out) {
  const env_var *v = find(name, CHOICE, CHOICE);
  return v ? get_choice(v, out) : PG_ERR;
}

int pg_env_check_all(void) {
  for (int i = 0; i < NVARS; i++) {
    const env_var *v = &VARS[i];
    double d;
    long l;
    int b;
    const char *c;
    int rc = v->kind == NUMBER    ? get_double(v, &d)
             : v->kind == BOOLEAN ? get_bool(v, &b)
             : v->kind == CHOICE  ? get_choice(v, &c)
             : v->kind == PATH    ? get_path(v, &c)
                                  : get_long(v, &l);
    if (rc) return PG_ERR;
  }
  return PG_OK;
}

const char *pg_env_name(int i, char *type) {
  if (i < 0 || i >= NVARS) return NULL;
  *type = VARS[i].kind == THREADS ? 'l' : (char)VARS[i].kind;
  return VARS[i].name;
}
