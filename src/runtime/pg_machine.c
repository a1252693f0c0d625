#include "pg_machine.h"

#include <cblas.h>
#include <stdio.h>
#include <string.h>

/* OpenBLAS's cores that mean "it did not recognise this CPU": its generic x86-64 kernels. */
static int generic_core(const char *core) {
  static const char *const generic[] = {"Prescott", "Core2", "Katmai", "Coppermine", "Northwood", "Atom",
                                        "Nehalem", "Dunnington", "Penryn", NULL};
  for (int i = 0; generic[i]; i++)
    if (!strcmp(core, generic[i])) return 1;
  return 0;
}

const char *pg_machine_blas_running(void) {
  const char *c = openblas_get_corename();
  return c ? c : "unknown";
}

const char *pg_machine_blas_core(void) {
  if (!generic_core(pg_machine_blas_running())) return NULL;
  __builtin_cpu_init();
  /* The newest kernels the CPU's features allow, among the cores of
   * OpenBLAS's DYNAMIC_ARCH builds (Debian's includes these). */
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    if (__builtin_cpu_supports("avx512bf16")) return "Cooperlake";
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
  return NULL;
}

void pg_machine_features(char *buf, size_t n) {
  __builtin_cpu_init();
  /* __builtin_cpu_supports takes a string literal: one row per feature */
  const struct {
    const char *name;
    int has;
  } f[] = {{"avx", __builtin_cpu_supports("avx")},           {"avx2", __builtin_cpu_supports("avx2")},
           {"fma", __builtin_cpu_supports("fma")},           {"avx512f", __builtin_cpu_supports("avx512f")},
           {"avx512bw", __builtin_cpu_supports("avx512bw")}, {"avx512vl", __builtin_cpu_supports("avx512vl")},
           {"avx512bf16", __builtin_cpu_supports("avx512bf16")}};
  size_t len = 0;
  if (n) buf[0] = '\0';
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].has && len < n) len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? " " : "", f[i].name);
}
