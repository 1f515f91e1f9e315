/* Configuration and sizes as every gpumem command reads them (cliconf.h). */
#include "cliconf.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

const char* cli_env_conf(void) {
  const char* env = getenv("GPUMEM_CONF");
  return env && env[0] ? env : NULL;
}

int cli_check_env_conf(void) {
  const char* env = cli_env_conf();
  if (!env) return 0;
  gpumem_options_t opts;
  gpumem_options_init(&opts);
  if (gpumem_options_parse(&opts, env) == GPUMEM_OK) return 0;
  const char* why = gpumem_last_error();
  if (strncmp(why, "gpumem config: ", 15) == 0) why += 15;
  fprintf(stderr, "gpumem: bad GPUMEM_CONF '%s': %s (unset it or fix it)\n", env, why);
  return 1;
}

int cli_join_conf(const char* conf, char* out, size_t cap) {
  const char* env = cli_env_conf();
  int both = env && conf && conf[0];
  int n = snprintf(out, cap, "%s%s%s", env ? env : "", both ? "," : "", conf ? conf : "");
  if (n < 0 || (size_t)n >= cap) {
    if (cap) out[0] = '\0';
    return -1;
  }
  return 0;
}

int cli_each_key(const char* conf, int (*fn)(const char* key, size_t len, void* arg), void* arg) {
  const char* p = conf ? conf : "";
  while (*p) {
    size_t item = strcspn(p, ",");
    size_t klen = strcspn(p, ":,");
    if (klen > item) klen = item;
    const char* k = p;
    while (klen && isspace((unsigned char)*k)) k++, klen--;
    while (klen && isspace((unsigned char)k[klen - 1])) klen--;
    if (klen) {
      int rc = fn(k, klen, arg);
      if (rc) return rc;
    }
    p += item;
    if (*p == ',') p++;
  }
  return 0;
}

typedef struct {
  const char* want;
} has_t;

int cli_refuse_record(const char* conf) {
  const char* source = cli_conf_has(cli_env_conf(), "record") ? "GPUMEM_CONF"
                       : cli_conf_has(conf, "record")         ? "--conf"
                                                              : NULL;
  if (!source) return 0;
  fprintf(stderr,
          "gpumem: %s key 'record' would record this replay as a trace (over the recording "
          "it reads, if the path is the same): leave it out for the trace commands\n",
          source);
  return 1;
}

static int has_key(const char* key, size_t len, void* arg) {
  const has_t* h = arg;
  return strlen(h->want) == len && strncasecmp(key, h->want, len) == 0;
}

int cli_conf_has(const char* conf, const char* key) {
  has_t h = {key};
  return cli_each_key(conf, has_key, &h);
}

/* Whether text (n bytes) is a bare number, with no unit. */
static int unitless(const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  return n && (isdigit((unsigned char)text[n - 1]) || text[n - 1] == '.');
}

/* Whether text (n bytes) is a bare zero ("0", "0.0"): the same in every
 * unit, so a key's value needs none (map_ahead:0; limit:0 is refused by
 * the library, by name). */
static int bare_zero(const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  size_t zeros = 0;
  for (size_t i = 0; i < n; i++) {
    if (text[i] == '0')
      zeros++;
    else if (text[i] != '.')
      return 0;
  }
  return zeros > 0;
}

/* "bad --limit '80': 80 bytes: did you mean 80G? write 80B for bytes" */
static void unit_message(const char* option, const char* text, size_t n) {
  while (n && isspace((unsigned char)text[n - 1])) n--;
  gpumem_set_last_error("bad %s '%.*s': %.*s bytes: did you mean %.*sG? write %.*sB for bytes",
                        option, (int)n, text, (int)n, text, (int)n, text, (int)n, text);
}

gpumem_status_t cli_parse_size(const char* option, const char* text, size_t* out) {
  size_t bytes = 0;
  if (gpumem_parse_size(text, &bytes) != GPUMEM_OK) {
    const char* why = gpumem_last_error();
    if (strncmp(why, "gpumem: ", 8) == 0) why += 8;
    char copy[512];
    snprintf(copy, sizeof copy, "%s", why);
    gpumem_set_last_error("bad %s '%s': %s", option, text, copy);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  if (unitless(text, strlen(text))) {
    unit_message(option, text, strlen(text));
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  *out = bytes;
  return GPUMEM_OK;
}

gpumem_status_t cli_check_conf_units(const char* option, const char* conf) {
  static const char* const size_keys[] = {"limit", "map_max", "map_ahead", "shared_limit"};
  const char* p = conf ? conf : "";
  while (*p) {
    size_t item = strcspn(p, ",");
    const char* colon = memchr(p, ':', item);
    if (colon) {
      const char* k = p;
      size_t klen = (size_t)(colon - p);
      while (klen && isspace((unsigned char)*k)) k++, klen--;
      while (klen && isspace((unsigned char)k[klen - 1])) klen--;
      const char* v = colon + 1;
      size_t vlen = item - (size_t)(v - p);
      while (vlen && isspace((unsigned char)*v)) v++, vlen--;
      for (size_t i = 0; i < sizeof size_keys / sizeof size_keys[0]; i++) {
        if (strlen(size_keys[i]) == klen && strncasecmp(k, size_keys[i], klen) == 0 &&
            unitless(v, vlen) && !bare_zero(v, vlen)) {
          char name[64];
          snprintf(name, sizeof name, "%s %.*s", option, (int)klen, k);
          unit_message(name, v, vlen);
          return GPUMEM_ERR_CONFIG;
        }
      }
    }
    p += item;
    if (*p == ',') p++;
  }
  return GPUMEM_OK;
}
