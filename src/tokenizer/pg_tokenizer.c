/* pg_tokenizer: BPE tokenizers as Hugging Face `tokenizers` runs them
 * (pg_tokenizer.h has the pipeline; this file follows it in order). */
#define _GNU_SOURCE /* memmem */
#include "pg_tokenizer.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "pg_error.h"

/* GPT-2's pre-tokenizer pattern, which tokenizers' ByteLevel uses when use_regex is set. */
static const char GPT2_PATTERN[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* Pre-tokens up to this many bytes are cached (longer ones are rare and would crowd the cache). */
#define CACHE_KEY_MAX 64
#define CACHE_SLOTS (1u << 15)
#define CACHE_ENTRIES (CACHE_SLOTS / 2)

/* ---- growable buffers (every size checked: a text of a few GB must fail cleanly) ---- */

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return PG_OK;
  size_t c = *cap ? *cap : 16;
  while (c < need) {
    if (c > SIZE_MAX / 2) return pg_fail("tokenizer: out of memory (%zu elements)", need);
    c *= 2;
  }
  if (c > SIZE_MAX / elem) return pg_fail("tokenizer: out of memory (%zu elements)", need);
  void *q = realloc(*p, c * elem);
  if (!q) return pg_fail("tokenizer: out of memory (%zu bytes)", c * elem);
  *p = q;
  *cap = c;
  return PG_OK;
}
#define GROW(ptr, cap, need) grow((void **)&(ptr), &(cap), (need), sizeof *(ptr))

typedef struct {
  char *p;
  size_t n, cap;
} buf_t;

static int buf_put(buf_t *b, const void *s, size_t n) {
  if (n > SIZE_MAX - b->n - 1) return pg_fail("tokenizer: out of memory");
  if (GROW(b->p, b->cap, b->n + n + 1)) return PG_ERR;
  if (n) memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
  return PG_OK;
}

uint64_t pg_tok_hash_bytes(const void *p, size_t n) {
  const unsigned char *s = p;
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
    s += 8;
    n -= 8;
  }
  uint64_t w = 0;
  memcpy(&w, s, n);
  h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 29);
}

/* ---- string -> id map (open addressing; the strings live in one arena) ---- */

typedef struct {
  uint64_t h;
  size_t off;
  uint32_t len;
  int32_t val;
} sm_entry;

typedef struct {
  sm_entry *e;
  size_t n, ecap;
  int32_t *slot; /* entry index, -1 empty */
  size_t nslot;  /* a power of two, at least twice n */
  buf_t arena;
} strmap;

static int32_t sm_get(const strmap *m, const char *s, size_t n) {
  if (!m->nslot || n > UINT32_MAX) return -1;
  uint64_t h = pg_tok_hash_bytes(s, n);
  for (size_t i = h & (m->nslot - 1);; i = (i + 1) & (m->nslot - 1)) {
    int32_t k = m->slot[i];
    if (k < 0) return -1;
    const sm_entry *e = &m->e[k];
    if (e->h == h && e->len == n && !memcmp(m->arena.p + e->off, s, n)) return e->val;
  }
}

static int sm_rehash(strmap *m, size_t nslot) {
  int32_t *s = malloc(nslot * sizeof *s);
  if (!s) return pg_fail("tokenizer: out of memory");
  memset(s, 0xff, nslot * sizeof *s);
  for (size_t k = 0; k < m->n; k++) {
    size_t i = m->e[k].h & (nslot - 1);
    while (s[i] >= 0) i = (i + 1) & (nslot - 1);
    s[i] = (int32_t)k;
  }
  free(m->slot);
  m->slot = s;
  m->nslot = nslot;
  return PG_OK;
}

/* Sets s -> val (replacing an earlier value). *old gets the earlier value or -1. */
static int sm_put(strmap *m, const char *s, size_t n, int32_t val, int32_t *old) {
  if (n > UINT32_MAX || m->n >= INT32_MAX - 1) return pg_fail("tokenizer: a token of %zu bytes, or too many tokens", n);
  if ((m->n + 1) * 2 > m->nslot && sm_rehash(m, m->nslot ? m->nslot * 2 : 64)) return PG_ERR;
  uint64_t h = pg_tok_hash_bytes(s, n);
  size_t i = h & (m->nslot - 1);
  for (;; i = (i + 1) & (m->nslot - 1)) {
    int32_t k = m->slot[i];
    if (k < 0) break;
    sm_entry *e = &m->e[k];
    if (e->h == h && e->len == n && !memcmp(m->arena.p + e->off, s, n)) {
      *old = e->val;
      e->val = val;
      return PG_OK;
    }
  }
  *old = -1;
  if (GROW(m->e, m->ecap, m->n + 1)) return PG_ERR;
  size_t off = m->arena.n;
  if (buf_put(&m->arena, s, n)) return PG_ERR;
  m->e[m->n] = (sm_entry){h, off, (uint32_t)n, val};
  m->slot[i] = (int32_t)m->n++;
  return PG_OK;
}

static void sm_free(strmap *m) {
  free(m->e);
  free(m->slot);
  free(m->arena.p);
}

/* ---- (left id, right id) -> (rank, merged id) ---- */

typedef struct {
  uint64_t *key; /* UINT64_MAX: empty (ids are below 2^24) */
  int32_t *rank, *id;
  size_t n, nslot;
} mergemap;

static inline uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static int mm_find(const mergemap *m, uint64_t key, size_t *at) {
  if (!m->nslot) return 0;
  uint64_t h = key * 0x9E3779B97F4A7C15ull;
  for (size_t i = (h >> 17) & (m->nslot - 1);; i = (i + 1) & (m->nslot - 1)) {
    if (m->key[i] == UINT64_MAX) {
      *at = i;
      return 0;
    }
    if (m->key[i] == key) {
      *at = i;
      return 1;
    }
  }
}

static int mm_put(mergemap *m, uint64_t key, int32_t rank, int32_t id) {
  if ((m->n + 1) * 2 > m->nslot) {
    size_t ns = m->nslot ? m->nslot * 2 : 1024;
    mergemap g = {malloc(ns * sizeof(uint64_t)), malloc(ns * sizeof(int32_t)), malloc(ns * sizeof(int32_t)), 0, ns};
    if (!g.key || !g.rank || !g.id) {
      free(g.key), free(g.rank), free(g.id);
      return pg_fail("tokenizer: out of memory for %zu merges", m->n);
    }
    memset(g.key, 0xff, ns * sizeof(uint64_t));
    for (size_t i = 0; i < m->nslot; i++) {
      if (m->key[i] == UINT64_MAX) continue;
      size_t at = 0;
      mm_find(&g, m->key[i], &at);
      g.key[at] = m->key[i], g.rank[at] = m->rank[i], g.id[at] = m->id[i];
      g.n++;
    }
    free(m->key), free(m->rank), free(m->id);
    *m = g;
  }
  size_t at = 0;
  if (!mm_find(m, key, &at)) m->n++;
  m->key[at] = key, m->rank[at] = rank, m->id[at] = id;
  return PG_OK;
}

/* ---- UTF-8 ---- */

/* The bytes at s (n > 0): a valid character (*valid = 1, its length) or the
 * maximal ill-formed subsequence (*valid = 0, its length >= 1), as Unicode's
 * "U+FFFD substitution of maximal subparts" (Rust's from_utf8_lossy) counts. */
static size_t u8_scan(const unsigned char *s, size_t n, int *valid) {
  unsigned c = s[0], lo = 0x80, hi = 0xBF;
  size_t need;
  *valid = 0;
  if (c < 0x80) {
    *valid = 1;
    return 1;
  }
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) need = 2, lo = 0xA0;
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
  else if (c == 0xED) need = 2, hi = 0x9F; /* no surrogates */
  else if (c == 0xF0) need = 3, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else if (c == 0xF4) need = 3, hi = 0x8F; /* nothing above U+10FFFF */
  else return 1;
  for (size_t i = 1; i <= need; i++) {
    if (i >= n || s[i] < lo || s[i] > hi) return i;
    lo = 0x80, hi = 0xBF;
  }
  *valid = 1;
  return need + 1;
}

/* The code point of a valid character of len bytes. */
static int32_t u8_cp(const unsigned char *s, size_t len) {
  switch (len) {
  case 1: return s[0];
  case 2: return ((s[0] & 0x1F) << 6) | (s[1] & 0x3F);
  case 3: return ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F);
  default: return ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F);
  }
}

