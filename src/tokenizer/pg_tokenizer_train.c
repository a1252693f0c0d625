/* pg_tokenizer_train: byte-level BPE training with the merges Hugging Face
 * `tokenizers`' BpeTrainer (tokenizers/src/models/bpe/trainer.rs) gives on the
 * same files and settings (pg_tokenizer.h, the training section, has the API).
 *
 * What BpeTrainer does, and so what this does, step by step:
 *   1. Tokenizer::train_from_files reads every file line by line, each line
 *      with its '\n' ending (only '\n' ends a line), and pre-tokenizes each
 *      line on its own; the trainer counts the distinct pre-tokens ("words").
 *      Here the lines are read in pieces of the files by `threads` OpenMP
 *      threads, each with its own word -> count map, merged at the end, so
 *      memory follows the distinct words (times the threads while counting)
 *      and the longest line, never the corpus.
 *   2. The vocabulary starts with the special tokens (in order, each once),
 *      then the alphabet: every character of the words plus the initial
 *      alphabet (here always the 256 byte-level characters, as
 *      ByteLevelBPETokenizer passes them), sorted by code point, a character
 *      that is already a special token keeping the special's id.
 *   3. Pair counts over the words (count-weighted) and, for every pair, the
 *      set of words holding it; a max-heap of entries (count, pair, words).
 *   4. Until the vocabulary has vocab_size tokens: pop the top entry; if its
 *      count is stale, put it back with the current count; stop when the
 *      count is below 1 or below min_frequency; else the pair becomes a merge
 *      (its token, the two concatenated, reuses an id when it already
 *      exists), is merged left to right, non-overlapping, in the entry's
 *      words, and the pair counts change by each word's count; every pair
 *      newly formed gets a new heap entry with the words it was formed in.
 *      As in BpeTrainer, the merged pair's own count is left as it was.
 *   Order: higher count first; on equal counts the smaller pair of ids
 *   (left id, then right id) first, BpeTrainer's rule. Two entries can only
 *   compare equal when they are the same pair with the same count (which
 *   BpeTrainer leaves to its heap's layout and hash order); here the one
 *   pushed first wins, and the entries of one step are pushed in pair order,
 *   so the result never depends on the threads or the order of the words.
 *   The merges written are BpeTrainer's model's: a pair merged twice (a token
 *   made again from other parts) keeps its later rank.
 * Counts are 64-bit (BpeTrainer's pair counts are 32-bit: equal below 2^31).
 * Invalid UTF-8, which train_from_files refuses, is counted as the
 * pre-tokenizer defines it (pg_tokenizer.h): its bytes are pre-tokens of
 * their own, mapped to byte-level characters like any byte. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "pg_error.h"
#include "pg_tokenizer.h"

/* ---- checked growth ---- */

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return PG_OK;
  size_t c = *cap ? *cap : 16;
  while (c < need) {
    if (c > SIZE_MAX / 2) return pg_fail("tokenizer.train: out of memory (%zu elements)", need);
    c *= 2;
  }
  if (c > SIZE_MAX / elem) return pg_fail("tokenizer.train: out of memory (%zu elements)", need);
  void *q = realloc(*p, c * elem);
  if (!q) return pg_fail("tokenizer.train: out of memory (%zu bytes)", c * elem);
  *p = q;
  *cap = c;
  return PG_OK;
}
#define GROW(ptr, cap, need) grow((void **)&(ptr), &(cap), (need), sizeof *(ptr))

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- byte string -> u64 (word counts, the vocabulary); strings in one arena ---- */

typedef struct {
  uint64_t h, val;
  size_t off;
  uint32_t len;
} sentry;

typedef struct {
  sentry *e;
  size_t n, ecap;
  uint32_t *slot; /* entry index + 1, 0 empty */
  size_t nslot;   /* a power of two, at least twice n */
  char *arena;
  size_t an, acap;
} smap;

static void smap_free(smap *m) { free(m->e), free(m->slot), free(m->arena); }

static int smap_rehash(smap *m, size_t nslot) {
  uint32_t *s = calloc(nslot, sizeof *s);
  if (!s) return pg_fail("tokenizer.train: out of memory for %zu words", m->n);
  for (size_t k = 0; k < m->n; k++) {
    size_t i = m->e[k].h & (nslot - 1);
    while (s[i]) i = (i + 1) & (nslot - 1);
    s[i] = (uint32_t)k + 1;
  }
  free(m->slot);
  m->slot = s, m->nslot = nslot;
  return PG_OK;
}

