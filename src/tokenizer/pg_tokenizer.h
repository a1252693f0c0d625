/* pg_tokenizer: Hugging Face `tokenizer.json` tokenizers (BPE) in C.
 *
 * lua/pipegoose/tokenizer.lua reads and validates the JSON file and builds a
 * tokenizer through this builder API; training (to come) builds one the same
 * way from the vocabulary and merges it produces, and reuses the
 * pre-tokenizer through pg_tokenizer_pre_tokenize.
 *
 * Encoding follows `tokenizers` step by step, because the ids must be equal:
 *   1. the text is split around added tokens that match the raw text
 *      (normalized=false), leftmost-longest, with single_word/lstrip/rstrip;
 *   2. every other piece goes through the normalizers (NFC, NFKC, Prepend,
 *      Replace) and is split again around the normalized added tokens;
 *   3. the pre-tokenizers (ByteLevel, Split, Metaspace, Digits) split and map
 *      the pieces; PCRE2 (JIT, UTF, Unicode properties) runs their regexes;
 *   4. the BPE model merges each pre-token by rank (a binary heap over the
 *      adjacent pairs, so a long pre-token is n log n, never quadratic),
 *      with byte_fallback, unk_token/fuse_unk and ignore_merges; results of
 *      short pre-tokens are cached;
 *   5. with add_special, the TemplateProcessing ids are put around them.
 * Decoding maps ids to tokens (added tokens first) and runs the decoders
 * (ByteLevel, ByteFallback, Metaspace, Replace, Fuse, Strip).
 *
 * Text is bytes. Invalid UTF-8 has a defined result (tokenizers cannot be
 * given it): the regexes run with PCRE2_MATCH_INVALID_UTF, where an invalid
 * byte matches nothing, so a run of them ends up a pre-token of its own; the
 * byte-level alphabet maps every byte, byte_fallback gives each one its
 * <0xXX> token, and NFC/NFKC leave such bytes as they are. Decoders turn
 * invalid UTF-8 into U+FFFD as `tokenizers` does (one per maximal ill-formed
 * subsequence for ByteLevel, one per byte for ByteFallback).
 *
 * Not thread-safe on one pg_tok_state; a state per thread encodes in
 * parallel with one tokenizer (which is read-only once finished). */
#ifndef PG_TOKENIZER_H
#define PG_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct pg_tokenizer pg_tokenizer;
typedef struct pg_tok_state pg_tok_state;

/* Ids are below this (a vocabulary of 16M entries): the id -> token table
 * is an array, and an id from a corrupt file must not size it. */
#define PG_TOK_MAX_ID ((int32_t)1 << 24)

typedef enum {
  /* normalizers */
  PG_TOK_NFC = 1,
  PG_TOK_NFKC,
  PG_TOK_PREPEND, /* content: prepended to a non-empty piece */
  PG_TOK_REPLACE, /* pattern (literal or regex) -> content; also a decoder */
  /* pre-tokenizers */
  PG_TOK_BYTELEVEL, /* add_prefix_space, use_regex (GPT-2's pattern); also a decoder */
  PG_TOK_SPLIT,     /* pattern, behavior, invert */
  PG_TOK_METASPACE, /* content = replacement, prepend_scheme, split; also a decoder */
  PG_TOK_DIGITS,    /* individual_digits */
  /* decoders only */
  PG_TOK_BYTEFALLBACK,
  PG_TOK_FUSE,
  PG_TOK_STRIP, /* content (one character), start, stop */
} pg_tok_kind;

typedef enum { PG_TOK_NORMALIZER, PG_TOK_PRE_TOKENIZER, PG_TOK_DECODER } pg_tok_stage;

/* Split behaviors, as tokenizers' SplitDelimiterBehavior. */
enum { PG_SPLIT_REMOVED, PG_SPLIT_ISOLATED, PG_SPLIT_MERGED_WITH_PREVIOUS, PG_SPLIT_MERGED_WITH_NEXT, PG_SPLIT_CONTIGUOUS };
/* Metaspace prepend schemes. */
enum { PG_PREPEND_ALWAYS, PG_PREPEND_FIRST, PG_PREPEND_NEVER };