static size_t u8_put(char *o, int32_t cp) {
  if (cp < 0x80) return o[0] = (char)cp, 1;
  if (cp < 0x800) return o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
  if (cp < 0x10000)
    return o[0] = (char)(0xE0 | (cp >> 12)), o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[2] = (char)(0x80 | (cp & 0x3F)), 3;
  o[0] = (char)(0xF0 | (cp >> 18)), o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* Rust's char::is_whitespace (Unicode White_Space): lstrip/rstrip strip these. */
static int is_ws(int32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* A Unicode regex \w character (UTS #18: Alphabetic, marks, decimal digits,
 * connector punctuation, joiners): single_word's word boundary, as in
 * tokenizers. Alphabetic is approximated by the letters, letter numbers and
 * the symbols that carry Other_Alphabetic (circled and squared Latin
 * letters); other numbers (², ①) are not word characters. */
static int is_word(int32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
      (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189))
    return 1;
  utf8proc_category_t k = utf8proc_category(c);
  return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_ND) || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_PC;
}

/* ---- the tokenizer ---- */

typedef struct {
  pg_tok_step s; /* pattern and content point into owned copies */
  pcre2_code *re;
} step_t;

typedef struct {
  char *s, *norm; /* content, and (normalized tokens) its normalized form, which is what matches */
  size_t n, norm_n;
  int32_t id;
  unsigned flags;
} added_t;

struct pg_tokenizer {
  pg_tok_model model;
  char *unk;
  int32_t unk_id;
  int32_t byte_ids[256]; /* "<0xXX>" tokens for byte_fallback, -1 if absent */
  strmap vocab;
  mergemap merges;
  int32_t nmerges, max_vocab_id;
  added_t *added;
  size_t nadded, added_cap;
  step_t *steps[3];
  size_t nsteps[3], steps_cap[3];
  int32_t *tmpl;
  size_t ntmpl;
  int has_tmpl, finished, has_raw_added, has_norm_added;
  int32_t size;
  const char **id_tok; /* [size] the token's bytes (NULL: no token) */
  uint32_t *id_len;
  uint8_t *special;
  uint8_t first_raw[256], first_norm[256]; /* a byte that starts some added token */
  pcre2_code *gpt2_re, *digits_re;
  char byte_char[256][3]; /* byte -> its byte-level character's UTF-8 */
  uint8_t byte_char_len[256];
  int16_t char_byte[324]; /* byte-level code point -> byte, -1 */
};

static void step_free(step_t *s) {
  free((char *)s->s.pattern);
  free((char *)s->s.content);
  pcre2_code_free(s->re);
}

void pg_tokenizer_free(pg_tokenizer *t) {
  if (!t) return;
  free(t->unk);
  sm_free(&t->vocab);
  free(t->merges.key), free(t->merges.rank), free(t->merges.id);
  for (size_t i = 0; i < t->nadded; i++) free(t->added[i].s), free(t->added[i].norm);
  free(t->added);
  for (int k = 0; k < 3; k++) {
    for (size_t i = 0; i < t->nsteps[k]; i++) step_free(&t->steps[k][i]);
    free(t->steps[k]);
  }
  free(t->tmpl);
  free(t->id_tok), free(t->id_len), free(t->special);
  pcre2_code_free(t->gpt2_re);
  pcre2_code_free(t->digits_re);
  free(t);
}

static char *dup_bytes(const char *s, size_t n) {
  char *p = malloc(n + 1);
  if (!p) return pg_fail_null("tokenizer: out of memory");
  if (n) memcpy(p, s, n);
  p[n] = 0;
  return p;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
 * the other 68 bytes take the code points 256.. in byte order. */
static void init_byte_level(pg_tokenizer *t) {
  int next = 256;
  for (int i = 0; i < 324; i++) t->char_byte[i] = -1;
  for (int b = 0; b < 256; b++) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int cp = printable ? b : next++;
    t->char_byte[cp] = (int16_t)b;
    t->byte_char_len[b] = (uint8_t)u8_put(t->byte_char[b], cp);
  }
}

pg_tokenizer *pg_tokenizer_new(const pg_tok_model *model) {
  pg_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return pg_fail_null("tokenizer: out of memory");
  t->model = *model;
  t->unk_id = -1;
  t->max_vocab_id = -1;
  if (model->unk_token) {
    if (!(t->unk = dup_bytes(model->unk_token, model->unk_len))) return pg_tokenizer_free(t), NULL;
    t->model.unk_token = t->unk;
  }
  init_byte_level(t);
  return t;
}

static int check_id(int32_t id, const char *what, const char *s, size_t n) {
  if (id < 0 || id >= PG_TOK_MAX_ID)
    return pg_fail("%s '%.*s' has id %ld, outside [0, %ld)", what, (int)(n > 80 ? 80 : n), s, (long)id, (long)PG_TOK_MAX_ID);
  return PG_OK;
}

int pg_tokenizer_add_token(pg_tokenizer *t, const char *s, size_t n, int32_t id) {
  if (check_id(id, "vocab token", s, n)) return PG_ERR;
  int32_t old;
  if (sm_put(&t->vocab, s, n, id, &old)) return PG_ERR;
  if (id > t->max_vocab_id) t->max_vocab_id = id;
  return PG_OK;
}

int pg_tokenizer_add_merge(pg_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen) {
  int32_t ia = sm_get(&t->vocab, a, alen), ib = sm_get(&t->vocab, b, blen);
  const char *missing = ia < 0 ? a : ib < 0 ? b : NULL;
  size_t mlen = ia < 0 ? alen : blen;
  if (missing)
    return pg_fail("merge %ld ('%.*s' '%.*s') names '%.*s', which is not in the vocabulary", (long)t->nmerges, (int)alen,
                   a, (int)blen, b, (int)mlen, missing);
  char stackbuf[256], *ab = alen + blen <= sizeof stackbuf ? stackbuf : malloc(alen + blen);
  if (!ab) return pg_fail("tokenizer: out of memory");
  memcpy(ab, a, alen);
  memcpy(ab + alen, b, blen);
  int32_t id = sm_get(&t->vocab, ab, alen + blen);
  if (ab != stackbuf) free(ab);
  if (id < 0)
    return pg_fail("merge %ld ('%.*s' '%.*s'): the merged token '%.*s%.*s' is not in the vocabulary", (long)t->nmerges,
                   (int)alen, a, (int)blen, b, (int)alen, a, (int)blen, b);
  if (t->nmerges == INT32_MAX) return pg_fail("tokenizer: too many merges");
  return mm_put(&t->merges, pair_key(ia, ib), t->nmerges++, id);
}

int pg_tokenizer_add_added(pg_tokenizer *t, const char *s, size_t n, int32_t id, unsigned flags) {
  if (check_id(id, "added token", s, n)) return PG_ERR;
  if (n == 0) return pg_fail("added token %ld is empty", (long)id);
  if (GROW(t->added, t->added_cap, t->nadded + 1)) return PG_ERR;
  added_t *a = &t->added[t->nadded];
  memset(a, 0, sizeof *a);
  if (!(a->s = dup_bytes(s, n))) return PG_ERR;
  a->n = n, a->id = id, a->flags = flags;
  t->nadded++;
  return PG_OK;
}

static pcre2_code *compile_re(const char *pat, size_t n) {
  int err;
  PCRE2_SIZE off;
  /* UCP: \s, \w, \d and [[:classes:]] are Unicode's, as in Oniguruma (tokenizers' engine).
   * MATCH_INVALID_UTF: a text that is not UTF-8 is matched, not refused (pg_tokenizer.h). */
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, NULL);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return pg_fail_null("regex '%.*s' does not compile: PCRE2: %s at offset %zu", (int)(n > 200 ? 200 : n), pat,
                        (const char *)msg, (size_t)off);
  }
  (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* without JIT (unsupported CPU) pcre2_match interprets */
  return re;
}

