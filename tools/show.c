/* Making outside text safe to print (show.h). One rule for every command:
 * printable ASCII and well-formed UTF-8 above U+009F pass; everything else
 * is written as \xNN. */
#include "show.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h" /* gm_emit_json_string */

/* Bytes in the well-formed UTF-8 sequence at s that is printable (not a C1
 * control, U+0080-U+009F), or 0. */
static int printable_utf8(const unsigned char* s) {
  unsigned char c = s[0];
  int n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  for (int i = 1; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  if ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] > 0x9f) || (c == 0xf0 && s[1] < 0x90) ||
      (c == 0xf4 && s[1] > 0x8f) || (c == 0xc2 && s[1] <= 0x9f))
    return 0;
  return n;
}

/* Writes the shown form of s into out (NULL: only counts); returns its
 * length. Stops before passing limit bytes, at a whole character. */
static size_t shown(const char* s, char* out, size_t limit, int* cut) {
  size_t n = 0;
  const unsigned char* p = (const unsigned char*)s;
  *cut = 0;
  while (*p) {
    char piece[8];
    size_t k, consumed = 1; /* bytes of piece, and of s it stands for */
    int utf8 = *p >= 0x80 ? printable_utf8(p) : 0;
    if (*p >= 0x20 && *p < 0x7f) {
      piece[0] = (char)*p;
      k = 1;
    } else if (utf8) {
      k = consumed = (size_t)utf8;
      memcpy(piece, p, k);
    } else {
      snprintf(piece, sizeof piece, "\\x%02x", *p);
      k = 4;
    }
    if (n + k > limit) {
      *cut = 1;
      break;
    }
    if (out) memcpy(out + n, piece, k);
    n += k;
    p += consumed;
  }
  return n;
}

const char* show_text(const char* s, char* buf, size_t cap) {
  if (cap == 0) return buf;
  if (!s) s = "(null)";
  int cut = 0;
  size_t n = shown(s, buf, cap - 1, &cut);
  if (cut && cap > 4) {
    n = shown(s, buf, cap - 4, &cut);
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

char* show_dup(const char* s) {
  int cut = 0;
  size_t n = shown(s, NULL, (size_t)-1, &cut);
  char* out = malloc(n + 1);
  if (!out) return NULL;
  shown(s, out, n, &cut);
  out[n] = '\0';
  return out;
}

/* The library's messages may begin with "gpumem: " (or "gpumem config: ")
 * for programs that print them bare; ours already start with "gpumem: ". */
const char* show_detail(const char* msg) {
  static const char* const prefixes[] = {"gpumem: ", "gpumem config: "};
  for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
    size_t n = strlen(prefixes[i]);
    if (strncmp(msg, prefixes[i], n) == 0) return msg + n;
  }
  return msg;
}

/* 1234567 -> "1,234,567" (buf of at least 32 bytes). */
const char* show_count(uint64_t v, char* buf) {
  char tmp[32];
  int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  int o = 0;
  for (int i = 0; i < n; i++) {
    if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
    buf[o++] = tmp[i];
  }
  buf[o] = '\0';
  return buf;
}

/* The first line of a message, for one-line reports; long ones are cut
 * with "..." (the JSON output carries the whole text). */
const char* show_first_line(const char* msg, char* buf, size_t cap) {
  size_t n = strcspn(msg, "\n");
  int cut = 0;
  if (n > 300) n = 300;
  if (n >= cap - 4) n = cap - 4;
  if (msg[n] != '\0' && msg[n] != '\n') cut = 1;
  memcpy(buf, msg, n);
  if (cut) memcpy(buf + n, "...", 3);
  buf[n + (cut ? 3 : 0)] = '\0';
  return buf;
}

void show_json(FILE* f, const char* s) {
  gm_emitter e = {gpumem_write_to_file, f, 0};
  gm_emit_json_string(&e, s);
}
