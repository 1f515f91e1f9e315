/* Allocation traces in memory, and the facts about them that the replay
 * reports (peak live bytes, streams); reader.h reads them from files.
 *
 * Format (traces/README.md): '#' comments and blank lines, then one event a
 * line: `a ID SIZE STREAM [ROLE]` (allocate; ROLE, optional, names what made
 * the allocation: an operator, a call site), `f ID` (free), and the
 * project's extension `r ID STREAM` (record_stream: the live allocation ID
 * is used on STREAM). A trace ID may be reused once freed, so every allocation gets its
 * own dense slot (0, 1, 2... in allocation order) and events name slots:
 * the replay then keeps its live pointers in a plain array. */
#ifndef GPUMEM_TOOLS_TRACE_H
#define GPUMEM_TOOLS_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"

typedef enum trace_op {
  TRACE_ALLOC = 0,
  TRACE_FREE = 1,
  TRACE_RECORD_STREAM = 2,
} trace_op_t;

typedef struct trace_event {
  uint64_t size;    /* the allocation's requested bytes (on every op) */
  uintptr_t stream; /* ALLOC: its stream; RECORD_STREAM: the stream used; FREE: the alloc's */
  uint32_t id;      /* dense slot of the allocation (allocation order) */
  uint32_t line;    /* line in the file, for messages */
  uint8_t op;       /* trace_op_t */
} trace_event_t;

typedef struct trace {
  char* path; /* as given to trace_load; show.h's show_text to print it */
  char* name; /* basename without .gz and .trace: "gpt2_train", shown (show.h) */
  trace_event_t* events;
  size_t num_events;
  size_t num_allocs; /* also the number of slots */
  size_t num_frees;
  size_t num_record_streams;
  /* The largest sum of requested bytes alive at once, and the index of the
   * event (an ALLOC) where it was first reached. */
  uint64_t peak_live_bytes;
  size_t peak_event;
  size_t peak_live_allocs; /* allocations alive at that event */
  uint64_t end_live_bytes; /* never freed: weights, optimizer state */
  size_t end_live_allocs;
  uint64_t total_alloc_bytes;
  uint64_t max_alloc_size;
  size_t num_streams; /* distinct streams named by ALLOC and RECORD_STREAM */
  /* Per slot: the ID the file used and the index of its ALLOC event. */
  uint64_t* slot_trace_id;
  size_t* slot_event;
  /* What made each allocation, where the recorder said (the ROLE field, or
   * a snapshot's frames): slot_role[slot] indexes roles, 0 for none;
   * roles[0] is NULL. NULL arrays when no allocation has a role. The
   * recordings of one job at two batch sizes are aligned by role
   * (align.h). */
  uint32_t* slot_role;
  char** roles;
  size_t num_roles;
  /* Made by trace_repeat_tail: the first appended event (0 = not
   * extended), the period repeated and how often. */
  size_t steady_from_event;
  size_t steady_period;
  int steady_reps;
  /* The `# step N` comment lines (traces/README.md: the recorder writes one
   * after each optimizer step), in file order: step_end[k] is the number
   * of events before the (k+1)th marker, so step k is the events from
   * step_end[k-1] (0 for the first) to step_end[k]. 0 steps: no markers. */
  size_t* step_end;
  size_t num_steps;
  /* Read from a PyTorch memory snapshot pickle (snapshot.h): which device,
   * how many allocations were made up for as lost (GPUMEM_SNAPSHOT_PARTIAL),
   * the peak reserved memory its segment events show the recording
   * process had (0 = unknown), and how many allocations its frames place
   * inside a convolution (nn.Conv*'s forward, cuDNN's convolution). */
  int from_snapshot;
  int snapshot_device;
  size_t snapshot_lost_events;
  size_t snapshot_conv_allocs;
  uint64_t recorded_peak_reserved;
} trace_t;

/* Limits of the reader (docs/security.md, "Limits of the readers"): what a
 * file may ask for before the reader refuses it by name, so that memory and
 * time stay proportional to the file and never multiply by a number the
 * file chose.
 * - TRACE_MAX_STREAMS: distinct streams a trace names. Each stream an
 *   allocation names costs the allocator a set of arena tables and every
 *   replay of the trace pays for them again (about 1.3 MB a stream for
 *   explain), so a few bytes a line must not buy that many times over.
 * - TRACE_MAX_SIZE: bytes one allocation may request (2^48, 256 TiB, far
 *   above any device): sizes near 2^64 wrap to 0 when a model rounds them
 *   up, and would then "fit" in nothing.
 * - trace_max_bytes (reader.h): the bytes a file may hold once inflated. */