int pg_tokenizer_add_step(pg_tokenizer *t, pg_tok_stage stage, const pg_tok_step *step) {
  if ((int)stage < 0 || stage > PG_TOK_DECODER) return pg_fail("tokenizer: bad stage %d", (int)stage);
  if (GROW(t->steps[stage], t->steps_cap[stage], t->nsteps[stage] + 1)) return PG_ERR;
  step_t s = {*step, NULL};
  s.s.pattern = s.s.content = NULL;
  if (step->pattern && !(s.s.pattern = dup_bytes(step->pattern, step->pattern_len))) return PG_ERR;
  if (step->content && !(s.s.content = dup_bytes(step->content, step->content_len))) return step_free(&s), PG_ERR;
  if ((step->kind == PG_TOK_REPLACE || step->kind == PG_TOK_SPLIT) && (!step->pattern || !step->pattern_len)) {
    step_free(&s);
    return pg_fail("tokenizer: an empty pattern");
  }
  if ((step->kind == PG_TOK_METASPACE || step->kind == PG_TOK_STRIP) && (!step->content || !step->content_len)) {
    step_free(&s);
    return pg_fail("tokenizer: an empty replacement or content");
  }
  if (step->pattern && step->regex && !(s.re = compile_re(step->pattern, step->pattern_len))) return step_free(&s), PG_ERR;
  if (step->kind == PG_TOK_BYTELEVEL && step->use_regex && !t->gpt2_re &&
      !(t->gpt2_re = compile_re(GPT2_PATTERN, sizeof GPT2_PATTERN - 1)))
    return step_free(&s), PG_ERR;
  if (step->kind == PG_TOK_DIGITS && !t->digits_re && !(t->digits_re = compile_re("\\p{N}", 5))) return step_free(&s), PG_ERR;
  t->steps[stage][t->nsteps[stage]++] = s;
  return PG_OK;
}

int pg_tokenizer_set_template(pg_tokenizer *t, const int32_t *items, size_t n) {
  free(t->tmpl);
  t->tmpl = NULL;
  t->ntmpl = 0;
  if (n && !(t->tmpl = malloc(n * sizeof *items))) return pg_fail("tokenizer: out of memory");
  if (n) memcpy(t->tmpl, items, n * sizeof *items);
  t->ntmpl = n;
  t->has_tmpl = 1;
  return PG_OK;
}

/* ---- per-thread state ---- */

typedef struct {
  size_t off, len;
  int32_t id; /* >= 0: an added token (done) */
  uint8_t at_start;
} piece;

typedef struct {
  piece *v;
  size_t n, cap;
  buf_t b;
} plist;

typedef struct {
  size_t s, e;
  int m;
} seg;

typedef struct {
  int32_t id, prev, next;
} sym;

typedef struct {
  int32_t rank, pos, id;
} hent;

typedef struct {
  uint64_t h;
  uint32_t key_off, key_len, ids_off, ids_n;
} centry;

struct pg_tok_state {
  const pg_tokenizer *t;
  pcre2_match_data *md;
  pcre2_match_context *mctx;
  pcre2_jit_stack *js;
  plist pl[2];
  seg *segs;
  size_t nsegs, segs_cap;
  buf_t tmp[2];
  sym *syms;
  size_t syms_cap;
  hent *heap;
  size_t heap_cap;
  int32_t *out;
  size_t nout, out_cap;
  centry *cache; /* CACHE_SLOTS, ids_n == UINT32_MAX: empty */
  size_t ncache;
  buf_t ckeys;
  int32_t *cids;
  size_t ncids, cids_cap;
};

static void cache_clear(pg_tok_state *st) {
  for (size_t i = 0; i < CACHE_SLOTS; i++) st->cache[i].ids_n = UINT32_MAX;
  st->ncache = 0;
  st->ckeys.n = 0;
  st->ncids = 0;
}

void pg_tok_state_free(pg_tok_state *st) {
  if (!st) return;
  pcre2_match_data_free(st->md);
  pcre2_match_context_free(st->mctx);
  pcre2_jit_stack_free(st->js);
  for (int i = 0; i < 2; i++) free(st->pl[i].v), free(st->pl[i].b.p), free(st->tmp[i].p);
  free(st->segs), free(st->syms), free(st->heap), free(st->out);
  free(st->cache), free(st->ckeys.p), free(st->cids);
  free(st);
}

pg_tok_state *pg_tok_state_new(const pg_tokenizer *t) {
  pg_tok_state *st = calloc(1, sizeof *st);
  if (!st) return pg_fail_null("tokenizer: out of memory");
  st->t = t;
  st->md = pcre2_match_data_create(1, NULL);
  st->mctx = pcre2_match_context_create(NULL);
  /* JIT's default stack is 32 KB; a long pre-token in a lookahead pattern needs more, so up to 16 MB. */
  st->js = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, NULL);
  if (!st->md || !st->mctx) {
    pg_tok_state_free(st);
    return pg_fail_null("tokenizer: out of memory");
  }
  if (st->js) pcre2_jit_stack_assign(st->mctx, NULL, st->js);
  return st; /* the cache comes with the first word (decoding needs none) */
}

/* ---- pieces ---- */

static int emit(plist *o, const char *s, size_t n, int32_t id, int at_start) {
  if (id < 0 && n == 0) return PG_OK; /* tokenizers drops empty pieces */
  if (GROW(o->v, o->cap, o->n + 1)) return PG_ERR;
  size_t off = o->b.n;
  if (id < 0 && buf_put(&o->b, s, n)) return PG_ERR;
  o->v[o->n++] = (piece){off, id < 0 ? n : 0, id, (uint8_t)at_start};
  return PG_OK;
}

static void plist_reset(plist *p) { p->n = 0, p->b.n = 0; }

/* Matches of re (or of the literal lit) in s, as segments covering s:
 * matches (m = 1) and the gaps between them (m = 0). */
static int find_segments(pg_tok_state *st, const pcre2_code *re, const char *lit, size_t litn, const char *s, size_t n) {
  st->nsegs = 0;
  size_t prev = 0, at = 0;
  while (at <= n) {
    size_t ms, me;
    if (re) {
      int rc = pcre2_match(re, (PCRE2_SPTR)s, n, at, 0, st->md, st->mctx);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return pg_fail("tokenizer: regex match failed on a piece of %zu bytes: PCRE2: %s", n, (const char *)msg);
      }
      PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->md);
      ms = ov[0], me = ov[1];
    } else {
      const char *p = memmem(s + at, n - at, lit, litn);
      if (!p) break;
      ms = (size_t)(p - s), me = ms + litn;
    }
    if (GROW(st->segs, st->segs_cap, st->nsegs + 2)) return PG_ERR;
    if (ms > prev) st->segs[st->nsegs++] = (seg){prev, ms, 0};
    st->segs[st->nsegs++] = (seg){ms, me, 1};
    prev = me;
    if (me > ms) {
      at = me;
    } else { /* an empty match: go on one character later */
      if (ms >= n) break;
      int v;
      at = ms + u8_scan((const unsigned char *)s + ms, n - ms, &v);
    }
  }
  if (prev < n) {
    if (GROW(st->segs, st->segs_cap, st->nsegs + 1)) return PG_ERR;
    st->segs[st->nsegs++] = (seg){prev, n, 0};
  }
  return PG_OK;
}

/* Turns the segments into the pieces a behavior keeps (tokenizers'
 * NormalizedString::split); m = 1 in the result means "removed". */
static void apply_behavior(pg_tok_state *st, int behavior, int invert) {
  seg *v = st->segs;
  size_t n = st->nsegs, k = 0;
  if (invert)
    for (size_t i = 0; i < n; i++) v[i].m = !v[i].m;
  switch (behavior) {
  case PG_SPLIT_REMOVED: return;
  case PG_SPLIT_ISOLATED:
    for (size_t i = 0; i < n; i++) v[i].m = 0;
    return;
  case PG_SPLIT_CONTIGUOUS: {
    int prev = 0;
    for (size_t i = 0; i < n; i++) {
      int m = v[i].m;
      if (m == prev && k) v[k - 1].e = v[i].e;
      else v[k++] = (seg){v[i].s, v[i].e, 0};
      prev = m;
    }
    break;
  }
  case PG_SPLIT_MERGED_WITH_PREVIOUS: {
    int prev = 0;
    for (size_t i = 0; i < n; i++) {
      int m = v[i].m;
      if (m && !prev && k) v[k - 1].e = v[i].e;
      else v[k++] = (seg){v[i].s, v[i].e, 0};
      prev = m;
    }
    break;
  }
  default: { /* MergedWithNext: from the end (reversed first, so writes stay behind reads), a match joins the piece after it */
    int prev = 0;
    for (size_t i = 0; i < n / 2; i++) {
      seg x = v[i];
      v[i] = v[n - 1 - i], v[n - 1 - i] = x;
    }
    for (size_t i = 0; i < n; i++) {
      int m = v[i].m;
      if (m && !prev && k) v[k - 1].s = v[i].s;
      else v[k++] = (seg){v[i].s, v[i].e, 0};
      prev = m;
    }
    for (size_t i = 0; i < k / 2; i++) {
      seg x = v[i];
      v[i] = v[k - 1 - i], v[k - 1 - i] = x;
    }
    break;
  }
  }
  st->nsegs = k;
}

