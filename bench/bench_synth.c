/* Synthetic workload generators: allocation traces, in the format of
 * traces/README.md, for patterns the bundled traces do not cover, so that
 * the policies can be checked beyond them:
 *
 *   synth_varlen     training steps whose batch and sequence lengths change
 *                    every step (a transformer-like layer stack)
 *   synth_kvcache    generation: per-layer key/value caches that grow by
 *                    reallocation (allocate larger, copy, free the old one)
 *                    for batches of sequences of different lengths
 *   synth_random     random sizes over six orders of magnitude (1 KiB to
 *                    1 GiB, log-uniform) with random lifetimes
 *   synth_streams    three streams: a side stream stages inputs that the
 *                    main stream uses (record_stream), a third one computes
 *   synth_finetune   fine-tuning as users run it: a decoder whose padded
 *                    batch (size 4-8) and length (256-2048) are drawn every
 *                    micro-step, bf16 weight copies and saved activations per
 *                    layer, gradient accumulation 2, AdamW with its state
 *                    made at the first step and its temporaries every step
 *   synth_serve      generate() serving: per request a batch (1-16) of
 *                    prompts (32-1024 tokens) prefilled, then decoded token by
 *                    token with per-layer key/value caches grown by
 *                    concatenation (a new larger tensor, the old one freed),
 *                    as a dynamic cache does
 *
 * Usage: bench_synth OUTDIR [SEED]. Writes OUTDIR/<name>.trace for each;
 * replay them with `gpumem replay --compare --min-limit OUTDIR/NAME.trace` for each
 * (make synth does both). Deterministic for a given seed. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KIB ((uint64_t)1024)
#define MIB (KIB * 1024)
#define GIB (MIB * 1024)

/* xorshift64*: small, deterministic, good enough for workloads. */
static uint64_t rng_state;
static uint64_t rng(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}
static uint64_t rng_range(uint64_t lo, uint64_t hi) {
  return lo + rng() % (hi - lo + 1);
}
static double rng_unit(void) {
  return (double)(rng() >> 11) / 9007199254740992.0;
}

typedef struct writer {
  FILE* f;
  uint64_t next_id;
} writer_t;

static uint64_t w_alloc(writer_t* w, uint64_t size, uint64_t stream) {
  uint64_t id = w->next_id++;
  fprintf(w->f, "a %llu %llu %llu\n", (unsigned long long)id, (unsigned long long)size,
          (unsigned long long)stream);
  return id;
}
static void w_free(writer_t* w, uint64_t id) {
  fprintf(w->f, "f %llu\n", (unsigned long long)id);
}
static void w_use(writer_t* w, uint64_t id, uint64_t stream) {
  fprintf(w->f, "r %llu %llu\n", (unsigned long long)id, (unsigned long long)stream);
}