/* The entry of s (created with val 0 when absent). */
static sentry *smap_at(smap *m, const char *s, size_t n, uint64_t h) {
  if (n > UINT32_MAX || m->n >= UINT32_MAX - 1) return pg_fail_null("tokenizer.train: a word of %zu bytes, or too many words", n);
  if ((m->n + 1) * 2 > m->nslot && smap_rehash(m, m->nslot ? m->nslot * 2 : 1024)) return NULL;
  size_t i = h & (m->nslot - 1);
  for (;; i = (i + 1) & (m->nslot - 1)) {
    uint32_t k = m->slot[i];
    if (!k) break;
    sentry *e = &m->e[k - 1];
    if (e->h == h && e->len == n && !memcmp(m->arena + e->off, s, n)) return e;
  }
  if (GROW(m->e, m->ecap, m->n + 1)) return NULL;
  if (n > SIZE_MAX - m->an - 1 || GROW(m->arena, m->acap, m->an + n + 1)) return pg_fail_null("tokenizer.train: out of memory");
  memcpy(m->arena + m->an, s, n);
  m->e[m->n] = (sentry){h, 0, m->an, (uint32_t)n};
  m->an += n;
  m->slot[i] = (uint32_t)++m->n;
  return &m->e[m->n - 1];
}

/* ---- pair (left id, right id) -> dense index ---- */

typedef struct {
  uint64_t *key; /* UINT64_MAX empty */
  uint32_t *idx;
  size_t n, nslot;
} pmap;

static inline uint64_t pkey(uint32_t a, uint32_t b) { return ((uint64_t)a << 32) | b; }

static size_t pmap_slot(const pmap *m, uint64_t key) {
  uint64_t h = key * 0x9E3779B97F4A7C15ull;
  size_t i = (h >> 20) & (m->nslot - 1);
  while (m->key[i] != UINT64_MAX && m->key[i] != key) i = (i + 1) & (m->nslot - 1);
  return i;
}

/* The pair's index, a new one (*fresh = 1, index m->n - 1) when absent. */
static int pmap_index(pmap *m, uint64_t key, uint32_t *idx, int *fresh) {
  if ((m->n + 1) * 2 > m->nslot) {
    size_t ns = m->nslot ? m->nslot * 2 : 4096;
    pmap g = {malloc(ns * sizeof(uint64_t)), malloc(ns * sizeof(uint32_t)), m->n, ns};
    if (!g.key || !g.idx) {
      free(g.key), free(g.idx);
      return pg_fail("tokenizer.train: out of memory for %zu pairs", m->n);
    }
    memset(g.key, 0xff, ns * sizeof(uint64_t));
    for (size_t i = 0; i < m->nslot; i++) {
      if (m->key[i] == UINT64_MAX) continue;
      size_t at = pmap_slot(&g, m->key[i]);
      g.key[at] = m->key[i], g.idx[at] = m->idx[i];
    }
    free(m->key), free(m->idx);
    *m = g;
  }
  size_t at = pmap_slot(m, key);
  *fresh = m->key[at] == UINT64_MAX;
  if (*fresh) {
    if (m->n >= UINT32_MAX) return pg_fail("tokenizer.train: too many pairs");
    m->key[at] = key, m->idx[at] = (uint32_t)m->n++;
  }
  *idx = m->idx[at];
  return PG_OK;
}

/* ---- progress (stderr) ---- */

typedef struct {
  int on;
  double last;
} progress_t;

static void progress_show(progress_t *p, const char *what, double done, double total, const char *unit, int final) {
  if (!p->on) return;
  double t = now_s();
  if (!final && t - p->last < 0.1) return;
  p->last = t;
  double f = total > 0 ? done / total : 1;
  if (f > 1) f = 1;
  char bar[31];
  int fill = (int)(f * 30);
  for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
  bar[30] = 0;
  int prec = total < 100 ? 1 : 0; /* MB of a small corpus */
  fprintf(stderr, "\rtokenizer.train: %-8s [%s] %3d%% %.*f/%.*f %s%s", what, bar, (int)(f * 100), prec, done, prec, total,
          unit, final ? "\n" : "");
  fflush(stderr);
}

/* ---- 1. counting the words ---- */

typedef struct {
  int file;
  off_t start, end;
} piece_t;

typedef struct {
  smap words;
  uint64_t npre;
} counter_t;

static int count_word(void *ud, const char *s, size_t n, int32_t added) {
  counter_t *c = ud;
  if (added >= 0 || n == 0) return PG_OK;
  sentry *e = smap_at(&c->words, s, n, pg_tok_hash_bytes(s, n));
  if (!e) return PG_ERR;
  e->val++;
  c->npre++;
  return PG_OK;
}