static int emit_segments(pg_tok_state *st, plist *o, const char *s, int at_start) {
  for (size_t i = 0; i < st->nsegs; i++) {
    const seg *g = &st->segs[i];
    if (!g->m && emit(o, s + g->s, g->e - g->s, -1, at_start && g->s == 0)) return PG_ERR;
  }
  return PG_OK;
}

/* ---- step 1 and 2: added tokens ---- */

static int split_added(const pg_tokenizer *t, const plist *in, plist *o, int normalized) {
  for (size_t p = 0; p < in->n; p++) {
    const piece *pc = &in->v[p];
    if (pc->id >= 0) {
      if (emit(o, NULL, 0, pc->id, 0)) return PG_ERR;
      continue;
    }
    const char *s = in->b.p + pc->off;
    const unsigned char *u = (const unsigned char *)s;
    size_t n = pc->len, pos = 0, start_off = 0;
    const uint8_t *first = normalized ? t->first_norm : t->first_raw;
    while (pos < n) {
      if (!first[u[pos]]) {
        pos++;
        continue;
      }
      const added_t *best = NULL;
      size_t blen = 0;
      for (size_t i = 0; i < t->nadded; i++) {
        const added_t *a = &t->added[i];
        if (!(a->flags & PG_TOK_NORMALIZED) != !normalized) continue;
        const char *c = normalized ? a->norm : a->s;
        size_t cn = normalized ? a->norm_n : a->n;
        if (cn > blen && cn <= n - pos && !memcmp(s + pos, c, cn)) best = a, blen = cn;
      }
      if (!best) {
        pos++;
        continue;
      }
      size_t ms = pos, me = pos + blen;
      pos = me; /* the search goes on after the match, even when the match is refused below */
      int v;
      if (best->flags & PG_TOK_SINGLE_WORD) {
        int before = 0, after = 0;
        if (ms > 0) {
          size_t j = ms - 1;
          while (j > 0 && ms - j < 4 && (u[j] & 0xC0) == 0x80) j--;
          size_t l = u8_scan(u + j, n - j, &v);
          before = v && j + l == ms && is_word(u8_cp(u + j, l));
        }
        if (me < n) {
          size_t l = u8_scan(u + me, n - me, &v);
          after = v && is_word(u8_cp(u + me, l));
        }
        if (before || after) continue;
      }
      if (best->flags & PG_TOK_LSTRIP) {
        size_t i = ms;
        while (i > 0) {
          size_t j = i - 1;
          while (j > 0 && i - j < 4 && (u[j] & 0xC0) == 0x80) j--;
          size_t l = u8_scan(u + j, n - j, &v);
          if (!v || j + l != i || !is_ws(u8_cp(u + j, l))) break;
          i = j;
        }
        ms = i > start_off ? i : start_off;
      }
      if (best->flags & PG_TOK_RSTRIP) {
        while (me < n) {
          size_t l = u8_scan(u + me, n - me, &v);
          if (!v || !is_ws(u8_cp(u + me, l))) break;
          me += l;
        }
        if (pos < me) pos = me;
      }
      if (start_off < ms && emit(o, s + start_off, ms - start_off, -1, pc->at_start && start_off == 0)) return PG_ERR;
      if (emit(o, NULL, 0, best->id, 0)) return PG_ERR;
      start_off = me;
    }
    if (start_off < n && emit(o, s + start_off, n - start_off, -1, pc->at_start && start_off == 0)) return PG_ERR;
  }
  return PG_OK;
}

/* ---- normalizers ---- */

static int replace_all(pg_tok_state *st, const step_t *sp, const char *s, size_t n, const char *with, size_t wn,
                       buf_t *o) {
  if (find_segments(st, sp->re, sp->s.pattern, sp->s.pattern_len, s, n)) return PG_ERR;
  for (size_t i = 0; i < st->nsegs; i++) {
    const seg *g = &st->segs[i];
    if (g->m ? buf_put(o, with, wn) : buf_put(o, s + g->s, g->e - g->s)) return PG_ERR;
  }
  return PG_OK;
}

static int unicode_normalize(const char *s, size_t n, int compat, buf_t *o) {
  const unsigned char *u = (const unsigned char *)s;
  size_t i = 0;
  while (i < n) {
    size_t j = i;
    int v = 1;
    while (j < n) { /* the valid run from i */
      size_t l = u8_scan(u + j, n - j, &v);
      if (!v) break;
      j += l;
    }
    if (j > i) {
      utf8proc_uint8_t *dst = NULL;
      utf8proc_ssize_t r = utf8proc_map(u + i, (utf8proc_ssize_t)(j - i), &dst,
                                        UTF8PROC_STABLE | UTF8PROC_COMPOSE | (compat ? UTF8PROC_COMPAT : 0));
      if (r < 0) {
        free(dst);
        return pg_fail("tokenizer: normalization failed: %s", utf8proc_errmsg(r));
      }
      int rc = buf_put(o, dst, (size_t)r);
      free(dst);
      if (rc) return PG_ERR;
    }
    if (j < n) { /* invalid bytes stay as they are */
      size_t l = u8_scan(u + j, n - j, &v);
      if (buf_put(o, s + j, l)) return PG_ERR;
      j += l;
    }
    i = j;
  }
  return PG_OK;
}

/* All normalizers on s; the result is in st->tmp[*which]. */
static int normalize(const pg_tokenizer *t, pg_tok_state *st, const char *s, size_t n, int *which) {
  const char *cur = s;
  size_t cn = n;
  int w = 0;
  st->tmp[0].n = 0;
  if (buf_put(&st->tmp[0], s, n)) return PG_ERR;
  cur = st->tmp[0].p;
  for (size_t k = 0; k < t->nsteps[PG_TOK_NORMALIZER]; k++) {
    const step_t *sp = &t->steps[PG_TOK_NORMALIZER][k];
    buf_t *o = &st->tmp[!w];
    o->n = 0;
    int rc = PG_OK;
    switch (sp->s.kind) {
    case PG_TOK_NFC:
    case PG_TOK_NFKC: rc = unicode_normalize(cur, cn, sp->s.kind == PG_TOK_NFKC, o); break;
    case PG_TOK_PREPEND:
      if (cn) rc = buf_put(o, sp->s.content, sp->s.content_len);
      if (!rc) rc = buf_put(o, cur, cn);
      break;
    case PG_TOK_REPLACE: rc = replace_all(st, sp, cur, cn, sp->s.content, sp->s.content_len, o); break;
    default: return pg_fail("tokenizer: step %d is not a normalizer", (int)sp->s.kind);
    }
    if (rc || buf_put(o, "", 0)) return PG_ERR;
    w = !w;
    cur = st->tmp[w].p, cn = st->tmp[w].n;
  }
  *which = w;
  return PG_OK;
}

static int normalize_pieces(const pg_tokenizer *t, pg_tok_state *st, const plist *in, plist *o) {
  for (size_t p = 0; p < in->n; p++) {
    const piece *pc = &in->v[p];
    int w;
    if (pc->id >= 0) {
      if (emit(o, NULL, 0, pc->id, 0)) return PG_ERR;
    } else if (normalize(t, st, in->b.p + pc->off, pc->len, &w) ||
               emit(o, st->tmp[w].p, st->tmp[w].n, -1, pc->at_start)) {
      return PG_ERR;
    }
  }
  return PG_OK;
}

/* ---- pre-tokenizers ---- */