static int w_open(writer_t* w, const char* dir, const char* name, const char* what) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s.trace", dir, name);
  w->f = fopen(path, "w");
  if (!w->f) {
    fprintf(stderr, "bench_synth: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  w->next_id = 0;
  fprintf(w->f, "# gpumem-trace v1\n# workload %s (synthetic, bench/bench_synth.c)\n# %s\n", name,
          what);
  return 0;
}

/* A layer stack trained with batch x sequence changing every step. */
static void gen_varlen(writer_t* w) {
  enum { LAYERS = 12, STEPS = 30 };
  const uint64_t hidden = 1024;
  uint64_t weights[LAYERS][2], grads_acc[LAYERS][2], adam[LAYERS][4];
  for (int l = 0; l < LAYERS; l++) {
    weights[l][0] = w_alloc(w, hidden * hidden * 4 * 2, 0); /* attention */
    weights[l][1] = w_alloc(w, hidden * hidden * 8 * 2, 0); /* mlp */
  }
  int have_state = 0;
  for (int step = 0; step < STEPS; step++) {
    uint64_t batch = rng_range(2, 16), seq = rng_range(64, 2048);
    uint64_t tokens = batch * seq;
    uint64_t acts[LAYERS][4];
    uint64_t input = w_alloc(w, tokens * 8, 0);
    for (int l = 0; l < LAYERS; l++) {
      acts[l][0] = w_alloc(w, tokens * hidden * 2, 0);              /* layer input */
      acts[l][1] = w_alloc(w, batch * 16 * seq * seq / 8 + 512, 0); /* attention scores */
      acts[l][2] = w_alloc(w, tokens * hidden * 4 * 2, 0);          /* mlp hidden */
      uint64_t tmp = w_alloc(w, tokens * hidden * 2, 0);            /* transient */
      w_free(w, tmp);
      acts[l][3] = w_alloc(w, tokens * 4, 0); /* norm stats */
    }
    uint64_t loss = w_alloc(w, 4, 0);
    for (int l = LAYERS - 1; l >= 0; l--) {
      uint64_t g0 = w_alloc(w, hidden * hidden * 4 * 2, 0);
      uint64_t g1 = w_alloc(w, hidden * hidden * 8 * 2, 0);
      uint64_t dact = w_alloc(w, tokens * hidden * 2, 0);
      for (int k = 3; k >= 0; k--) w_free(w, acts[l][k]);
      w_free(w, dact);
      grads_acc[l][0] = g0;
      grads_acc[l][1] = g1;
    }
    w_free(w, loss);
    w_free(w, input);
    if (!have_state) { /* optimizer state appears at the first step */
      for (int l = 0; l < LAYERS; l++) {
        for (int k = 0; k < 4; k++)
          adam[l][k] = w_alloc(w, hidden * hidden * (k < 2 ? 4 : 8) * 4, 0);
      }
      have_state = 1;
    }
    for (int l = 0; l < LAYERS; l++) {
      w_free(w, grads_acc[l][0]);
      w_free(w, grads_acc[l][1]);
    }
  }
  (void)adam;
  (void)weights;
}

/* Generation with key/value caches grown by reallocation. */
static void gen_kvcache(writer_t* w) {
  enum { LAYERS = 16, REQUESTS = 24 };
  const uint64_t kv_per_token = 2 * 8 * 128 * 2;            /* k and v, 8 heads x 128, bf16 */
  for (int l = 0; l < LAYERS; l++) w_alloc(w, 64 * MIB, 0); /* weights */
  for (int r = 0; r < REQUESTS; r++) {
    uint64_t batch = rng_range(1, 8);
    uint64_t prompt = rng_range(32, 1024), gen = rng_range(16, 512);
    uint64_t cache[LAYERS], cap[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
      cap[l] = prompt;
      cache[l] = w_alloc(w, batch * cap[l] * kv_per_token, 0);
      uint64_t act = w_alloc(w, batch * prompt * 4096 * 2, 0);
      w_free(w, act);
    }
    for (uint64_t t = prompt; t < prompt + gen; t++) {
      for (int l = 0; l < LAYERS; l++) {
        if (t >= cap[l]) { /* grow by 1/8 (at least 16 tokens): copy into a larger buffer */
          uint64_t grown = cap[l] + (cap[l] / 8 > 16 ? cap[l] / 8 : 16);
          uint64_t bigger = w_alloc(w, batch * grown * kv_per_token, 0);
          w_free(w, cache[l]);
          cache[l] = bigger;
          cap[l] = grown;
        }
        uint64_t act = w_alloc(w, batch * 4096 * 2 * 4, 0);
        w_free(w, act);
      }
      uint64_t logits = w_alloc(w, batch * 32000 * 4, 0);
      w_free(w, logits);
    }
    for (int l = 0; l < LAYERS; l++) w_free(w, cache[l]);
  }
}

/* Random sizes over six orders of magnitude with random lifetimes: the
 * live set wanders around a target, frees in random order. */
static void gen_random(writer_t* w) {
  enum { OPS = 40000, MAX_LIVE = 4096 };
  uint64_t live[MAX_LIVE], sizes[MAX_LIVE];
  int n = 0;
  uint64_t live_bytes = 0;
  const uint64_t target = 8 * GIB;
  for (int op = 0; op < OPS; op++) {
    int do_alloc =
        n == 0 || (n < MAX_LIVE && (live_bytes < target ? rng_unit() < 0.6 : rng_unit() < 0.4));
    if (do_alloc) {
      /* log-uniform between 1 KiB and 1 GiB */
      double e = 10.0 + rng_unit() * 20.0;
      uint64_t size = (uint64_t)exp2(e);
      sizes[n] = size;
      live[n++] = w_alloc(w, size, 0);
      live_bytes += size;
    } else {
      int k = (int)(rng() % (uint64_t)n);
      w_free(w, live[k]);
      live_bytes -= sizes[k];
      live[k] = live[n - 1];
      sizes[k] = sizes[n - 1];
      n--;
    }
  }
}

/* Three streams: stream 1 stages the next inputs, stream 0 computes and
 * uses them (record_stream), stream 2 runs an auxiliary model. */
static void gen_streams(writer_t* w) {
  enum { STEPS = 40 };
  for (int k = 0; k < 8; k++) w_alloc(w, 96 * MIB, 0);
  for (int k = 0; k < 4; k++) w_alloc(w, 48 * MIB, 2);
  uint64_t staged = w_alloc(w, rng_range(8, 64) * MIB, 1);
  for (int step = 0; step < STEPS; step++) {
    uint64_t input = staged;
    w_use(w, input, 0); /* the main stream reads what the side stream staged */
    staged = w_alloc(w, rng_range(8, 64) * MIB, 1);
    uint64_t acts[16];
    for (int l = 0; l < 16; l++) acts[l] = w_alloc(w, rng_range(16, 160) * MIB, 0);
    uint64_t aux[6];
    for (int l = 0; l < 6; l++) aux[l] = w_alloc(w, rng_range(2, 40) * MIB, 2);
    for (int l = 5; l >= 0; l--) w_free(w, aux[l]);
    for (int l = 15; l >= 0; l--) {
      uint64_t g = w_alloc(w, rng_range(16, 160) * MIB, 0);
      w_free(w, acts[l]);
      w_free(w, g);
    }
    w_free(w, input); /* freed on its own stream while the main stream may still read it */
  }
}

/* Fine-tuning a decoder (16 layers, hidden 1024, MLP 2816, vocabulary
 * 32000: ~0.27B parameters in fp32) on padded batches drawn per micro-step,
 * under bf16 autocast: the shape of the job users run most. Peak live ~16
 * GiB at the largest batches. */
enum { FT_LAYERS = 16, FT_STEPS = 40, FT_ACCUMULATION = 2, FT_PARAMS = 2 + FT_LAYERS * 9 };

typedef struct ft_model {
  uint64_t size[FT_PARAMS]; /* fp32 bytes of each parameter */
  uint64_t grad[FT_PARAMS];
  int have_grad;
} ft_model_t;

/* Parameter k of layer l (k: 0-3 attention q k v o, 4-6 MLP gate up
 * down, 7-8 the two norms); 0 and 1 are the embedding and the head. */
static int ft_param(int layer, int k) {
  return 2 + layer * 9 + k;
}

/* One micro-step's forward and backward; its weight gradients made on
 * the first micro-step of a step, accumulated through a bf16 temporary
 * after that. */
static void ft_micro_step(writer_t* w, ft_model_t* m) {
  const uint64_t hidden = 1024, mlp = 2816, vocab = 32000, heads = 8;
  uint64_t batch = rng_range(4, 8), seq = rng_range(256, 2048), tokens = batch * seq;
  uint64_t ids = w_alloc(w, tokens * 8, 0), mask = w_alloc(w, tokens * 8, 0);
  uint64_t labels = w_alloc(w, tokens * 8, 0);
  uint64_t mask4d = w_alloc(w, batch * seq * seq * 2, 0); /* padding + causal, for attention */
  uint64_t embed_out = w_alloc(w, tokens * hidden * 4, 0);
  enum { SAVED = 12 };
  uint64_t saved[FT_LAYERS][SAVED];
  uint64_t casts[FT_LAYERS][7];
  for (int l = 0; l < FT_LAYERS; l++) {
    for (int k = 0; k < 7; k++) casts[l][k] = w_alloc(w, m->size[ft_param(l, k)] / 2, 0);
    uint64_t* a = saved[l];
    a[0] = w_alloc(w, tokens * 4, 0);                       /* norm statistics */
    a[1] = w_alloc(w, tokens * hidden * 2, 0);              /* normed input, bf16 */
    a[2] = w_alloc(w, tokens * hidden * 2, 0);              /* q */
    a[3] = w_alloc(w, tokens * hidden * 2, 0);              /* k */
    a[4] = w_alloc(w, tokens * hidden * 2, 0);              /* v */
    uint64_t rope = w_alloc(w, tokens * hidden * 2 * 2, 0); /* rotary temporaries */
    w_free(w, rope);
    a[5] = w_alloc(w, tokens * hidden * 2, 0);          /* attention output */
    a[6] = w_alloc(w, batch * heads * seq * 4, 0);      /* its log-sum-exp */
    a[7] = w_alloc(w, tokens * hidden * 4, 0);          /* residual, fp32 */
    a[8] = w_alloc(w, tokens * hidden * 2, 0);          /* second norm's output */
    a[9] = w_alloc(w, tokens * mlp * 2, 0);             /* gate */
    a[10] = w_alloc(w, tokens * mlp * 2, 0);            /* up */
    a[11] = w_alloc(w, tokens * mlp * 2, 0);            /* act(gate) * up */
    uint64_t down = w_alloc(w, tokens * hidden * 2, 0); /* down projection, added in */
    w_free(w, down);
  }
  uint64_t head_cast = w_alloc(w, m->size[1] / 2, 0);
  uint64_t final_norm = w_alloc(w, tokens * hidden * 2, 0);
  uint64_t logits = w_alloc(w, tokens * vocab * 2, 0);
  uint64_t logits32 = w_alloc(w, tokens * vocab * 4, 0); /* upcast for the loss */
  uint64_t logp = w_alloc(w, tokens * vocab * 4, 0);
  uint64_t loss = w_alloc(w, 4, 0);

  /* backward: the loss, the head, then the layers in reverse */
  uint64_t dlogp = w_alloc(w, tokens * vocab * 4, 0);
  w_free(w, logp);
  w_free(w, logits32);
  uint64_t dlogits = w_alloc(w, tokens * vocab * 2, 0);
  w_free(w, dlogp);
  uint64_t dhidden = w_alloc(w, tokens * hidden * 2, 0);
  uint64_t head_grad_bf16 = w_alloc(w, m->size[1] / 2, 0);
  if (!m->have_grad) m->grad[1] = w_alloc(w, m->size[1], 0);
  w_free(w, head_grad_bf16);
  w_free(w, dlogits);
  w_free(w, logits);
  w_free(w, final_norm);
  w_free(w, head_cast);
  for (int l = FT_LAYERS - 1; l >= 0; l--) {
    uint64_t dmlp = w_alloc(w, tokens * mlp * 2, 0);
    uint64_t dmlp2 = w_alloc(w, tokens * mlp * 2, 0);
    for (int k = 11; k >= 8; k--) w_free(w, saved[l][k]);
    uint64_t dattn = w_alloc(w, tokens * hidden * 2 * 3, 0); /* dq dk dv */
    w_free(w, dmlp);
    w_free(w, dmlp2);
    for (int k = 7; k >= 0; k--) w_free(w, saved[l][k]);
    for (int k = 8; k >= 0; k--) {
      int p = ft_param(l, k);
      uint64_t g16 = w_alloc(w, m->size[p] / 2 + 4, 0); /* bf16 weight gradient */
      if (!m->have_grad) m->grad[p] = w_alloc(w, m->size[p], 0);
      w_free(w, g16);
      if (k < 7) w_free(w, casts[l][k]);
    }
    uint64_t dnext = w_alloc(w, tokens * hidden * 2, 0);
    w_free(w, dattn);
    w_free(w, dhidden);
    dhidden = dnext;
  }
  uint64_t embed_grad = w_alloc(w, m->size[0], 0); /* the embedding's, dense */
  if (!m->have_grad) {
    m->grad[0] = embed_grad;
  } else {
    w_free(w, embed_grad);
  }
  w_free(w, dhidden);
  w_free(w, embed_out);
  w_free(w, loss);
  w_free(w, mask4d);
  w_free(w, labels);
  w_free(w, mask);
  w_free(w, ids);
  m->have_grad = 1;
}

static void gen_finetune(writer_t* w) {
  const uint64_t hidden = 1024, mlp = 2816, vocab = 32000;
  ft_model_t m = {.have_grad = 0};
  m.size[0] = m.size[1] = vocab * hidden * 4;
  for (int l = 0; l < FT_LAYERS; l++) {
    for (int k = 0; k < 4; k++) m.size[ft_param(l, k)] = hidden * hidden * 4;
    for (int k = 4; k < 7; k++) m.size[ft_param(l, k)] = hidden * mlp * 4;
    for (int k = 7; k < 9; k++) m.size[ft_param(l, k)] = hidden * 4;
  }
  for (int p = 0; p < FT_PARAMS; p++) w_alloc(w, m.size[p], 0); /* the weights, kept */
  for (int step = 0; step < FT_STEPS; step++) {
    for (int micro = 0; micro < FT_ACCUMULATION; micro++) ft_micro_step(w, &m);
    if (step == 0) { /* AdamW's two moments, made at its first step and kept */
      for (int p = 0; p < FT_PARAMS; p++) {
        w_alloc(w, m.size[p], 0);
        w_alloc(w, m.size[p], 0);
      }
    }
    /* the multi-tensor update's temporaries: one parameter-sized list
     * made and dropped, twice */
    for (int round = 0; round < 2; round++) {
      uint64_t tmp[FT_PARAMS];
      for (int p = 0; p < FT_PARAMS; p++) tmp[p] = w_alloc(w, m.size[p], 0);
      for (int p = 0; p < FT_PARAMS; p++) w_free(w, tmp[p]);
    }
    for (int p = 0; p < FT_PARAMS; p++) w_free(w, m.grad[p]); /* zero_grad(set_to_none) */
    m.have_grad = 0;
  }
}

/* generate() serving with a 12-layer decoder in bf16 (hidden 1536, MLP
 * 4096, 4 key/value heads of 128): per request a batch of left-padded
 * prompts, a prefill, then greedy decoding with a dynamic cache that grows
 * every key and value tensor by concatenation. */
static void gen_serve(writer_t* w) {
  enum { LAYERS = 12, REQUESTS = 200 };
  const uint64_t hidden = 1536, mlp = 4096, kv = 4 * 128, vocab = 32000;
  for (int l = 0; l < LAYERS; l++) {
    for (int k = 0; k < 2; k++) w_alloc(w, hidden * hidden * 2, 0); /* q o */
    for (int k = 0; k < 2; k++) w_alloc(w, hidden * kv * 2, 0);     /* k v */
    for (int k = 0; k < 3; k++) w_alloc(w, hidden * mlp * 2, 0);    /* gate up down */
  }
  w_alloc(w, vocab * hidden * 2, 0); /* embedding */
  w_alloc(w, vocab * hidden * 2, 0); /* head */
  for (int r = 0; r < REQUESTS; r++) {
    uint64_t batch = rng_range(1, 16), prompt = rng_range(32, 1024), new_tokens = rng_range(8, 32);
    uint64_t len = prompt, tokens = batch * prompt;
    uint64_t ids = w_alloc(w, tokens * 8, 0), mask = w_alloc(w, tokens * 8, 0);
    uint64_t keys[LAYERS], values[LAYERS];
    /* prefill: the whole prompt through every layer; only the last
     * position's logits are kept */
    uint64_t mask4d = w_alloc(w, batch * prompt * prompt * 2, 0);
    uint64_t h = w_alloc(w, tokens * hidden * 2, 0);
    for (int l = 0; l < LAYERS; l++) {
      uint64_t normed = w_alloc(w, tokens * hidden * 2, 0);
      uint64_t q = w_alloc(w, tokens * hidden * 2, 0);
      keys[l] = w_alloc(w, tokens * kv * 2, 0);
      values[l] = w_alloc(w, tokens * kv * 2, 0);
      uint64_t attn = w_alloc(w, tokens * hidden * 2, 0);
      w_free(w, q);
      w_free(w, normed);
      uint64_t h2 = w_alloc(w, tokens * hidden * 2, 0);
      w_free(w, attn);
      uint64_t gate = w_alloc(w, tokens * mlp * 2, 0), up = w_alloc(w, tokens * mlp * 2, 0);
      uint64_t act = w_alloc(w, tokens * mlp * 2, 0);
      w_free(w, gate);
      w_free(w, up);
      uint64_t out = w_alloc(w, tokens * hidden * 2, 0);
      w_free(w, act);
      w_free(w, h);
      w_free(w, h2);
      h = out;
    }
    w_free(w, mask4d);
    uint64_t logits = w_alloc(w, batch * vocab * 4, 0);
    w_free(w, h);
    for (uint64_t t = 0; t < new_tokens; t++) {
      uint64_t scores = w_alloc(w, batch * vocab * 4, 0); /* processed scores */
      w_free(w, logits);
      uint64_t next = w_alloc(w, batch * 8, 0);
      w_free(w, scores);
      len++;
      uint64_t ids2 = w_alloc(w, batch * len * 8, 0), mask2 = w_alloc(w, batch * len * 8, 0);
      w_free(w, ids);
      w_free(w, mask);
      w_free(w, next);
      ids = ids2;
      mask = mask2;
      uint64_t step_mask = w_alloc(w, batch * len * 2, 0);
      uint64_t x = w_alloc(w, batch * hidden * 2, 0);
      for (int l = 0; l < LAYERS; l++) {
        uint64_t qkv = w_alloc(w, batch * (hidden + 2 * kv) * 2, 0);
        uint64_t k2 = w_alloc(w, batch * len * kv * 2, 0); /* cat(old, new) */
        w_free(w, keys[l]);
        keys[l] = k2;
        uint64_t v2 = w_alloc(w, batch * len * kv * 2, 0);
        w_free(w, values[l]);
        values[l] = v2;
        uint64_t attn = w_alloc(w, batch * hidden * 2, 0);
        w_free(w, qkv);
        uint64_t mid = w_alloc(w, batch * mlp * 2 * 2, 0);
        uint64_t out = w_alloc(w, batch * hidden * 2, 0);
        w_free(w, mid);
        w_free(w, attn);
        w_free(w, x);
        x = out;
      }
      w_free(w, step_mask);
      logits = w_alloc(w, batch * vocab * 4, 0);
      w_free(w, x);
    }
    w_free(w, logits);
    for (int l = 0; l < LAYERS; l++) {
      w_free(w, keys[l]);
      w_free(w, values[l]);
    }
    w_free(w, ids);
    w_free(w, mask);
  }
}

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: bench_synth OUTDIR [SEED]\n");
    return 2;
  }
  const char* dir = argv[1];
  uint64_t seed = argc == 3 ? strtoull(argv[2], NULL, 10) : 42;
  struct {
    const char* name;
    const char* what;
    void (*gen)(writer_t*);
  } gens[] = {
      {"synth_varlen", "12-layer stack, batch 2-16 x sequence 64-2048 changing every step",
       gen_varlen},
      {"synth_kvcache", "16-layer generation, per-layer KV caches grown by reallocation",
       gen_kvcache},
      {"synth_random", "sizes log-uniform 1 KiB - 1 GiB, random lifetimes around 8 GiB live",
       gen_random},
      {"synth_streams", "3 streams: staged inputs used on another stream (record_stream)",
       gen_streams},
      {"synth_finetune",
       "decoder fine-tuning, batch 4-8 x length 256-2048 drawn per micro-step, accumulation 2, "
       "AdamW",
       gen_finetune},
      {"synth_serve",
       "generate() serving, batch 1-16 x prompt 32-1024, caches grown by concatenation", gen_serve},
  };
  for (size_t i = 0; i < sizeof gens / sizeof gens[0]; i++) {
    rng_state = seed * 0x9E3779B97F4A7C15ull + i + 1;
    writer_t w;
    if (w_open(&w, dir, gens[i].name, gens[i].what) != 0) return 1;
    gens[i].gen(&w);
    if (fclose(w.f) != 0) {
      fprintf(stderr, "bench_synth: write error in %s: %s\n", gens[i].name, strerror(errno));
      return 1;
    }
    printf("%s/%s.trace\n", dir, gens[i].name);
  }
  return 0;
}
