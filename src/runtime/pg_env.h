/* pg_env: the environment variables pipegoose reads, and their one parser.
 *
 * Every variable is listed once, in pg_env.c's table, with its type, range
 * and default; a value that is not one of its type is an error
 * "NAME: expected <what>, got '<value>'" (never read as something else: atof
 * of "soon" is 0, a choice misspelt is not the default). An unset or empty
 * variable is its default. pglua checks every listed variable at start-up
 * (pg_env_check_all), before it starts anything; the Lua core module does the
 * same when it loads, so a plain `lua` sees the same refusals. Lua reads
 * values through pg.core.env(name), the same parser.
 *
 * Types: a number (double, with a range), an integer (long, with a range),
 * a boolean (1/0, true/false, yes/no, on/off), a choice (one of a list of
 * words), a thread count (a positive integer, or OpenMP's comma list of them:
 * the first is this level's), a file name (any text without a newline). */
#ifndef PG_ENV_H
#define PG_ENV_H

/* Each returns PG_OK with *out (the default when unset or empty), or PG_ERR
 * (pg_error: the variable, what it expects, the value). `name` must be one
 * of the table's, of that type (else PG_ERR naming the mistake). */
int pg_env_double(const char *name, double *out);
int pg_env_long(const char *name, long *out);
int pg_env_bool(const char *name, int *out);
/* *out: the chosen word (a static string of the table), the default when unset */
int pg_env_choice(const char *name, const char **out);

/* *out: the file name (the environment's string), NULL when unset or empty */
int pg_env_path(const char *name, const char **out);
/* Checks every variable of the table; PG_ERR names the first bad one. */
int pg_env_check_all(void);

/* The table's entries, for the Lua binding: the i-th name (NULL past the end)
 * and its type: 'd' number, 'l' integer or thread count, 'b' boolean, 'c' choice, 'p' file name. */
const char *pg_env_name(int i, char *type);

#endif