/* The lines that start in [p->start, p->end) of the file: a line belongs to the piece holding its first byte. */
static int count_piece(const pg_tokenizer *pre, pg_tok_state *st, const char *path, const piece_t *p, counter_t *c,
                       char **line, size_t *cap) {
  FILE *f = fopen(path, "rb");
  if (!f) return pg_fail("tokenizer.train: cannot open '%s': %s", path, strerror(errno));
  int rc = PG_OK;
  off_t pos = p->start;
  if (p->start > 0) {
    /* the rest of the line holding byte start - 1 is the previous piece's (just "\n" when a line ends there) */
    if (fseeko(f, p->start - 1, SEEK_SET)) {
      rc = pg_fail("tokenizer.train: cannot seek in '%s': %s", path, strerror(errno));
      goto done;
    }
    ssize_t k = getline(line, cap, f);
    if (k <= 0) goto done;
    pos = p->start - 1 + k;
  }
  while (pos < p->end) {
    errno = 0;
    ssize_t k = getline(line, cap, f);
    if (k < 0) {
      if (ferror(f)) rc = pg_fail("tokenizer.train: reading '%s' failed: %s", path, strerror(errno ? errno : EIO));
      break;
    }
    if (pg_tokenizer_pre_tokenize(pre, st, *line, (size_t)k, count_word, c)) {
      rc = PG_ERR;
      break;
    }
    pos += k;
  }
done:
  fclose(f);
  return rc;
}

static int build_pre_tokenizer(const pg_tok_train_opts *o, pg_tokenizer **out) {
  pg_tok_model m;
  memset(&m, 0, sizeof m);
  pg_tokenizer *t = pg_tokenizer_new(&m);
  if (!t) return PG_ERR;
  pg_tok_step s;
  if (o->pattern) {
    memset(&s, 0, sizeof s);
    s.kind = PG_TOK_SPLIT, s.pattern = o->pattern, s.pattern_len = o->pattern_len, s.regex = 1;
    s.behavior = PG_SPLIT_ISOLATED;
    if (pg_tokenizer_add_step(t, PG_TOK_PRE_TOKENIZER, &s)) goto fail;
  }
  memset(&s, 0, sizeof s);
  s.kind = PG_TOK_BYTELEVEL, s.use_regex = !o->pattern;
  if (pg_tokenizer_add_step(t, PG_TOK_PRE_TOKENIZER, &s) || pg_tokenizer_finish(t)) goto fail;
  *out = t;
  return PG_OK;
fail:
  pg_tokenizer_free(t);
  return PG_ERR;
}