static int pre_tokenize_step(const pg_tokenizer *t, pg_tok_state *st, const step_t *sp, const plist *in, plist *o) {
  for (size_t p = 0; p < in->n; p++) {
    const piece *pc = &in->v[p];
    if (pc->id >= 0) {
      if (emit(o, NULL, 0, pc->id, 0)) return PG_ERR;
      continue;
    }
    const char *s = in->b.p + pc->off;
    size_t n = pc->len;
    buf_t *tb = &st->tmp[0];
    tb->n = 0;
    switch (sp->s.kind) {
    case PG_TOK_BYTELEVEL: {
      if (sp->s.add_prefix_space && s[0] != ' ') {
        if (buf_put(tb, " ", 1) || buf_put(tb, s, n)) return PG_ERR;
        s = tb->p, n = tb->n;
      }
      if (sp->s.use_regex) {
        if (find_segments(st, t->gpt2_re, NULL, 0, s, n)) return PG_ERR;
        apply_behavior(st, PG_SPLIT_ISOLATED, 0);
      } else {
        st->nsegs = 0;
        if (GROW(st->segs, st->segs_cap, 1)) return PG_ERR;
        st->segs[st->nsegs++] = (seg){0, n, 0};
      }
      /* each piece's bytes become their byte-level characters */
      for (size_t i = 0; i < st->nsegs; i++) {
        const seg *g = &st->segs[i];
        if (g->e == g->s) continue;
        if (GROW(o->v, o->cap, o->n + 1)) return PG_ERR;
        size_t off = o->b.n;
        if ((g->e - g->s) > (SIZE_MAX - off) / 2 - 1) return pg_fail("tokenizer: out of memory");
        if (GROW(o->b.p, o->b.cap, off + 2 * (g->e - g->s) + 1)) return PG_ERR;
        char *w = o->b.p + off;
        for (size_t j = g->s; j < g->e; j++) {
          unsigned char b = (unsigned char)s[j];
          memcpy(w, t->byte_char[b], t->byte_char_len[b]);
          w += t->byte_char_len[b];
        }
        o->b.n = (size_t)(w - o->b.p);
        o->b.p[o->b.n] = 0;
        o->v[o->n++] = (piece){off, o->b.n - off, -1, (uint8_t)(pc->at_start && g->s == 0)};
      }
      break;
    }
    case PG_TOK_SPLIT:
      if (find_segments(st, sp->re, sp->s.pattern, sp->s.pattern_len, s, n)) return PG_ERR;
      apply_behavior(st, sp->s.behavior, sp->s.invert);
      if (emit_segments(st, o, s, pc->at_start)) return PG_ERR;
      break;
    case PG_TOK_DIGITS:
      if (find_segments(st, t->digits_re, NULL, 0, s, n)) return PG_ERR;
      apply_behavior(st, sp->s.individual_digits ? PG_SPLIT_ISOLATED : PG_SPLIT_CONTIGUOUS, 0);
      if (emit_segments(st, o, s, pc->at_start)) return PG_ERR;
      break;
    case PG_TOK_METASPACE: {
      const char *r = sp->s.content;
      size_t rn = sp->s.content_len;
      buf_t *rb = &st->tmp[1];
      rb->n = 0;
      for (size_t j = 0; j < n; j++)
        if (s[j] == ' ' ? buf_put(rb, r, rn) : buf_put(rb, s + j, 1)) return PG_ERR;
      int starts = rb->n >= rn && !memcmp(rb->p, r, rn);
      int prepend = !starts && (sp->s.prepend_scheme == PG_PREPEND_ALWAYS ||
                                (sp->s.prepend_scheme == PG_PREPEND_FIRST && pc->at_start));
      if (prepend && buf_put(tb, r, rn)) return PG_ERR;
      if (buf_put(tb, rb->p, rb->n)) return PG_ERR;
      if (!sp->s.split) {
        if (emit(o, tb->p, tb->n, -1, pc->at_start)) return PG_ERR;
        break;
      }
      if (find_segments(st, NULL, r, rn, tb->p, tb->n)) return PG_ERR;
      apply_behavior(st, PG_SPLIT_MERGED_WITH_NEXT, 0);
      if (emit_segments(st, o, tb->p, pc->at_start)) return PG_ERR;
      break;
    }
    default: return pg_fail("tokenizer: step %d is not a pre-tokenizer", (int)sp->s.kind);
    }
  }
  return PG_OK;
}

/* Steps 1-3: the final pieces, in the plist returned. */
static int run_pieces(const pg_tokenizer *t, pg_tok_state *st, const char *text, size_t n, plist **res) {
  if (st->t != t) return pg_fail("tokenizer: a state made for another tokenizer");
  int cur = 0;
  plist_reset(&st->pl[0]);
  if (emit(&st->pl[0], text, n, -1, 1)) return PG_ERR;
#define NEXT(call)                                                                                                     \
  do {                                                                                                                 \
    plist_reset(&st->pl[!cur]);                                                                                        \
    if (call) return PG_ERR;                                                                                           \
    cur = !cur;                                                                                                        \
  } while (0)
  if (t->has_raw_added) NEXT(split_added(t, &st->pl[cur], &st->pl[!cur], 0));
  if (t->nsteps[PG_TOK_NORMALIZER]) NEXT(normalize_pieces(t, st, &st->pl[cur], &st->pl[!cur]));
  if (t->has_norm_added) NEXT(split_added(t, &st->pl[cur], &st->pl[!cur], 1));
  for (size_t k = 0; k < t->nsteps[PG_TOK_PRE_TOKENIZER]; k++)
    NEXT(pre_tokenize_step(t, st, &t->steps[PG_TOK_PRE_TOKENIZER][k], &st->pl[cur], &st->pl[!cur]));
#undef NEXT
  *res = &st->pl[cur];
  return PG_OK;
}

/* ---- step 4: the BPE model ---- */

static int out_push(pg_tok_state *st, int32_t id) {
  if (GROW(st->out, st->out_cap, st->nout + 1)) return PG_ERR;
  st->out[st->nout++] = id;
  return PG_OK;
}

static inline int hless(const hent *a, const hent *b) { return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos); }

static void heap_push(hent *h, size_t *n, hent x) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!hless(&x, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = x;
}

static hent heap_pop(hent *h, size_t *n) {
  hent top = h[0], x = h[--*n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && hless(&h[c + 1], &h[c])) c++;
    if (!hless(&h[c], &x)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n) h[i] = x;
  return top;
}

static int push_pair(const pg_tokenizer *t, pg_tok_state *st, size_t *nh, int32_t pos) {
  const sym *a = &st->syms[pos];
  if (a->next < 0) return PG_OK;
  size_t at;
  if (!mm_find(&t->merges, pair_key(a->id, st->syms[a->next].id), &at)) return PG_OK;
  if (GROW(st->heap, st->heap_cap, *nh + 1)) return PG_ERR;
  heap_push(st->heap, nh, (hent){t->merges.rank[at], pos, t->merges.id[at]});
  return PG_OK;
}