typedef struct {
  pg_tok_kind kind;
  const char *pattern; /* Replace, Split: the pattern's bytes */
  size_t pattern_len;
  int regex;           /* the pattern is a PCRE2 regex (else a literal string) */
  const char *content; /* Prepend, Replace, Metaspace (replacement), Strip */
  size_t content_len;
  int behavior, invert;            /* Split */
  int add_prefix_space, use_regex; /* ByteLevel */
  int prepend_scheme, split;       /* Metaspace */
  int individual_digits;           /* Digits */
  int start, stop;                 /* Strip */
} pg_tok_step;

typedef struct {
  int byte_fallback, fuse_unk, ignore_merges;
  const char *unk_token; /* NULL: none */
  size_t unk_len;
} pg_tok_model;

/* Added-token flags. */
enum { PG_TOK_SPECIAL = 1, PG_TOK_LSTRIP = 2, PG_TOK_RSTRIP = 4, PG_TOK_SINGLE_WORD = 8, PG_TOK_NORMALIZED = 16 };

/* Building: new, then vocabulary, merges (in rank order), added tokens,
 * steps and template in any order, then finish. Every call copies what it
 * is given. A failed call leaves the message in pg_error(); free the
 * tokenizer then. */
pg_tokenizer *pg_tokenizer_new(const pg_tok_model *model);
int pg_tokenizer_add_token(pg_tokenizer *t, const char *s, size_t n, int32_t id);
/* The merge a + b, of rank = the number of merges added before it. Both and
 * their concatenation must be in the vocabulary (added before). A pair given
 * twice keeps the later rank, as tokenizers does. */
int pg_tokenizer_add_merge(pg_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen);
int pg_tokenizer_add_added(pg_tokenizer *t, const char *s, size_t n, int32_t id, unsigned flags);
int pg_tokenizer_add_step(pg_tokenizer *t, pg_tok_stage stage, const pg_tok_step *step);
/* Single-sequence template: ids, with -1 where the text's ids go. */
int pg_tokenizer_set_template(pg_tokenizer *t, const int32_t *items, size_t n);
int pg_tokenizer_finish(pg_tokenizer *t);
void pg_tokenizer_free(pg_tokenizer *t);

/* A per-thread scratch (regex match data, JIT stack, the pre-token cache). */
pg_tok_state *pg_tok_state_new(const pg_tokenizer *t);
void pg_tok_state_free(pg_tok_state *st);

/* Encodes n bytes of text: *ids (malloc'd, free() it) holds *nids ids. */
int pg_tokenizer_encode(const pg_tokenizer *t, pg_tok_state *st, const char *text, size_t n, int add_special,
                        int32_t **ids, size_t *nids);

/* Multi-threaded encoding. threads <= 0 means omp_get_max_threads(); each
 * thread makes a pg_tok_state of its own for the call, so the ids are
 * exactly pg_tokenizer_encode's, whatever the thread count. */

/* Encodes n texts (texts[i], lens[i] bytes): *ids (malloc'd, free() it)
 * holds them all, text i's at [offsets[i], offsets[i + 1]); offsets has
 * n + 1 entries (the caller's). On failure *ids is NULL and the message is
 * that of the first text that failed, which it names. */
int pg_tokenizer_encode_batch(const pg_tokenizer *t, const char *const *texts, const size_t *lens, size_t n,
                              int add_special, int threads, int32_t **ids, size_t *offsets);

/* What encode_chunked cuts at when chunk_bytes is 0. */
#define PG_TOK_CHUNK_BYTES ((size_t)256 * 1024)

/* One long text in chunks, encoded in parallel: a cut goes after the first
 * newline that is followed by an ASCII letter or digit at or past every
 * chunk_bytes from the last cut, so the chunks depend on the text and
 * chunk_bytes only (never on the thread count). The ids are each chunk's
 * pg_tokenizer_encode without special tokens, in order; with add_special
 * the template's special tokens go once around all of them. Where no
 * pre-token can span such a cut and nothing is added at a piece's start
 * (GPT-2's, Llama 3's and cl100k's layouts) that is the whole text's
 * encoding; with a Prepend normalizer, add_prefix_space, a Metaspace that
 * prepends, or no pre-tokenizer it is each chunk's as a text of its own. */
int pg_tokenizer_encode_chunked(const pg_tokenizer *t, const char *text, size_t n, size_t chunk_bytes,
                                int add_special, int threads, int32_t **ids, size_t *nids);