static int count_words(const pg_tok_train_opts *o, int threads, progress_t *prog, smap *words, pg_tok_trained *r) {
  pg_tokenizer *pre = NULL;
  if (build_pre_tokenizer(o, &pre)) return PG_ERR;
  off_t total = 0;
  off_t *sizes = calloc(o->nfiles ? o->nfiles : 1, sizeof *sizes);
  piece_t *pieces = NULL;
  size_t npieces = 0, pcap = 0;
  counter_t *cs = calloc((size_t)threads, sizeof *cs);
  int rc = PG_ERR;
  if (!sizes || !cs) {
    pg_fail("tokenizer.train: out of memory");
    goto done;
  }
  for (size_t i = 0; i < o->nfiles; i++) {
    struct stat sb;
    FILE *f = fopen(o->files[i], "rb"); /* every file opens before any counting starts */
    if (!f || stat(o->files[i], &sb)) {
      pg_fail("tokenizer.train: cannot open '%s': %s", o->files[i], strerror(errno));
      if (f) fclose(f);
      goto done;
    }
    fclose(f);
    if (!S_ISREG(sb.st_mode)) {
      pg_fail("tokenizer.train: '%s' is not a regular file", o->files[i]);
      goto done;
    }
    sizes[i] = sb.st_size;
    total += sb.st_size;
  }
  /* pieces of 64 KB .. 16 MB, about 8 per thread over the whole corpus (so the threads stay busy) */
  off_t psize = total / ((off_t)threads * 8);
  if (psize < (1 << 16)) psize = 1 << 16;
  if (psize > (1 << 24)) psize = 1 << 24;
  if (o->piece_bytes) psize = (off_t)o->piece_bytes; /* the result never depends on it: the specs cut small pieces */
  for (size_t i = 0; i < o->nfiles; i++) {
    for (off_t s = 0; s < sizes[i]; s += psize) {
      if (GROW(pieces, pcap, npieces + 1)) goto done;
      pieces[npieces++] = (piece_t){(int)i, s, s + psize < sizes[i] ? s + psize : sizes[i]};
    }
  }
  double done_bytes = 0;
  int failed = 0;
  char errmsg[2048] = "";
#pragma omp parallel num_threads(threads)
  {
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    pg_tok_state *st = pg_tok_state_new(pre);
    char *line = NULL;
    size_t cap = 0;
    if (!st) {
#pragma omp critical(pg_tok_train_err)
      if (!failed) {
        snprintf(errmsg, sizeof errmsg, "%s", pg_error());
#pragma omp atomic write
        failed = 1;
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t k = 0; k < npieces; k++) {
      int stop;
#pragma omp atomic read
      stop = failed;
      if (stop || !st) continue;
      const piece_t *p = &pieces[k];
      if (count_piece(pre, st, o->files[p->file], p, &cs[me], &line, &cap)) {
#pragma omp critical(pg_tok_train_err)
        if (!failed) {
          snprintf(errmsg, sizeof errmsg, "%s", pg_error());
#pragma omp atomic write
          failed = 1;
        }
      }
#pragma omp atomic
      done_bytes += (double)(p->end - p->start);
      if (me == 0) {
        double d;
#pragma omp atomic read
        d = done_bytes;
        progress_show(prog, "counting", d / 1e6, (double)total / 1e6, "MB", 0);
      }
    }
    free(line);
    pg_tok_state_free(st);
  }
  if (failed) {
    pg_fail("%s", errmsg);
    goto done;
  }
  progress_show(prog, "counting", (double)total / 1e6, (double)total / 1e6, "MB", 1);
  /* the threads' maps into the first one (each freed once merged, so at most one extra map at a time) */
  *words = cs[0].words;
  memset(&cs[0].words, 0, sizeof cs[0].words);
  r->npretokens = cs[0].npre;
  for (int t = 1; t < threads; t++) {
    smap *m = &cs[t].words;
    r->npretokens += cs[t].npre;
    for (size_t k = 0; k < m->n; k++) {
      const sentry *e = &m->e[k];
      sentry *d = smap_at(words, m->arena + e->off, e->len, e->h);
      if (!d) goto done;
      d->val += e->val;
    }
    smap_free(m);
    memset(m, 0, sizeof *m);
  }
  r->nbytes = (uint64_t)total;
  rc = PG_OK;
done:
  if (cs)
    for (int t = 0; t < threads; t++) smap_free(&cs[t].words);
  free(cs), free(sizes), free(pieces);
  pg_tokenizer_free(pre);
  return rc;
}

/* ---- 3, 4. the merges ---- */

typedef struct {
  uint64_t count, seq;
  uint32_t a, b, entry;
} hitem;

/* higher count first; then the smaller pair; then the earlier push */
static inline int hbefore(const hitem *x, const hitem *y) {
  if (x->count != y->count) return x->count > y->count;
  if (x->a != y->a) return x->a < y->a;
  if (x->b != y->b) return x->b < y->b;
  return x->seq < y->seq;
}

typedef struct {
  hitem *v;
  size_t n, cap;
} heap_t;

static int heap_push(heap_t *h, hitem x) {
  if (GROW(h->v, h->cap, h->n + 1)) return PG_ERR;
  size_t i = h->n++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!hbefore(&x, &h->v[p])) break;
    h->v[i] = h->v[p];
    i = p;
  }
  h->v[i] = x;
  return PG_OK;
}

static hitem heap_pop(heap_t *h) {
  hitem top = h->v[0], x = h->v[--h->n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= h->n) break;
    if (c + 1 < h->n && hbefore(&h->v[c + 1], &h->v[c])) c++;
    if (!hbefore(&h->v[c], &x)) break;
    h->v[i] = h->v[c];
    i = c;
  }
  if (h->n) h->v[i] = x;
  return top;
}

typedef struct {
  uint32_t *pos; /* word indices (a set) */
  size_t n;
  int owned;
} entry_t;

typedef struct {
  uint64_t key;
  uint32_t word;
  int32_t delta;
} change_t;

typedef struct {
  change_t *v;
  size_t n, cap;
} changes_t;

static int change(changes_t *c, uint32_t a, uint32_t b, int32_t delta, uint32_t w) {
  if (GROW(c->v, c->cap, c->n + 1)) return PG_ERR;
  c->v[c->n++] = (change_t){pkey(a, b), w, delta};
  return PG_OK;
}

