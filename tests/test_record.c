/* Recording an allocator's requests as a trace (src/record.c): option
 * record:PATH writes every allocation, free and record_stream, with step
 * markers, as a gzip trace the replay reads back event for event; replaying
 * it under the same policy reproduces the allocator's peak reserved memory
 * exactly; gpumem_record_trace() starts and stops it at run time and names a
 * path it cannot write; the option's value is checked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "replay.h"
#include "reader.h"
#include "test_util.h"
#include "trace.h"

static gpumem_t* make(const char* conf) {
  gpumem_sim_options_t so;
  gpumem_sim_options_init(&so);
  gpumem_backend_t* dev = gpumem_sim_create(&so);
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK_STATUS(gpumem_options_parse(&o, conf), GPUMEM_OK);
  o.own_backend = 1;
  gpumem_status_t st;
  gpumem_t* gm = gpumem_create(dev, &o, &st);
  CHECK_STATUS(st, GPUMEM_OK);
  return gm;
}

/* A job of a few steps on two streams, sizes varied. */
static void run_job(gpumem_t* gm) {
  void* weights[8];
  for (int i = 0; i < 8; i++)
    CHECK_STATUS(gpumem_malloc(gm, (size_t)(i + 1) << 21, 0, &weights[i]), GPUMEM_OK);
  for (int step = 0; step < 5; step++) {
    void* act[40];
    for (int i = 0; i < 40; i++) {
      size_t size = (size_t)((i * 7919 + step * 104729) % 50000) * 1024 + 100 + (size_t)i;
      gpumem_stream_t s = (gpumem_stream_t)(uintptr_t)(i % 5 == 0 ? 0x7000 : 0);
      CHECK_STATUS(gpumem_malloc(gm, size, s, &act[i]), GPUMEM_OK);
      if (i % 9 == 0)
        CHECK_STATUS(gpumem_record_stream(gm, act[i], (gpumem_stream_t)0x7100), GPUMEM_OK);
    }
    for (int i = 39; i >= 0; i--) CHECK_STATUS(gpumem_free(gm, act[i]), GPUMEM_OK);
    gpumem_record_step(gm);
    CHECK(gpumem_check(gm) == 0);
  }
}

static void test_record_replays_exactly(const char* dir, const char* policy) {
  char path[512], conf[700];
  snprintf(path, sizeof path, "%s/job_%s.trace.gz", dir, policy);
  snprintf(conf, sizeof conf, "policy:%s,record:%s", policy, path);
  gpumem_t* gm = make(conf);
  if (!gm) return;
  run_job(gm);
  gpumem_stats_t stats;
  gpumem_get_stats(gm, &stats);
  uint64_t peak = (uint64_t)stats.reserved_bytes[GPUMEM_POOL_ALL].peak;
  gpumem_destroy(gm); /* finishes the file */

  trace_t* t = NULL;
  CHECK_STATUS(trace_load(path, &t), GPUMEM_OK);
  if (!t) return;
  CHECK(t->num_allocs == 8 + 5 * 40);
  CHECK(t->num_frees == 5 * 40);
  CHECK(t->num_record_streams == 5 * 5);
  CHECK(t->num_streams == 3);
  /* the step markers */
  gzFile f = gzopen(path, "rb");
  char line[256];
  int steps = 0;
  while (f && gzgets(f, line, sizeof line))
    if (strncmp(line, "# step ", 7) == 0) steps++;
  if (f) gzclose(f);
  CHECK(steps == 5);

  replay_config_t c;
  replay_config_init(&c);
  c.policy = strcmp(policy, "pytorch") == 0 ? GPUMEM_POLICY_PYTORCH : GPUMEM_POLICY_DEFAULT;
  c.policy_set = 1;
  c.warm_passes = 0;
  replay_result_t* r = malloc(sizeof *r);
  CHECK_STATUS(replay_trace(t, &c, r), GPUMEM_OK);
  CHECK_MSG(r->peak_reserved_bytes == peak, "%s: replayed %llu, live %llu", policy,
            (unsigned long long)r->peak_reserved_bytes, (unsigned long long)peak);
  free(r);
  trace_free(t);
}