/* The ids of one pre-token, appended to st->out (tokenizers' BPE::merge_word, then Word::merge_all). */
static int bpe_word(const pg_tokenizer *t, pg_tok_state *st, const char *s, size_t n) {
  if (t->model.ignore_merges) {
    int32_t id = sm_get(&t->vocab, s, n);
    if (id >= 0) return out_push(st, id);
  }
  uint64_t h = 0;
  size_t slot = 0;
  if (!st->cache) {
    if (!(st->cache = malloc(CACHE_SLOTS * sizeof *st->cache))) return pg_fail("tokenizer: out of memory");
    cache_clear(st);
  }
  if (n <= CACHE_KEY_MAX) {
    h = pg_tok_hash_bytes(s, n);
    for (slot = h & (CACHE_SLOTS - 1);; slot = (slot + 1) & (CACHE_SLOTS - 1)) {
      const centry *c = &st->cache[slot];
      if (c->ids_n == UINT32_MAX) break;
      if (c->h == h && c->key_len == n && !memcmp(st->ckeys.p + c->key_off, s, n)) {
        for (uint32_t i = 0; i < c->ids_n; i++)
          if (out_push(st, st->cids[c->ids_off + i])) return PG_ERR;
        return PG_OK;
      }
    }
  }
  /* symbol positions are int32 (12 bytes a symbol, not 24): a pre-token of 2^31 bytes is refused */
  if (n >= (size_t)INT32_MAX - 2) return pg_fail("tokenizer: a pre-token of %zu bytes (at most 2^31 - 3)", n);
  /* the initial symbols: characters (an invalid byte is one) found in the vocabulary,
   * else their <0xXX> bytes, else unk (fused into one when fuse_unk) */
  size_t nsym = 0, start = st->nout;
  int32_t unk = -1;
  const unsigned char *u = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    int v;
    size_t l = u8_scan(u + i, n - i, &v);
    if (!v) l = 1;
    if (GROW(st->syms, st->syms_cap, nsym + l + 2)) return PG_ERR;
    int32_t id = sm_get(&t->vocab, s + i, l);
    if (id >= 0) {
      if (unk >= 0) st->syms[nsym++].id = unk, unk = -1;
      st->syms[nsym++].id = id;
    } else {
      int done = 0;
      if (t->model.byte_fallback) {
        done = 1;
        for (size_t j = 0; j < l; j++) done &= t->byte_ids[u[i + j]] >= 0;
        /* as tokenizers: the bytes go in, and a pending unk stays pending */
        for (size_t j = 0; done && j < l; j++) st->syms[nsym++].id = t->byte_ids[u[i + j]];
      }
      if (!done && t->unk_id >= 0) {
        if (unk >= 0 && !t->model.fuse_unk) st->syms[nsym++].id = unk;
        unk = t->unk_id;
      }
    }
    i += l;
  }
  if (unk >= 0) {
    if (GROW(st->syms, st->syms_cap, nsym + 1)) return PG_ERR;
    st->syms[nsym++].id = unk;
  }
  for (size_t i = 0; i < nsym; i++) {
    st->syms[i].prev = (int32_t)i - 1;
    st->syms[i].next = i + 1 < nsym ? (int32_t)i + 1 : -1;
  }
  size_t nh = 0;
  for (size_t i = 0; i + 1 < nsym; i++)
    if (push_pair(t, st, &nh, (int32_t)i)) return PG_ERR;
  while (nh) {
    hent top = heap_pop(st->heap, &nh);
    sym *a = &st->syms[top.pos];
    if (a->id < 0 || a->next < 0) continue; /* merged away, or nothing on its right any more */
    sym *b = &st->syms[a->next];
    size_t at;
    if (!mm_find(&t->merges, pair_key(a->id, b->id), &at) || t->merges.id[at] != top.id) continue; /* stale */
    a->id = top.id;
    a->next = b->next;
    if (b->next >= 0) st->syms[b->next].prev = top.pos;
    b->id = -1;
    if (a->prev >= 0 && push_pair(t, st, &nh, a->prev)) return PG_ERR;
    if (push_pair(t, st, &nh, top.pos)) return PG_ERR;
  }
  for (int32_t i = nsym ? 0 : -1; i >= 0; i = st->syms[i].next)
    if (out_push(st, st->syms[i].id)) return PG_ERR;
  if (n <= CACHE_KEY_MAX) {
    size_t cnt = st->nout - start;
    if (st->ncache >= CACHE_ENTRIES || st->ckeys.n > UINT32_MAX / 2 || st->ncids > UINT32_MAX / 2) {
      cache_clear(st); /* full: start over (bounded memory, and the recent words come back fast) */
      for (slot = h & (CACHE_SLOTS - 1); st->cache[slot].ids_n != UINT32_MAX; slot = (slot + 1) & (CACHE_SLOTS - 1)) {
      }
    }
    if (GROW(st->cids, st->cids_cap, st->ncids + cnt)) return PG_ERR;
    size_t koff = st->ckeys.n;
    if (buf_put(&st->ckeys, s, n)) return PG_ERR;
    if (cnt) memcpy(st->cids + st->ncids, st->out + start, cnt * sizeof(int32_t)); /* cids is NULL until the first id */
    st->cache[slot] = (centry){h, (uint32_t)koff, (uint32_t)n, (uint32_t)st->ncids, (uint32_t)cnt};
    st->ncids += cnt;
    st->ncache++;
  }
  return PG_OK;
}

int pg_tokenizer_encode(const pg_tokenizer *t, pg_tok_state *st, const char *text, size_t n, int add_special,
                        int32_t **ids, size_t *nids) {
  *ids = NULL, *nids = 0;
  if (!t->finished) return pg_fail("tokenizer: not finished");
  plist *pl;
  if (run_pieces(t, st, text, n, &pl)) return PG_ERR;
  st->nout = 0;
  for (size_t p = 0; p < pl->n; p++) {
    const piece *pc = &pl->v[p];
    if (pc->id >= 0 ? out_push(st, pc->id) : bpe_word(t, st, pl->b.p + pc->off, pc->len)) return PG_ERR;
  }
  size_t total = st->nout;
  if (add_special && t->has_tmpl) total += t->ntmpl; /* the -1 slot is counted and not used: one spare */
  int32_t *r = malloc((total ? total : 1) * sizeof *r);
  if (!r) return pg_fail("tokenizer: out of memory for %zu ids", total);
  size_t k = 0;
  if (add_special && t->has_tmpl) {
    for (size_t i = 0; i < t->ntmpl; i++) {
      if (t->tmpl[i] >= 0) {
        r[k++] = t->tmpl[i];
      } else if (st->nout) { /* st->out is NULL before the first id */
        memcpy(r + k, st->out, st->nout * sizeof *r);
        k += st->nout;
      }
    }
  } else if (st->nout) {
    memcpy(r, st->out, st->nout * sizeof *r);
    k = st->nout;
  }
  *ids = r, *nids = k;
  return PG_OK;
}

int pg_tokenizer_pre_tokenize(const pg_tokenizer *t, pg_tok_state *st, const char *text, size_t n, pg_tok_piece_fn fn,
                              void *ud) {
  if (!t->finished) return pg_fail("tokenizer: not finished");
  plist *pl;
  if (run_pieces(t, st, text, n, &pl)) return PG_ERR;
  for (size_t p = 0; p < pl->n; p++) {
    const piece *pc = &pl->v[p];
    if (fn(ud, pl->b.p + pc->off, pc->len, pc->id)) return PG_ERR;
  }
  return PG_OK;
}

/* ---- finishing ---- */

int pg_tokenizer_finish(pg_tokenizer *t) {
  if (t->finished) return PG_OK;
  if (t->unk) {
    t->unk_id = sm_get(&t->vocab, t->unk, t->model.unk_len);
    if (t->unk_id < 0) return pg_fail("unk_token '%s' is not in the vocabulary", t->unk);
  }
  for (int b = 0; b < 256; b++) {
    char name[8];
    snprintf(name, sizeof name, "<0x%02X>", b);
    t->byte_ids[b] = sm_get(&t->vocab, name, 6);
  }
  int32_t maxid = t->max_vocab_id;
  for (size_t i = 0; i < t->nadded; i++)
    if (t->added[i].id > maxid) maxid = t->added[i].id;
  t->size = maxid + 1;
  size_t sz = (size_t)t->size;
  t->id_tok = calloc(sz ? sz : 1, sizeof *t->id_tok);
  t->id_len = calloc(sz ? sz : 1, sizeof *t->id_len);
  t->special = calloc(sz ? sz : 1, 1);
  if (!t->id_tok || !t->id_len || !t->special) return pg_fail("tokenizer: out of memory for %zu ids", sz);
  for (size_t k = 0; k < t->vocab.n; k++) {
    const sm_entry *e = &t->vocab.e[k];
    if (t->id_tok[e->val]) {
      return pg_fail("vocab: id %ld is given to both '%.*s' and '%.*s'", (long)e->val, (int)t->id_len[e->val],
                     t->id_tok[e->val], (int)e->len, t->vocab.arena.p + e->off);
    }
    t->id_tok[e->val] = t->vocab.arena.p + e->off;
    t->id_len[e->val] = e->len;
  }
  pg_tok_state *st = pg_tok_state_new(t);
  if (!st) return PG_ERR;
  for (size_t i = 0; i < t->nadded; i++) {
    added_t *a = &t->added[i];
    t->id_tok[a->id] = a->s; /* an added token's content wins, as in tokenizers' id_to_token */
    t->id_len[a->id] = (uint32_t)a->n;
    t->special[a->id] = (a->flags & PG_TOK_SPECIAL) != 0;
    if (a->flags & PG_TOK_NORMALIZED) {
      int w;
      /* tokenizers matches a normalized added token by its content put through the normalizers */
      if (normalize(t, st, a->s, a->n, &w) || !(a->norm = dup_bytes(st->tmp[w].p, st->tmp[w].n))) {
        pg_tok_state_free(st);
        return PG_ERR;
      }
      a->norm_n = st->tmp[w].n;
      t->id_tok[a->id] = a->norm; /* and gives that form back for the id (decode, id_to_token) */
      t->id_len[a->id] = (uint32_t)a->norm_n;
      if (a->norm_n) t->first_norm[(unsigned char)a->norm[0]] = 1, t->has_norm_added = 1;
    } else {
      t->first_raw[(unsigned char)a->s[0]] = 1;
      t->has_raw_added = 1;
    }
  }
  pg_tok_state_free(st);
  for (size_t i = 0; i < t->ntmpl; i++)
    if (t->tmpl[i] >= t->size || (t->tmpl[i] >= 0 && !t->id_tok[t->tmpl[i]]))
      return pg_fail("post_processor: template id %ld has no token", (long)t->tmpl[i]);
  t->finished = 1;
  return PG_OK;
}

int32_t pg_tokenizer_vocab_size(const pg_tokenizer *t) { return t->size; }

int32_t pg_tokenizer_token_to_id(const pg_tokenizer *t, const char *s, size_t n) {
  for (size_t i = 0; i < t->nadded; i++)
    if (t->added[i].n == n && !memcmp(t->added[i].s, s, n)) return t->added[i].id;
  return sm_get(&t->vocab, s, n);
}