#define TRACE_MAX_STREAMS 64
/* Characters in a ROLE field (printable ASCII, no blanks). */
#define TRACE_MAX_ROLE 160
/* A role that begins so was made inside an optimizer's step (a snapshot's
 * frames in torch/optim; a recorder may say so too). Its tensors are
 * shaped like the parameters, whatever the batch, so where a step was
 * skipped in one recording (a GradScaler skips a step whose gradients
 * overflow) align.c carries what the other made at its size. */
#define TRACE_OPTIMIZER_ROLE "optim/"
#define TRACE_MAX_SIZE ((uint64_t)1 << 48)
/* The sum of all sizes requested (2^62): what sums sizes, rounded up to
 * pages and segments, stays below 2^63 and fits the signed statistics. */
#define TRACE_MAX_TOTAL ((uint64_t)1 << 62)

/* The text of a trace file already in memory (reader.h reads files);
 * path is used for messages and name. Errors as trace_load's. */
gpumem_status_t trace_parse(const char* path, const char* text, size_t len, trace_t** out);
void trace_free(trace_t* trace);

/* A trace built event by event, with the checks and facts of a parsed file
 * (an unknown or reused ID, the readers' limits, peak live bytes): what
 * readers of other formats and the transformations below make traces
 * with, so that nothing is written as text and read back. Each event is
 * numbered as the next line, from 1 (trace_builder_set_line changes
 * where the count is); errors name path and that line. On an error the
 * builder stays valid for trace_builder_discard. */
typedef struct trace_builder trace_builder_t;
/* expected_events: a hint for the first table sizes. */
gpumem_status_t trace_builder_new(const char* path, size_t expected_events, trace_builder_t** out);
void trace_builder_set_line(trace_builder_t* b, size_t line); /* the next event's line */
gpumem_status_t trace_builder_alloc(trace_builder_t* b, uint64_t id, uint64_t size,
                                    uint64_t stream);
/* The same, the allocation made by `role` (printable ASCII but blanks, at
 * most TRACE_MAX_ROLE characters; NULL for none): align.h matches
 * recordings by it. */
gpumem_status_t trace_builder_alloc_role(trace_builder_t* b, uint64_t id, uint64_t size,
                                         uint64_t stream, const char* role);
gpumem_status_t trace_builder_free(trace_builder_t* b, uint64_t id);
gpumem_status_t trace_builder_record_stream(trace_builder_t* b, uint64_t id, uint64_t stream);
/* A step marker (`# step N`) before the next event. */
gpumem_status_t trace_builder_step(trace_builder_t* b);
/* The trace (GPUMEM_ERR_IO when it holds no event); b is freed either way. */
gpumem_status_t trace_builder_finish(trace_builder_t* b, trace_t** out);
void trace_builder_discard(trace_builder_t* b);

/* A longer run of the same loop: the trace followed by reps repetitions of
 * its last period, the smallest P for which the last P allocations request
 * what the P before them did and whose frees (and record_streams) name
 * only allocations of those two periods, the earlier ones still live at
 * the end of the trace (a training step: its gradients freed in the next
 * one). IDs become slot numbers. GPUMEM_ERR_INVALID_ARGUMENT when the trace
 * ends in no such period (t5_varlen_prefetch: every step differs). */
gpumem_status_t trace_repeat_tail(const trace_t* t, int reps, trace_t** out, size_t* period);

/* The first num_events events of t (all of them at t->num_events) with
 * every allocation's size replaced by slot_size[its slot], as a trace of
 * their own, made by the one builder so that every fact and check is
 * the usual one: IDs become slot numbers, the step markers up to there are
 * kept, and path names it in messages. slot_size holds an entry for every
 * slot. A size above TRACE_MAX_SIZE is refused by the builder as in a file. */
gpumem_status_t trace_resized(const trace_t* t, size_t num_events, const uint64_t* slot_size,
                              const char* path, trace_t** out);

/* A trace of the events given, in order (each naming its allocation by
 * id: an allocation's id is free for reuse once freed), with a step marker
 * before event step_end[k] for each k, made by the one builder; the
 * events keep the line numbers they carry, for messages. */
gpumem_status_t trace_from_events(const char* path, const trace_event_t* events, size_t num_events,
                                  const size_t* step_end, size_t num_steps, trace_t** out);

/* t as the text of a trace file: the format line, comment as '#' lines
 * (line breaks in it end the line; at most 200 characters of each piece),
 * every event naming its allocation by slot, the step markers. *text is
 * malloc'ed, not NUL-terminated; GPUMEM_ERR_HOST_MEMORY when out of it. */
gpumem_status_t trace_text(const trace_t* t, const char* comment, char** text, size_t* text_len);

/* "alloc", "free", "record_stream". */
const char* trace_op_name(int op);
/* Operations the replay times: allocations plus frees. */
static inline size_t trace_num_ops(const trace_t* trace) {
  return trace->num_allocs + trace->num_frees;
}

#endif