static void test_runtime_calls(const char* dir) {
  gpumem_t* gm = make("policy:pytorch");
  if (!gm) return;
  char path[512];
  snprintf(path, sizeof path, "%s/no/such/dir/x.trace.gz", dir);
  clear_error();
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_ERR_IO);
  CHECK(strstr(gpumem_last_error(), "cannot write") != NULL);
  void* p;
  CHECK_STATUS(gpumem_malloc(gm, 1000, 0, &p), GPUMEM_OK); /* not recorded */
  snprintf(path, sizeof path, "%s/pid%%p.trace.gz", dir);
  CHECK_STATUS(gpumem_record_trace(gm, path), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK); /* a free of an unrecorded allocation */
  CHECK_STATUS(gpumem_malloc(gm, 3000, 0, &p), GPUMEM_OK);
  CHECK_STATUS(gpumem_free(gm, p), GPUMEM_OK);
  CHECK_STATUS(gpumem_record_trace(gm, NULL), GPUMEM_OK);
  CHECK_STATUS(gpumem_malloc(gm, 5000, 0, &p), GPUMEM_OK); /* not recorded */
  CHECK(gpumem_check(gm) == 0);
  gpumem_destroy(gm);
  char want[600];
  snprintf(want, sizeof want, "%s/pid%ld.trace.gz", dir, (long)getpid());
  gzFile f = gzopen(want, "rb");
  CHECK(f != NULL);
  char text[4096] = "";
  if (f) {
    int n = gzread(f, text, sizeof text - 1);
    text[n > 0 ? n : 0] = '\0';
    gzclose(f);
  }
  CHECK(strstr(text, "a 2 3000 0x0\nf 2\n") != NULL);
  /* nothing of the allocations made before or after: the file is a trace */
  CHECK(strstr(text, "5000") == NULL && strstr(text, "a 1 ") == NULL);
  CHECK(strstr(text, "f 1\n") == NULL);
  trace_t* t = NULL;
  CHECK_STATUS(trace_load(want, &t), GPUMEM_OK);
  trace_free(t);
}

static void test_config(void) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  CHECK(o.record[0] == '\0');
  CHECK_STATUS(gpumem_options_parse(&o, "record:/tmp/x-%p.trace.gz"), GPUMEM_OK);
  CHECK(strcmp(o.record, "/tmp/x-%p.trace.gz") == 0);
  clear_error();
  CHECK_STATUS(gpumem_options_parse(&o, "record:"), GPUMEM_ERR_CONFIG);
  CHECK(strstr(gpumem_last_error(), "record") != NULL);
}

/* A job recorded from start to end with record:PATH never destroys its
 * allocator (per-device instances live until exit): the file is finished
 * at exit, with every event of the many buffers the writer took. */
static void test_file_finished_at_exit(const char* dir) {
  char path[512], conf[700];
  snprintf(path, sizeof path, "%s/at_exit.trace.gz", dir);
  snprintf(conf, sizeof conf, "record:%s", path);
  enum { N = 150000 }; /* ~4 MiB of text: several buffers */
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    gpumem_t* gm = make(conf);
    for (int i = 0; gm && i < N; i++) {
      void* p = NULL;
      if (gpumem_malloc(gm, 512 + (size_t)(i % 4096) * 512, 0, &p) != GPUMEM_OK) _exit(3);
      if (i % 7 == 0) gpumem_record_step(gm);
      if (gpumem_free(gm, p) != GPUMEM_OK) _exit(4);
    }
    exit(gm ? 0 : 2); /* atexit handlers run; the allocator is not destroyed */
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "recording child: status %d", status);
  trace_t* t = NULL;
  CHECK_STATUS(trace_load(path, &t), GPUMEM_OK);
  if (!t) return;
  CHECK_MSG(t->num_allocs == N && t->num_frees == N, "%zu allocations and %zu frees of %d",
            (size_t)t->num_allocs, (size_t)t->num_frees, N);
  trace_free(t);
}

int main(void) {
  char dir[] = "/tmp/gpumem_record.XXXXXX";
  if (!mkdtemp(dir)) return 1;
  test_config();
  test_record_replays_exactly(dir, "pytorch");
  test_record_replays_exactly(dir, "default");
  test_runtime_calls(dir);
  test_file_finished_at_exit(dir);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  return test_finish("test_record");
}