/* BpeTrainer's Word::merge: left to right, non-overlapping, the changes to the pair counts. */
static int merge_word(uint32_t *s, uint32_t *len, uint32_t c1, uint32_t c2, uint32_t rep, uint32_t w, changes_t *ch) {
  uint32_t n = *len, k = 0, j = 0;
  while (j < n) {
    if (s[j] == c1 && j + 1 < n && s[j + 1] == c2) {
      if (k > 0 && (change(ch, s[k - 1], c1, -1, w) || change(ch, s[k - 1], rep, 1, w))) return PG_ERR;
      if (j + 2 < n && (change(ch, c2, s[j + 2], -1, w) || change(ch, rep, s[j + 2], 1, w))) return PG_ERR;
      s[k++] = rep;
      j += 2;
    } else {
      s[k++] = s[j++];
    }
  }
  *len = k;
  return PG_OK;
}

static int cmp_change(const void *x, const void *y) {
  const change_t *a = x, *b = y;
  if (a->key != b->key) return a->key < b->key ? -1 : 1;
  return a->word < b->word ? -1 : a->word > b->word;
}

static int add_token(pg_tok_trained *r, smap *vocab, const char *s, size_t n, uint32_t *id) {
  sentry *e = smap_at(vocab, s, n, pg_tok_hash_bytes(s, n));
  if (!e) return PG_ERR;
  if (e->val) { /* val is id + 1 */
    *id = (uint32_t)(e->val - 1);
    return PG_OK;
  }
  if (r->ntokens >= PG_TOK_MAX_ID) return pg_fail("tokenizer.train: more than 2^24 tokens");
  if ((size_t)r->ntokens == r->tok_cap) {
    size_t c = r->tok_cap ? 2 * r->tok_cap : 1024; /* below 2^25: no overflow */
    size_t *off = realloc(r->off, c * sizeof *off);
    if (off) r->off = off;
    uint32_t *len = off ? realloc(r->len, c * sizeof *len) : NULL;
    if (!len) return pg_fail("tokenizer.train: out of memory for %zu tokens", c);
    r->len = len, r->tok_cap = c;
  }
  size_t need = r->text_n + n + 1;
  if (need > r->text_cap) {
    size_t c = r->text_cap ? r->text_cap : 4096;
    while (c < need) c *= 2;
    char *q = realloc(r->text, c);
    if (!q) return pg_fail("tokenizer.train: out of memory");
    r->text = q, r->text_cap = c;
  }
  memcpy(r->text + r->text_n, s, n);
  r->text[r->text_n + n] = 0;
  r->off[r->ntokens] = r->text_n;
  r->len[r->ntokens] = (uint32_t)n;
  r->text_n += n + 1;
  *id = (uint32_t)r->ntokens++;
  e->val = (uint64_t)*id + 1;
  return PG_OK;
}

/* GPT-2's bytes_to_unicode code point of byte b (pg_tokenizer.c's init_byte_level). */
static int byte_cp(int b, const int *nonprint_rank) {
  int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  return printable ? b : 256 + nonprint_rank[b];
}

static size_t put_utf8(char *o, int cp) {
  if (cp < 0x80) return o[0] = (char)cp, 1;
  o[0] = (char)(0xC0 | (cp >> 6)), o[1] = (char)(0x80 | (cp & 0x3F));
  return 2; /* the byte-level alphabet is below U+0800 */
}

/* 2. the special tokens, then the byte-level alphabet by code point; cp_id: code point -> token id */
static int init_vocab(const pg_tok_train_opts *o, pg_tok_trained *r, smap *vocab, uint32_t *cp_id) {
  for (size_t i = 0; i < o->nspecials; i++) {
    uint32_t id;
    if (!o->special_lens[i]) return pg_fail("tokenizer.train: special token %zu is empty", i + 1);
    if (add_token(r, vocab, o->specials[i], o->special_lens[i], &id)) return PG_ERR;
  }
  int rank[256], next = 0, bycp[324];
  for (int b = 0; b < 256; b++) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    rank[b] = printable ? -1 : next++;
  }
  for (int cp = 0; cp < 324; cp++) cp_id[cp] = UINT32_MAX, bycp[cp] = -1;
  for (int b = 0; b < 256; b++) bycp[byte_cp(b, rank)] = b;
  for (int cp = 0; cp < 324; cp++) {
    if (bycp[cp] < 0) continue;
    char u[2];
    size_t n = put_utf8(u, cp);
    if (add_token(r, vocab, u, n, &cp_id[cp])) return PG_ERR;
  }
  return PG_OK;
}