/* The same on a file's bytes (mapped, not read into memory). */
int pg_tokenizer_encode_file(const pg_tokenizer *t, const char *path, size_t chunk_bytes, int add_special,
                             int threads, int32_t **ids, size_t *nids);

/* The regex engine the pre-tokenizers run on, for reports ("PCRE2 10.42,
 * JIT x86 64bit (little endian + unaligned)" or "..., no JIT: interpreted"). */
void pg_tokenizer_regex_engine(char *buf, size_t n);
/* Decodes ids into *out (malloc'd, NUL-terminated, *len bytes). An id with
 * no token is an error naming it (tokenizers drops it silently). */
int pg_tokenizer_decode(const pg_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **out,
                        size_t *len);
/* Steps 1-3 of encoding: calls fn for every pre-token the model would see
 * (in order; added tokens are passed with their id, others with -1). For
 * training's counting. */
typedef int (*pg_tok_piece_fn)(void *ud, const char *s, size_t n, int32_t added_id);
int pg_tokenizer_pre_tokenize(const pg_tokenizer *t, pg_tok_state *st, const char *text, size_t n,
                              pg_tok_piece_fn fn, void *ud);

/* 1 + the largest id of the vocabulary and the added tokens (what an
 * embedding needs). */
int32_t pg_tokenizer_vocab_size(const pg_tokenizer *t);
/* -1 when s is no token (added tokens first, then the vocabulary). */
int32_t pg_tokenizer_token_to_id(const pg_tokenizer *t, const char *s, size_t n);
/* NULL when id has no token. */
const char *pg_tokenizer_id_to_token(const pg_tokenizer *t, int32_t id, size_t *len);
int pg_tokenizer_is_special(const pg_tokenizer *t, int32_t id);

/* A 64-bit hash of n bytes, for the tokenizer's and the trainer's string maps. */
uint64_t pg_tok_hash_bytes(const void *p, size_t n);

/* ---- training (src/tokenizer/pg_tokenizer_train.c) ----
 * A byte-level BPE trained on files with the merges of `tokenizers`'
 * BpeTrainer (that file's comment has its rules, and the tie rule): each
 * line (with its '\n') pre-tokenized by GPT-2's ByteLevel regex, or by a
 * Split(pattern, Isolated) then ByteLevel without its regex; the vocabulary
 * is the special tokens (ids 0..), the 256 byte-level characters by code
 * point, then one token a merge. Counting runs on `threads` OpenMP threads
 * (<= 0: OpenMP's default); memory follows the distinct pre-tokens and the
 * longest line, not the corpus. */
typedef struct {
  const char *const *files;
  size_t nfiles;
  int32_t vocab_size; /* at least the specials + 256 */
  const char *const *specials; /* special tokens, in id order (a repeat is dropped) */
  const size_t *special_lens;
  size_t nspecials;
  const char *pattern; /* a PCRE2 regex; NULL: GPT-2's ByteLevel pre-tokenizer */
  size_t pattern_len;
  uint64_t min_frequency; /* a pair seen fewer times is never merged */
  int threads;
  int progress; /* draw a progress bar on stderr */
  size_t piece_bytes; /* the files are counted in pieces of this many bytes (0: 64 KB .. 16 MB, by size) */
} pg_tok_train_opts;

typedef struct {
  char *text;            /* the tokens' bytes, each NUL-terminated */
  size_t text_n, text_cap;
  size_t *off;           /* [ntokens] token id -> offset in text */
  uint32_t *len;         /* [ntokens] its length */
  int32_t ntokens;
  size_t tok_cap;
  int32_t (*merges)[2];  /* (left id, right id) in rank order, each pair once (its last rank) */
  size_t nmerges, nmerges_made; /* made: with the repeats BpeTrainer makes too */
  size_t nwords;         /* distinct pre-tokens */
  uint64_t npretokens, nbytes;
  double count_s, merge_s;
} pg_tok_trained;

/* Trains into *r (free it with pg_tok_trained_free; on failure it is empty). */
int pg_tokenizer_train(const pg_tok_train_opts *o, pg_tok_trained *r);
void pg_tok_trained_free(pg_tok_trained *r);

#endif
