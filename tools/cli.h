/* What every gpumem command reads the same way: the configuration (the
 * GPUMEM_CONF environment variable first, then --conf, then the explicit
 * flags, each later one winning key by key) and sizes typed on the command
 * line. Kept in one place so that replay, summary, explain, leaks, fit,
 * report, top and run cannot drift apart. */
#ifndef GPUMEM_TOOLS_CLICONF_H
#define GPUMEM_TOOLS_CLICONF_H

#include <stddef.h>

#include "gpumem.h"

/* GPUMEM_CONF from the environment, or NULL when unset or empty. */
const char* cli_env_conf(void);

/* 0 when GPUMEM_CONF is unset or parses as the library reads it; else
 * prints "gpumem: bad GPUMEM_CONF '...': why" on stderr and returns 1. */
int cli_check_env_conf(void);

/* GPUMEM_CONF and then conf (either may be NULL) joined into out as one
 * configuration string, so that conf's keys override the environment's.
 * -1 (nothing written) when they do not fit in cap. */
int cli_join_conf(const char* conf, char* out, size_t cap);

/* Calls fn for each key of conf (as written, trimmed); stops at and returns
 * the first nonzero value fn returns. */
int cli_each_key(const char* conf, int (*fn)(const char* key, size_t len, void* arg), void* arg);

/* Whether conf names key (any case). */
int cli_conf_has(const char* conf, const char* key);

/* 0 when neither GPUMEM_CONF nor conf (--conf) holds record; else prints
 * why and returns 1. In a command that replays a trace, record would
 * write the replay itself as a trace, over the recording being read when
 * the paths are the same. */
int cli_refuse_record(const char* conf);

/* A size typed on the command line (option names it, e.g. "--limit"): as
 * gpumem_parse_size, but a number without a unit is refused ("80" would be
 * 80 bytes, almost never what was meant; "80B" says so). On failure
 * gpumem_last_error() holds the whole message, starting with the option. */
gpumem_status_t cli_parse_size(const char* option, const char* text, size_t* out);

/* The size-valued keys of a configuration string typed on the command line
 * must carry a unit too; GPUMEM_ERR_CONFIG with the message otherwise. */
gpumem_status_t cli_check_conf_units(const char* option, const char* conf);

#endif