static int train_merges(const pg_tok_train_opts *o, int threads, progress_t *prog, smap *words, smap *vocab_in,
                        const uint32_t *cp_id, pg_tok_trained *r) {
  int rc = PG_ERR;
  smap vocab = *vocab_in; /* ours from here: freed below */
  memset(vocab_in, 0, sizeof *vocab_in);
  uint32_t *syms = NULL, *wlen = NULL, *block = NULL, *last = NULL;
  size_t *woff = NULL, *deg = NULL;
  uint64_t *wcount = NULL;
  int64_t *pc = NULL;
  size_t pccap = 0;
  pmap pairs = {0};
  heap_t heap = {0};
  entry_t *entries = NULL;
  size_t nentries = 0, ecap = 0;
  uint32_t *freed = NULL; /* entries merged (never referenced again): reused, so memory follows the live ones */
  size_t nfreed = 0, fcap = 0;
  changes_t *tch = calloc((size_t)threads, sizeof *tch);
  changes_t all = {0};
  uint32_t (*raw)[3] = NULL; /* every merge made: left, right, new id */
  size_t nraw = 0, rawcap = 0;
  uint64_t seq = 0;
  if (!tch) {
    pg_fail("tokenizer.train: out of memory");
    goto done;
  }
  /* words as symbol ids */
  size_t nw = words->n, nsym = 0;
  if (nw > UINT32_MAX - 1) {
    pg_fail("tokenizer.train: %zu distinct words (at most 2^32 - 2)", nw);
    goto done;
  }
  woff = malloc((nw + 1) * sizeof *woff);
  wlen = malloc((nw ? nw : 1) * sizeof *wlen);
  wcount = malloc((nw ? nw : 1) * sizeof *wcount);
  if (!woff || !wlen || !wcount) {
    pg_fail("tokenizer.train: out of memory for %zu words", nw);
    goto done;
  }
  for (size_t w = 0; w < nw; w++) nsym += words->e[w].len; /* at least one byte a symbol */
  syms = malloc((nsym ? nsym : 1) * sizeof *syms);
  if (!syms) {
    pg_fail("tokenizer.train: out of memory for %zu symbols", nsym);
    goto done;
  }
  nsym = 0;
  for (size_t w = 0; w < nw; w++) {
    const sentry *e = &words->e[w];
    const unsigned char *u = (const unsigned char *)words->arena + e->off;
    woff[w] = nsym;
    for (size_t i = 0; i < e->len;) {
      int cp;
      if (u[i] < 0x80) cp = u[i], i += 1;
      else cp = ((u[i] & 0x1F) << 6) | (u[i + 1] & 0x3F), i += 2; /* ByteLevel output: 1- and 2-byte characters only */
      syms[nsym++] = cp_id[cp];
    }
    wlen[w] = (uint32_t)(nsym - woff[w]);
    wcount[w] = e->val;
  }
  woff[nw] = nsym;
  smap_free(words);
  memset(words, 0, sizeof *words);
  r->nwords = nw;
  /* 3. pair counts, and the words of every pair (CSR: degrees, then the lists) */
  for (size_t w = 0; w < nw; w++) {
    const uint32_t *s = syms + woff[w];
    for (uint32_t i = 0; i + 1 < wlen[w]; i++) {
      uint32_t idx;
      int fresh;
      if (pmap_index(&pairs, pkey(s[i], s[i + 1]), &idx, &fresh)) goto done;
      if (fresh) {
        if (GROW(pc, pccap, pairs.n)) goto done;
        pc[idx] = 0;
      }
      pc[idx] += (int64_t)wcount[w];
    }
  }
  size_t np = pairs.n;
  deg = calloc(np + 1, sizeof *deg);
  last = malloc((np ? np : 1) * sizeof *last);
  if (!deg || !last) {
    pg_fail("tokenizer.train: out of memory for %zu pairs", np);
    goto done;
  }
  memset(last, 0xff, (np ? np : 1) * sizeof *last);
  size_t total_pos = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1) {
      block = malloc((total_pos ? total_pos : 1) * sizeof *block);
      if (!block) {
        pg_fail("tokenizer.train: out of memory");
        goto done;
      }
      size_t acc = 0;
      for (size_t p = 0; p < np; p++) {
        size_t d = deg[p];
        deg[p] = acc; /* now the fill cursor */
        acc += d;
      }
      memset(last, 0xff, np * sizeof *last);
    }
    for (size_t w = 0; w < nw; w++) {
      const uint32_t *s = syms + woff[w];
      for (uint32_t i = 0; i + 1 < wlen[w]; i++) {
        size_t at = pmap_slot(&pairs, pkey(s[i], s[i + 1]));
        uint32_t idx = pairs.idx[at];
        if (last[idx] == (uint32_t)w) continue;
        last[idx] = (uint32_t)w;
        if (pass == 0) deg[idx]++, total_pos++;
        else block[deg[idx]++] = (uint32_t)w;
      }
    }
  }
  if (GROW(entries, ecap, np + 1)) goto done;
  {
    /* entry p holds block[start(p) .. deg[p]) where start(p) = deg[p - 1] (the cursors ended at the next start) */
    for (size_t p = 0; p < np; p++) {
      size_t start = p ? deg[p - 1] : 0;
      entries[p] = (entry_t){block + start, deg[p] - start, 0};
    }
    nentries = np;
    /* initial pushes: every pair once, so their order decides no tie */
    for (size_t at = 0; at < pairs.nslot; at++) {
      if (pairs.key[at] == UINT64_MAX) continue;
      uint32_t idx = pairs.idx[at];
      if (pc[idx] <= 0) continue;
      hitem it = {(uint64_t)pc[idx], seq++, (uint32_t)(pairs.key[at] >> 32), (uint32_t)pairs.key[at], idx};
      if (heap_push(&heap, it)) goto done;
    }
  }
  free(last), last = NULL;
  /* 4. merges */
  while ((size_t)r->ntokens < (size_t)o->vocab_size && heap.n) {
    hitem top = heap_pop(&heap);
    uint32_t pidx = pairs.idx[pmap_slot(&pairs, pkey(top.a, top.b))];
    uint64_t real = pc[pidx] > 0 ? (uint64_t)pc[pidx] : 0;
    if (top.count != real) {
      top.count = real;
      top.seq = seq++;
      if (heap_push(&heap, top)) goto done;
      continue;
    }
    if (top.count < 1 || o->min_frequency > top.count) break;
    /* the new token: left + right */
    size_t la = r->len[top.a], lb = r->len[top.b];
    if (la + lb > UINT32_MAX - 1) {
      pg_fail("tokenizer.train: a token of %zu bytes", la + lb);
      goto done;
    }
    char *tmp = malloc(la + lb + 1);
    if (!tmp) {
      pg_fail("tokenizer.train: out of memory");
      goto done;
    }
    memcpy(tmp, r->text + r->off[top.a], la);
    memcpy(tmp + la, r->text + r->off[top.b], lb);
    uint32_t nid;
    int bad = add_token(r, &vocab, tmp, la + lb, &nid);
    free(tmp);
    if (bad) goto done;
    if (GROW(raw, rawcap, nraw + 1)) goto done;
    raw[nraw][0] = top.a, raw[nraw][1] = top.b, raw[nraw][2] = nid;
    nraw++;
    /* merge it in the entry's words: in parallel when there are many (each word is in the set once) */
    entry_t *en = &entries[top.entry];
    int fail = 0;
    for (int t = 0; t < threads; t++) tch[t].n = 0;
    int nth = en->n >= 2048 ? threads : 1;
#pragma omp parallel for num_threads(nth) schedule(static) reduction(| : fail)
    for (size_t k = 0; k < en->n; k++) {
      int me = 0;
#ifdef _OPENMP
      me = omp_get_thread_num();
#endif
      uint32_t w = en->pos[k];
      if (merge_word(syms + woff[w], &wlen[w], top.a, top.b, nid, w, &tch[me])) fail = 1;
    }
    if (fail) goto done;
    if (en->owned) free(en->pos);
    en->pos = NULL, en->n = 0, en->owned = 0;
    if (GROW(freed, fcap, nfreed + 1)) goto done;
    freed[nfreed++] = top.entry;
    /* the counts change; the pairs newly formed, with their words, in pair order */
    all.n = 0;
    for (int t = 0; t < threads; t++) {
      for (size_t k = 0; k < tch[t].n; k++) {
        const change_t *c = &tch[t].v[k];
        uint32_t idx;
        int fresh;
        if (pmap_index(&pairs, c->key, &idx, &fresh)) goto done;
        if (fresh) {
          if (GROW(pc, pccap, pairs.n)) goto done;
          pc[idx] = 0;
        }
        pc[idx] += (int64_t)c->delta * (int64_t)wcount[c->word];
        if (c->delta > 0) {
          if (GROW(all.v, all.cap, all.n + 1)) goto done;
          all.v[all.n++] = *c;
        }
      }
    }
    if (all.n) qsort(all.v, all.n, sizeof *all.v, cmp_change); /* all.v is NULL until a first change */
    for (size_t k = 0; k < all.n;) {
      size_t e = k;
      while (e < all.n && all.v[e].key == all.v[k].key) e++;
      uint32_t idx = pairs.idx[pmap_slot(&pairs, all.v[k].key)];
      if (pc[idx] > 0) {
        uint32_t *pos = malloc((e - k) * sizeof *pos);
        if (!pos || (!nfreed && (nentries >= UINT32_MAX || GROW(entries, ecap, nentries + 1)))) {
          free(pos);
          pg_fail("tokenizer.train: out of memory for the pair entries");
          goto done;
        }
        size_t n = 0;
        for (size_t i = k; i < e; i++)
          if (!n || pos[n - 1] != all.v[i].word) pos[n++] = all.v[i].word;
        uint32_t slot = nfreed ? freed[--nfreed] : (uint32_t)nentries++;
        entries[slot] = (entry_t){pos, n, 1};
        hitem it = {(uint64_t)pc[idx], seq++, (uint32_t)(all.v[k].key >> 32), (uint32_t)all.v[k].key, slot};
        if (heap_push(&heap, it)) goto done;
      }
      k = e;
    }
    progress_show(prog, "merges", (double)r->ntokens, (double)o->vocab_size, "tokens", 0);
  }
  progress_show(prog, "merges", (double)r->ntokens, (double)o->vocab_size, "tokens", 1);
  /* the model's merges: each pair once, at its last rank */
  {
    pmap seen = {0};
    r->merges = malloc((nraw ? nraw : 1) * sizeof *r->merges);
    if (!r->merges) {
      pg_fail("tokenizer.train: out of memory");
      goto done;
    }
    size_t n = 0;
    for (size_t i = nraw; i-- > 0;) {
      uint32_t idx;
      int fresh;
      if (pmap_index(&seen, pkey(raw[i][0], raw[i][1]), &idx, &fresh)) {
        free(seen.key), free(seen.idx);
        goto done;
      }
      if (fresh) r->merges[n][0] = (int32_t)raw[i][0], r->merges[n][1] = (int32_t)raw[i][1], n++;
    }
    free(seen.key), free(seen.idx);
    for (size_t i = 0; i < n / 2; i++) {
      int32_t a = r->merges[i][0], b = r->merges[i][1];
      r->merges[i][0] = r->merges[n - 1 - i][0], r->merges[i][1] = r->merges[n - 1 - i][1];
      r->merges[n - 1 - i][0] = a, r->merges[n - 1 - i][1] = b;
    }
    r->nmerges = n;
    r->nmerges_made = nraw;
  }
  rc = PG_OK;