const char *pg_tokenizer_id_to_token(const pg_tokenizer *t, int32_t id, size_t *len) {
  if (!t->finished || id < 0 || id >= t->size || !t->id_tok[id]) return NULL;
  *len = t->id_len[id];
  return t->id_tok[id];
}

int pg_tokenizer_is_special(const pg_tokenizer *t, int32_t id) {
  return t->finished && id >= 0 && id < t->size && t->special[id];
}

/* ---- decoding ---- */

typedef struct {
  size_t *off, *len;
  size_t n, cap_o, cap_l;
  buf_t b;
} slist;

static int sl_push(slist *l, const char *s, size_t n) {
  if (GROW(l->off, l->cap_o, l->n + 1) || GROW(l->len, l->cap_l, l->n + 1)) return PG_ERR;
  l->off[l->n] = l->b.n;
  l->len[l->n] = n;
  if (buf_put(&l->b, s, n)) return PG_ERR;
  l->n++;
  return PG_OK;
}

static void sl_free(slist *l) { free(l->off), free(l->len), free(l->b.p); }

/* Invalid UTF-8 becomes U+FFFD, one per maximal ill-formed subsequence (Rust's from_utf8_lossy). */
static int put_lossy(buf_t *o, const char *s, size_t n) {
  const unsigned char *u = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    int v;
    size_t l = u8_scan(u + i, n - i, &v);
    if (v ? buf_put(o, s + i, l) : buf_put(o, "\xEF\xBF\xBD", 3)) return PG_ERR;
    i += l;
  }
  return PG_OK;
}

static int decode_step(const pg_tokenizer *t, pg_tok_state *st, const step_t *sp, const slist *in, slist *o) {
  buf_t *tb = &st->tmp[0];
  switch (sp->s.kind) {
  case PG_TOK_BYTELEVEL: {
    buf_t *raw = &st->tmp[1];
    raw->n = 0;
    for (size_t k = 0; k < in->n; k++) {
      const unsigned char *u = (const unsigned char *)in->b.p + in->off[k];
      size_t n = in->len[k], start = raw->n;
      int ok = 1;
      for (size_t i = 0; i < n && ok;) {
        int v;
        size_t l = u8_scan(u + i, n - i, &v);
        int32_t cp = v ? u8_cp(u + i, l) : -1;
        if (cp < 0 || cp >= 324 || t->char_byte[cp] < 0) {
          ok = 0;
          break;
        }
        char b = (char)t->char_byte[cp];
        if (buf_put(raw, &b, 1)) return PG_ERR;
        i += l;
      }
      if (!ok) { /* a character outside the byte alphabet: the token's own bytes, as tokenizers does */
        raw->n = start;
        if (buf_put(raw, (const char *)u, n)) return PG_ERR;
      }
    }
    tb->n = 0;
    if (put_lossy(tb, raw->p, raw->n) || sl_push(o, tb->p, tb->n)) return PG_ERR;
    return PG_OK;
  }
  case PG_TOK_BYTEFALLBACK: {
    buf_t *bytes = &st->tmp[1];
    bytes->n = 0;
    for (size_t k = 0; k <= in->n; k++) {
      const char *s = k < in->n ? in->b.p + in->off[k] : NULL;
      size_t n = k < in->n ? in->len[k] : 0;
      int byte = -1;
      if (s && n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>') {
        /* Rust's u8::from_str_radix(_, 16) on the two characters (it takes a leading '+') */
        char hex[3] = {s[3], s[4], 0}, *end;
        int digits = (hex[0] == '+' || (hex[0] >= '0' && hex[0] <= '9') || ((hex[0] | 32) >= 'a' && (hex[0] | 32) <= 'f')) &&
                     ((hex[1] >= '0' && hex[1] <= '9') || ((hex[1] | 32) >= 'a' && (hex[1] | 32) <= 'f'));
        long b = digits ? strtol(hex, &end, 16) : -1;
        if (digits && *end == 0 && b >= 0 && b < 256) byte = (int)b;
      }
      if (byte >= 0) {
        char c = (char)byte;
        if (buf_put(bytes, &c, 1)) return PG_ERR;
        continue;
      }
      if (bytes->n) {
        int valid = 1;
        for (size_t i = 0; i < bytes->n && valid;) {
          size_t l = u8_scan((const unsigned char *)bytes->p + i, bytes->n - i, &valid);
          i += l;
        }
        if (valid) {
          if (sl_push(o, bytes->p, bytes->n)) return PG_ERR;
        } else {
          for (size_t i = 0; i < bytes->n; i++)
            if (sl_push(o, "\xEF\xBF\xBD", 3)) return PG_ERR;
        }
        bytes->n = 0;
      }
      if (s && sl_push(o, s, n)) return PG_ERR;
    }
    return PG_OK;
  }
  case PG_TOK_FUSE:
    tb->n = 0;
    for (size_t k = 0; k < in->n; k++)
      if (buf_put(tb, in->b.p + in->off[k], in->len[k])) return PG_ERR;
    return sl_push(o, tb->p ? tb->p : "", tb->n);
  case PG_TOK_REPLACE:
    for (size_t k = 0; k < in->n; k++) {
      tb->n = 0;
      if (replace_all(st, sp, in->b.p + in->off[k], in->len[k], sp->s.content, sp->s.content_len, tb) ||
          sl_push(o, tb->p ? tb->p : "", tb->n))
        return PG_ERR;
    }
    return PG_OK;
  case PG_TOK_STRIP: /* up to start leading and stop trailing copies of the content character */
    for (size_t k = 0; k < in->n; k++) {
      const char *s = in->b.p + in->off[k];
      size_t a = 0, e = in->len[k], c = sp->s.content_len;
      for (int i = 0; i < sp->s.start && e - a >= c && !memcmp(s + a, sp->s.content, c); i++) a += c;
      for (int i = 0; i < sp->s.stop && e - a >= c && !memcmp(s + e - c, sp->s.content, c); i++) e -= c;
      if (sl_push(o, s + a, e - a)) return PG_ERR;
    }
    return PG_OK;
  case PG_TOK_METASPACE: /* the replacement becomes a space; in the first token it goes (unless never prepended) */
    for (size_t k = 0; k < in->n; k++) {
      tb->n = 0;
      const char *s = in->b.p + in->off[k];
      size_t n = in->len[k], c = sp->s.content_len;
      for (size_t i = 0; i < n;) {
        if (n - i >= c && !memcmp(s + i, sp->s.content, c)) {
          if (!(k == 0 && sp->s.prepend_scheme != PG_PREPEND_NEVER) && buf_put(tb, " ", 1)) return PG_ERR;
          i += c;
        } else {
          if (buf_put(tb, s + i, 1)) return PG_ERR;
          i++;
        }
      }
      if (sl_push(o, tb->p ? tb->p : "", tb->n)) return PG_ERR;
    }
    return PG_OK;
  default: return pg_fail("tokenizer: step %d is not a decoder", (int)sp->s.kind);
  }
}

int pg_tokenizer_decode(const pg_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **out,
                        size_t *len) {
  *out = NULL, *len = 0;
  if (!t->finished) return pg_fail("tokenizer: not finished");
  slist l[2] = {{0}, {0}};
  int cur = 0, rc = PG_ERR;
  pg_tok_state *st = NULL;
  for (size_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (id < 0 || id >= t->size || !t->id_tok[id]) {
      pg_fail("decode: id %ld (position %zu) is not in the vocabulary (%ld ids)", (long)id, i + 1, (long)t->size);
      goto done;
    }
    if (skip_special && t->special[id]) continue;
    if (sl_push(&l[0], t->id_tok[id], t->id_len[id])) goto done;
  }
  if (!(st = pg_tok_state_new(t))) goto done;
  for (size_t k = 0; k < t->nsteps[PG_TOK_DECODER]; k++) {
    l[!cur].n = 0, l[!cur].b.n = 0;
    if (decode_step(t, st, &t->steps[PG_TOK_DECODER][k], &l[cur], &l[!cur])) goto done;
    cur = !cur;
  }
  {
    buf_t o = {0};
    int none = t->nsteps[PG_TOK_DECODER] == 0; /* no decoder: tokenizers joins the tokens with spaces */
    if (buf_put(&o, "", 0)) goto done;
    for (size_t k = 0; k < l[cur].n; k++)
      if ((none && k && buf_put(&o, " ", 1)) || buf_put(&o, l[cur].b.p + l[cur].off[k], l[cur].len[k])) {
        free(o.p);
        goto done;
      }
    *out = o.p, *len = o.n;
  }
  rc = PG_OK;
done:
  pg_tok_state_free(st);
  sl_free(&l[0]), sl_free(&l[1]);
  return rc;
}

/* ---- multi-threaded encoding ---- */

/* The first failure of a parallel encode: the lowest text index, so that
 * the message does not depend on which thread got there first. pg_error is
 * per thread, so the worker's message is copied here. */
typedef struct {
  size_t at;
  char msg[1024];
} batch_err;

static void batch_fail(batch_err *e, size_t at) {
#pragma omp critical(pg_tokenizer_batch_err)
  {
    if (at < e->at) {
      e->at = at;
      snprintf(e->msg, sizeof e->msg, "%s", pg_error());
    }
  }
}

int pg_tokenizer_encode_batch(const pg_tokenizer *t, const char *const *texts, const size_t *lens, size_t n,
                              int add_special, int threads, int32_t **ids, size_t *offsets) {
  *ids = NULL;
  offsets[0] = 0;
  if (!t->finished) return pg_fail("tokenizer: not finished");
  if (n > SIZE_MAX / sizeof(int32_t *)) return pg_fail("tokenizer: out of memory for %zu texts", n);
  int32_t **each = calloc(n ? n : 1, sizeof *each);
  size_t *count = calloc(n ? n : 1, sizeof *count);
  if (!each || !count) {
    free(each), free(count);
    return pg_fail("tokenizer: out of memory for %zu texts", n);
  }
  int nt = threads > 0 ? threads : omp_get_max_threads();
  if ((size_t)nt > n) nt = n ? (int)n : 1;
  batch_err err = {SIZE_MAX, ""};
  /* dynamic: texts differ in length, and a thread that finishes early takes the next one */
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    pg_tok_state *st = pg_tok_state_new(t);
    if (!st) batch_fail(&err, 0);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < n; i++) {
      if (st && pg_tokenizer_encode(t, st, texts[i], lens[i], add_special, &each[i], &count[i])) batch_fail(&err, i);
    }
    pg_tok_state_free(st);
  }
  size_t total = 0;
  for (size_t i = 0; i < n && err.at == SIZE_MAX; i++) {
    if (count[i] > SIZE_MAX / sizeof(int32_t) - total) {
      snprintf(err.msg, sizeof err.msg, "tokenizer: out of memory (%zu ids and more)", total);
      err.at = i;
    }
    total += count[i];
  }
  int32_t *r = err.at == SIZE_MAX ? malloc((total ? total : 1) * sizeof *r) : NULL;
  if (!r && err.at == SIZE_MAX) {
    snprintf(err.msg, sizeof err.msg, "tokenizer: out of memory for %zu ids", total);
    err.at = 0;
  }
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (r && count[i]) memcpy(r + k, each[i], count[i] * sizeof *r);
    k += count[i];
    offsets[i + 1] = r ? k : 0;
    free(each[i]);
  }
  free(each), free(count);
  if (!r) {
    offsets[0] = 0;
    return n > 1 ? pg_fail("%s (text %zu of %zu)", err.msg, err.at + 1, n) : pg_fail("%s", err.msg);
  }
  *ids = r;
  return PG_OK;
}

/* Where the chunk that starts at `start` ends: after the first newline at or
 * past start + chunk that has a visible ASCII character before it and an
 * ASCII letter or digit after it, or at the end. The character before
 * matters too: GPT-2's \s+(?!\S) makes "  \n" at the end of a text one
 * pre-token but "  " and "\n" before a word, and \r\n is split differently
 * by GPT-2's and Llama 3's regexes, so those places are never cuts. */
static size_t chunk_end(const char *text, size_t n, size_t start, size_t chunk) {
  if (n - start <= chunk) return n;
  const char *c = text + start + chunk - 1, *last = text + n - 1; /* a newline at n - 1 has nothing after it */
  while (c < last && (c = memchr(c, '\n', (size_t)(last - c)))) {
    unsigned char x = (unsigned char)c[1], w = c > text + start ? (unsigned char)c[-1] : 0;
    if (w > ' ' && w < 0x7f && ((x >= '0' && x <= '9') || (x >= 'A' && x <= 'Z') || (x >= 'a' && x <= 'z')))
      return (size_t)(c + 1 - text);
    c++;
  }
  return n;
}

int pg_tokenizer_encode_chunked(const pg_tokenizer *t, const char *text, size_t n, size_t chunk_bytes,
                                int add_special, int threads, int32_t **ids, size_t *nids) {
  *ids = NULL, *nids = 0;
  if (!t->finished) return pg_fail("tokenizer: not finished");
  if (!chunk_bytes) chunk_bytes = PG_TOK_CHUNK_BYTES;
  size_t nc = 0;
  for (size_t s = 0; s < n; s = chunk_end(text, n, s, chunk_bytes)) nc++;
  const char **ptrs = malloc((nc ? nc : 1) * sizeof *ptrs);
  size_t *lens = malloc((nc ? nc : 1) * sizeof *lens), *off = malloc((nc + 1) * sizeof *off);
  if (!ptrs || !lens || !off) {
    free(ptrs), free(lens), free(off);
    return pg_fail("tokenizer: out of memory for %zu chunks", nc);
  }
  size_t c = 0;
  for (size_t s = 0, e; s < n; s = e, c++) {
    e = chunk_end(text, n, s, chunk_bytes);
    ptrs[c] = text + s, lens[c] = e - s;
  }
  int32_t *flat;
  int rc = pg_tokenizer_encode_batch(t, ptrs, lens, nc, 0, threads, &flat, off);
  size_t k = off[nc];
  free(ptrs), free(lens), free(off);
  if (rc) return PG_ERR;
  if (!add_special || !t->has_tmpl) {
    *ids = flat, *nids = k;
    return PG_OK;
  }
  /* the template once around the whole text, as pg_tokenizer_encode puts it around its one text */
  if (k > SIZE_MAX / sizeof(int32_t) - t->ntmpl) {
    free(flat);
    return pg_fail("tokenizer: out of memory for %zu ids", k);
  }
  int32_t *r = malloc((k + t->ntmpl) * sizeof *r);
  if (!r) {
    free(flat);
    return pg_fail("tokenizer: out of memory for %zu ids", k + t->ntmpl);
  }
  size_t m = 0;
  for (size_t i = 0; i < t->ntmpl; i++) {
    if (t->tmpl[i] >= 0) {
      r[m++] = t->tmpl[i];
    } else if (k) {
      memcpy(r + m, flat, k * sizeof *r);
      m += k;
    }
  }
  free(flat);
  *ids = r, *nids = m;
  return PG_OK;
}

int pg_tokenizer_encode_file(const pg_tokenizer *t, const char *path, size_t chunk_bytes, int add_special,
                             int threads, int32_t **ids, size_t *nids) {
  *ids = NULL, *nids = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return pg_fail("encode_file: %s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb)) {
    int e = errno;
    close(fd);
    return pg_fail("encode_file: %s: %s", path, strerror(e));
  }
  if (!S_ISREG(sb.st_mode)) {
    close(fd);
    return pg_fail("encode_file: %s is not a regular file", path);
  }
  if ((uint64_t)sb.st_size > SIZE_MAX / 2) {
    close(fd);
    return pg_fail("encode_file: %s: %lld bytes do not fit the address space", path, (long long)sb.st_size);
  }
  size_t n = (size_t)sb.st_size;
  /* mapped, so that a file of many GB costs its ids' memory, not its own bytes twice */
  void *p = n ? mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  int e = errno;
  close(fd);
  if (n && p == MAP_FAILED) return pg_fail("encode_file: %s: cannot map %zu bytes: %s", path, n, strerror(e));
  if (n) (void)madvise(p, n, MADV_SEQUENTIAL);
  int rc = pg_tokenizer_encode_chunked(t, n ? p : "", n, chunk_bytes, add_special, threads, ids, nids);
  if (n) munmap(p, n);
  return rc;
}

void pg_tokenizer_regex_engine(char *buf, size_t n) {
  char ver[64] = "", target[128] = "";
  uint32_t jit = 0;
  pcre2_config(PCRE2_CONFIG_VERSION, ver);
  pcre2_config(PCRE2_CONFIG_JIT, &jit);
  if (jit) pcre2_config(PCRE2_CONFIG_JITTARGET, target);
  if (jit) snprintf(buf, n, "PCRE2 %s, JIT %s", ver, target);
  else snprintf(buf, n, "PCRE2 %s, no JIT: interpreted", ver);
}