done:
  smap_free(&vocab);
  free(syms), free(wlen), free(woff), free(wcount), free(block), free(deg), free(last), free(pc);
  free(pairs.key), free(pairs.idx);
  free(heap.v);
  for (size_t i = 0; i < nentries; i++)
    if (entries[i].owned) free(entries[i].pos);
  free(entries), free(freed);
  if (tch)
    for (int t = 0; t < threads; t++) free(tch[t].v);
  free(tch), free(all.v), free(raw);
  return rc;
}

int pg_tokenizer_train(const pg_tok_train_opts *o, pg_tok_trained *r) {
  memset(r, 0, sizeof *r);
  if (!o->nfiles) return pg_fail("tokenizer.train: no files");
  if (o->vocab_size < 0 || o->vocab_size > PG_TOK_MAX_ID)
    return pg_fail("tokenizer.train: vocab_size %ld is outside [0, 2^24]", (long)o->vocab_size);
  int threads = o->threads;
#ifdef _OPENMP
  if (threads <= 0) threads = omp_get_max_threads();
#else
  threads = 1;
#endif
  if (threads < 1) threads = 1;
  if (threads > 1024) threads = 1024;
  progress_t prog = {o->progress, 0};
  smap words, vocab;
  memset(&words, 0, sizeof words);
  memset(&vocab, 0, sizeof vocab);
  uint32_t cp_id[324];
  if (init_vocab(o, r, &vocab, cp_id)) goto fail;
  if ((size_t)o->vocab_size < (size_t)r->ntokens) {
    pg_fail("tokenizer.train: vocab_size %ld is below the %ld special tokens and byte-level characters it starts with",
            (long)o->vocab_size, (long)r->ntokens);
    goto fail;
  }
  double t0 = now_s();
  if (count_words(o, threads, &prog, &words, r)) goto fail;
  double t1 = now_s();
  r->count_s = t1 - t0;
  int rc = train_merges(o, threads, &prog, &words, &vocab, cp_id, r);
  smap_free(&words);
  smap_free(&vocab);
  r->merge_s = now_s() - t1;
  if (rc) pg_tok_trained_free(r);
  return rc;
fail:
  smap_free(&words);
  smap_free(&vocab);
  pg_tok_trained_free(r);
  return PG_ERR;
}

void pg_tok_trained_free(pg_tok_trained *r) {
  free(r->text), free(r->off), free(r->len), free(r->merges);
  memset(r, 0, sizeof *r);
}
