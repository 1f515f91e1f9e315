// gpumem's peer replay harness: replays one uncompressed gpumem trace on the
// GPU through one allocator and prints ONE JSON line with what it held and
// what it cost. Allocators ("peers"):
//   torch          PyTorch's native caching allocator (raw_alloc_with_stream / raw_delete)
//   torch_exp      the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
//   async          cudaMallocFromPoolAsync / cudaFreeAsync on a pool that never releases
//   cudamalloc     cudaMalloc / cudaFree, no caching
//   gpumem         gpumem, default policy, CUDA backend (built with -DREPLAY_WITH_GPUMEM)
//   gpumem_pytorch gpumem, pytorch policy
// Every allocator goes through the same loop, the same stream mapping and the
// same measurements, so the numbers sit side by side.
//
// usage: replay_peers [--passes N] [--cap BYTES] [--single-stream] [--no-sample] TRACE PEER
//   --passes N       timed passes over the trace (default 5): the first is cold, the
//                    warm figure is the median of passes 2..N; what a pass leaves live
//                    is freed (untimed) before the next.
//   --cap BYTES      replay once under a hard cap on the allocator's reserved memory;
//                    exit 3 on out of memory (for bisecting the smallest cap).
//   --single-stream  every allocation on the default stream (as tools/replay_peers did)
//   --no-sample      skip the device-memory sampling pass
//   --parse-only     read the trace and print its facts (no GPU needed)
// Exit: 0 done, 3 out of memory under --cap, 1 failure, 2 usage.
//
// Streams: each distinct STREAM value of the trace gets its own stream
// (cudaStreamNonBlocking); 0 stays the legacy default stream. No kernels run,
// so every stream is idle and frees are reusable at once on their stream.
//
// Caps: torch and torch_exp use PyTorch's own mechanism
// (setMemoryFraction(cap / total)); async uses the pool's maxSize
// (cudaMemPoolProps.maxSize), falling back to emulation if the driver refuses
// it; gpumem uses gpumem_set_limit; cudamalloc has no mechanism, so it is
// emulated: an allocation fails when the bytes live would exceed the cap.
//
// Device-seen peak: after the timed passes the cache is emptied and one more
// untimed pass runs; after each allocation that raises the allocator's
// reserved bytes past its previous maximum, cudaMemGetInfo is read, and
// device_used_peak_bytes is the largest drop of free memory below the baseline
// taken before the first pass (so the context's own memory is not counted).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef REPLAY_WITH_TORCH
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#endif
#ifdef REPLAY_WITH_GPUMEM
#include "gpumem.h"
#include "gpumem_backend.h"
#endif

namespace {

[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("replay_peers: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

// ---- the trace ---------------------------------------------------------------

enum Op : uint8_t { ALLOC, FREE, RECORD };

struct Event {
  Op op;
  uint32_t slot;    // dense index of the allocation ID
  uint32_t stream;  // dense index of the stream (ALLOC, RECORD)
  uint64_t size;    // ALLOC
};

struct Trace {
  std::vector<Event> events;
  std::vector<uint64_t> stream_values;  // trace STREAM value of each dense index
  size_t slots = 0;
  size_t allocs = 0, frees = 0, records = 0;
  uint64_t peak_live = 0;
};

Trace load_trace(const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) die("cannot open %s: %s", path, strerror(errno));
  Trace t;
  std::unordered_map<uint64_t, uint32_t> live_id;  // trace ID -> slot, while live
  std::unordered_map<uint64_t, uint32_t> stream_index;
  std::vector<uint64_t> slot_size;
  std::vector<uint32_t> free_slots;
  uint64_t live = 0;
  char line[512];
  unsigned lineno = 0;
  auto stream_of = [&](uint64_t v) {
    auto it = stream_index.find(v);
    if (it != stream_index.end()) return it->second;
    uint32_t k = (uint32_t)t.stream_values.size();
    t.stream_values.push_back(v);
    stream_index.emplace(v, k);
    return k;
  };
  while (fgets(line, sizeof line, f)) {
    lineno++;
    if (line[0] == '#' || line[0] == '\n') continue;
    unsigned long long id = 0, size = 0, stream = 0;
    Event e{};
    if (line[0] == 'a') {
      int n = sscanf(line + 1, "%llu %llu %lli", &id, &size, (long long*)&stream);
      if (n < 2) die("%s:%u: bad allocation line", path, lineno);
      if (live_id.count(id)) die("%s:%u: ID %llu allocated twice", path, lineno, id);
      uint32_t slot;
      if (!free_slots.empty()) {
        slot = free_slots.back();
        free_slots.pop_back();
      } else {
        slot = (uint32_t)slot_size.size();
        slot_size.push_back(0);
      }
      live_id.emplace(id, slot);
      slot_size[slot] = size;
      e.op = ALLOC;
      e.slot = slot;
      e.stream = stream_of(stream);
      e.size = size;
      t.allocs++;
      live += size;
      t.peak_live = std::max(t.peak_live, live);
    } else if (line[0] == 'f') {
      if (sscanf(line + 1, "%llu", &id) != 1) die("%s:%u: bad free line", path, lineno);
      auto it = live_id.find(id);
      if (it == live_id.end()) die("%s:%u: free of ID %llu, which is not live", path, lineno, id);
      e.op = FREE;
      e.slot = it->second;
      live -= slot_size[it->second];
      free_slots.push_back(it->second);
      live_id.erase(it);
      t.frees++;
    } else if (line[0] == 'r') {
      if (sscanf(line + 1, "%llu %lli", &id, (long long*)&stream) != 2)
        die("%s:%u: bad record_stream line", path, lineno);
      auto it = live_id.find(id);
      if (it == live_id.end()) die("%s:%u: record_stream of ID %llu, not live", path, lineno, id);
      e.op = RECORD;
      e.slot = it->second;
      e.stream = stream_of(stream);
      t.records++;
    } else {
      die("%s:%u: unknown line", path, lineno);
    }
    t.events.push_back(e);
  }
  fclose(f);
  t.slots = slot_size.size();
  if (t.allocs == 0) die("%s: no allocations", path);
  return t;
}

// ---- the allocators -----------------------------------------------------------

class Peer {
 public:
  virtual ~Peer() = default;
  // false: out of memory (any other failure dies)
  virtual bool alloc(size_t size, cudaStream_t s, void** out) = 0;
  virtual void free(void* p, size_t size, cudaStream_t s) = 0;
  // Not supported by every peer: false when ignored.
  virtual bool record_stream(void* p, cudaStream_t s) {
    (void)p;
    (void)s;
    return false;
  }
  virtual uint64_t reserved_current() = 0;
  virtual uint64_t reserved_peak() = 0;
  virtual void reset_peak() = 0;
  virtual void release_cache() = 0;
  virtual const char* cap_mechanism() = 0;
  // Extra JSON fields (",\"k\":v..."), read after the cold pass.
  virtual std::string extra_json() { return ""; }
};

// cudaMalloc / cudaFree: no cache; its "reserved" is the bytes live (the
// driver rounds each allocation up further; device_used shows that).
class CudaMallocPeer : public Peer {
  uint64_t live_ = 0, peak_ = 0, cap_;

 public:
  explicit CudaMallocPeer(uint64_t cap) : cap_(cap) {}
  bool alloc(size_t size, cudaStream_t, void** out) override {
    if (cap_ && live_ + size > cap_) return false;  // emulated cap
    cudaError_t e = cudaMalloc(out, size);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return false;
    }
    cuda_check(e, "cudaMalloc");
    live_ += size;
    peak_ = std::max(peak_, live_);
    return true;
  }
  void free(void* p, size_t size, cudaStream_t) override {
    cuda_check(cudaFree(p), "cudaFree");
    live_ -= size;
  }
  uint64_t reserved_current() override { return live_; }
  uint64_t reserved_peak() override { return peak_; }
  void reset_peak() override { peak_ = live_; }
  void release_cache() override {}
  const char* cap_mechanism() override { return "emulated_live_bytes"; }
};

// The stream-ordered allocator on a pool of its own that never releases
// memory by itself (release threshold UINT64_MAX).
class AsyncPeer : public Peer {
  cudaMemPool_t pool_{};
  uint64_t cap_;
  bool emulate_cap_ = false;

  uint64_t attr(cudaMemPoolAttr a) {
    unsigned long long v = 0;
    cuda_check(cudaMemPoolGetAttribute(pool_, a, &v), "cudaMemPoolGetAttribute");
    return v;
  }

 public:
  explicit AsyncPeer(uint64_t cap) : cap_(cap) {
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    props.maxSize = cap;
    cudaError_t e = cudaMemPoolCreate(&pool_, &props);
    if (e != cudaSuccess && cap) {
      // Older drivers lack maxSize: emulate the cap on reserved bytes.
      cudaGetLastError();
      props.maxSize = 0;
      emulate_cap_ = true;
      e = cudaMemPoolCreate(&pool_, &props);
    }
    cuda_check(e, "cudaMemPoolCreate");
    unsigned long long never = ~0ull;
    cuda_check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &never),
               "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  ~AsyncPeer() override {
    cudaDeviceSynchronize();
    cudaMemPoolDestroy(pool_);
  }
  bool alloc(size_t size, cudaStream_t s, void** out) override {
    cudaError_t e = cudaMallocFromPoolAsync(out, size, pool_, s);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return false;
    }
    cuda_check(e, "cudaMallocFromPoolAsync");
    if (emulate_cap_ && attr(cudaMemPoolAttrReservedMemCurrent) > cap_) {
      cuda_check(cudaFreeAsync(*out, s), "cudaFreeAsync");
      return false;
    }
    return true;
  }
  void free(void* p, size_t, cudaStream_t s) override {
    cuda_check(cudaFreeAsync(p, s), "cudaFreeAsync");
  }
  uint64_t reserved_current() override { return attr(cudaMemPoolAttrReservedMemCurrent); }
  uint64_t reserved_peak() override { return attr(cudaMemPoolAttrReservedMemHigh); }
  void reset_peak() override {
    unsigned long long zero = 0;  // resets the high-water mark to the current value
    cuda_check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
               "cudaMemPoolSetAttribute(ReservedMemHigh)");
  }
  void release_cache() override {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }
  const char* cap_mechanism() override {
    return cap_ ? (emulate_cap_ ? "emulated_reserved_bytes" : "pool_max_size") : "none";
  }
};

#ifdef REPLAY_WITH_TORCH
namespace cca = c10::cuda::CUDACachingAllocator;

class TorchPeer : public Peer {
  uint64_t cap_;

  static auto stats() { return cca::getDeviceStats(0); }

 public:
  TorchPeer(uint64_t cap, size_t total) : cap_(cap) {
    int count = 0;
    cuda_check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    cca::init(count);
    if (cap) cca::setMemoryFraction((double)cap / (double)total, 0);
  }
  bool alloc(size_t size, cudaStream_t s, void** out) override {
    try {
      *out = cca::raw_alloc_with_stream(size, s);
    } catch (const c10::OutOfMemoryError&) {
      return false;
    } catch (const std::exception& ex) {
      die("raw_alloc_with_stream(%zu): %s", size, ex.what());
    }
    return true;
  }
  void free(void* p, size_t, cudaStream_t) override { cca::raw_delete(p); }
  uint64_t reserved_current() override { return (uint64_t)stats().reserved_bytes[0].current; }
  uint64_t reserved_peak() override { return (uint64_t)stats().reserved_bytes[0].peak; }
  void reset_peak() override { cca::resetPeakStats(0); }
  void release_cache() override {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cca::emptyCache();
  }
  const char* cap_mechanism() override { return cap_ ? "set_memory_fraction" : "none"; }
  std::string extra_json() override {
    auto s = stats();
    char buf[256];
    snprintf(buf, sizeof buf, ",\"segments_peak\":%" PRId64 ",\"num_alloc_retries\":%" PRId64,
             (int64_t)s.segment[0].peak, (int64_t)s.num_alloc_retries);
    return buf;
  }
};
#endif

#ifdef REPLAY_WITH_GPUMEM
class GpumemPeer : public Peer {
  gpumem_t* gm_ = nullptr;

  gpumem_stats_t stats() {
    gpumem_stats_t s;
    gpumem_get_stats(gm_, &s);
    return s;
  }

 public:
  GpumemPeer(gpumem_policy_t policy, uint64_t cap) {
    gpumem_cuda_options_t co;
    gpumem_cuda_options_init(&co);
    gpumem_status_t st = GPUMEM_OK;
    gpumem_backend_t* be = gpumem_cuda_create(&co, &st);
    if (!be) die("gpumem_cuda_create: %s (%s)", gpumem_strerror(st), gpumem_last_error());
    gpumem_options_t o;
    gpumem_options_init(&o);
    const char* conf = getenv("GPUMEM_CONF");
    if (conf && *conf && gpumem_options_parse(&o, conf) != GPUMEM_OK)
      die("GPUMEM_CONF: %s", gpumem_last_error());
    o.policy = policy;
    o.own_backend = 1;
    gm_ = gpumem_create(be, &o, &st);
    if (!gm_) die("gpumem_create: %s (%s)", gpumem_strerror(st), gpumem_last_error());
    if (cap && gpumem_set_limit(gm_, cap) != GPUMEM_OK)
      die("gpumem_set_limit: %s", gpumem_last_error());
  }
  ~GpumemPeer() override { gpumem_destroy(gm_); }
  bool alloc(size_t size, cudaStream_t s, void** out) override {
    gpumem_status_t st = gpumem_malloc(gm_, size, (gpumem_stream_t)(uintptr_t)s, out);
    if (st == GPUMEM_ERR_OUT_OF_MEMORY) return false;
    if (st != GPUMEM_OK)
      die("gpumem_malloc(%zu): %s (%s)", size, gpumem_strerror(st), gpumem_last_error());
    return true;
  }
  void free(void* p, size_t, cudaStream_t) override {
    gpumem_status_t st = gpumem_free(gm_, p);
    if (st != GPUMEM_OK) die("gpumem_free: %s (%s)", gpumem_strerror(st), gpumem_last_error());
  }
  bool record_stream(void* p, cudaStream_t s) override {
    gpumem_status_t st = gpumem_record_stream(gm_, p, (gpumem_stream_t)(uintptr_t)s);
    if (st != GPUMEM_OK) die("gpumem_record_stream: %s", gpumem_last_error());
    return true;
  }
  uint64_t reserved_current() override { return (uint64_t)stats().reserved_bytes[0].current; }
  uint64_t reserved_peak() override { return (uint64_t)stats().reserved_bytes[0].peak; }
  void reset_peak() override { gpumem_reset_peak_stats(gm_); }
  void release_cache() override {
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (gpumem_empty_cache(gm_) != GPUMEM_OK) die("gpumem_empty_cache: %s", gpumem_last_error());
  }
  const char* cap_mechanism() override { return "gpumem_set_limit"; }
  std::string extra_json() override {
    gpumem_stats_t s = stats();
    char buf[320];
    snprintf(buf, sizeof buf,
             ",\"segments_peak\":%" PRId64 ",\"num_alloc_retries\":%" PRId64
             ",\"num_syncs\":%" PRId64 ",\"pages_mapped\":%" PRId64 ",\"virtual_memory\":%d",
             (int64_t)s.segment[0].peak, (int64_t)s.num_alloc_retries, (int64_t)s.num_syncs,
             (int64_t)s.num_pages_mapped, s.virtual_memory);
    return buf;
  }
};
#endif

// ---- the replay ---------------------------------------------------------------

struct PassResult {
  bool oom = false;
  size_t oom_event = 0;
  uint64_t ops = 0;
  double ns = 0;
};

struct Sampler {
  Peer* peer = nullptr;
  size_t baseline_free = 0;
  uint64_t max_reserved = 0;
  uint64_t device_used_peak = 0;
  int samples = 0;
  void after_alloc() {
    uint64_t r = peer->reserved_current();
    if (r <= max_reserved) return;
    max_reserved = r;
    size_t fr = 0, tot = 0;
    cuda_check(cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo");
    samples++;
    if (fr < baseline_free)
      device_used_peak = std::max<uint64_t>(device_used_peak, baseline_free - fr);
  }
};

// One pass: every event in order, timed as a whole (the sampler, when given,
// runs inside and the time is then not reported). Leftovers are freed after.
PassResult run_pass(const Trace& t, Peer& peer, const std::vector<cudaStream_t>& streams,
                    std::vector<void*>& ptr, std::vector<uint64_t>& size,
                    std::vector<uint32_t>& owner, Sampler* sampler) {
  PassResult r;
  const size_t n = t.events.size();
  auto t0 = std::chrono::steady_clock::now();
  size_t i = 0;
  for (; i < n; i++) {
    const Event& e = t.events[i];
    if (e.op == ALLOC) {
      void* p = nullptr;
      r.ops++;
      if (!peer.alloc(e.size, streams[e.stream], &p)) {
        r.oom = true;
        r.oom_event = i;
        break;
      }
      ptr[e.slot] = p;
      size[e.slot] = e.size;
      owner[e.slot] = e.stream;
      if (sampler) sampler->after_alloc();
    } else if (e.op == FREE) {
      r.ops++;
      if (ptr[e.slot]) peer.free(ptr[e.slot], size[e.slot], streams[owner[e.slot]]);
      ptr[e.slot] = nullptr;
    } else if (ptr[e.slot]) {
      peer.record_stream(ptr[e.slot], streams[e.stream]);
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  r.ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  for (size_t k = 0; k < ptr.size(); k++) {
    if (!ptr[k]) continue;
    peer.free(ptr[k], size[k], streams[owner[k]]);
    ptr[k] = nullptr;
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return r;
}

void json_string(const char* s) {
  putchar('"');
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') putchar('\\');
    if ((unsigned char)*s < 0x20) {
      printf("\\u%04x", (unsigned char)*s);
      continue;
    }
    putchar(*s);
  }
  putchar('"');
}

int usage() {
  fputs(
      "usage: replay_peers [--passes N] [--cap BYTES] [--single-stream] [--no-sample] TRACE PEER\n"
      "       replay_peers --parse-only TRACE\n"
      "PEER: torch torch_exp async cudamalloc gpumem gpumem_pytorch\n",
      stderr);
  return 2;
}

// PyTorch reads PYTORCH_CUDA_ALLOC_CONF when its library is loaded, before
// main: make sure the environment is right and start over if it was not.
void ensure_torch_env(const std::string& peer, char** argv) {
  const char* want = peer == "torch_exp" ? "expandable_segments:True" : nullptr;
  const char* have = getenv("PYTORCH_CUDA_ALLOC_CONF");
  const char* have2 = getenv("PYTORCH_ALLOC_CONF");
  bool ok = want ? (have && strcmp(have, want) == 0 && !have2) : (!have && !have2);
  if (ok) return;
  if (getenv("REPLAY_PEERS_REEXEC")) die("cannot set PYTORCH_CUDA_ALLOC_CONF for %s", peer.c_str());
  unsetenv("PYTORCH_ALLOC_CONF");
  if (want)
    setenv("PYTORCH_CUDA_ALLOC_CONF", want, 1);
  else
    unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  setenv("REPLAY_PEERS_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  die("re-exec for the PyTorch environment failed: %s", strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  int passes = 5;
  uint64_t cap = 0;
  bool single_stream = false, sample = true, parse_only = false;
  std::vector<const char*> pos;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--passes" && i + 1 < argc) {
      passes = atoi(argv[++i]);
    } else if (a == "--cap" && i + 1 < argc) {
      cap = strtoull(argv[++i], nullptr, 10);
    } else if (a == "--single-stream") {
      single_stream = true;
    } else if (a == "--no-sample") {
      sample = false;
    } else if (a == "--parse-only") {
      parse_only = true;
    } else if (a.size() > 1 && a[0] == '-') {
      return usage();
    } else {
      pos.push_back(argv[i]);
    }
  }
  if (parse_only && pos.size() == 1) {
    Trace t = load_trace(pos[0]);
    printf("{\"trace\":");
    json_string(pos[0]);
    printf(
        ",\"events\":%zu,\"allocations\":%zu,\"frees\":%zu,\"record_streams\":%zu"
        ",\"streams\":%zu,\"peak_live_bytes\":%" PRIu64 "}\n",
        t.events.size(), t.allocs, t.frees, t.records, t.stream_values.size(), t.peak_live);
    return 0;
  }
  if (pos.size() != 2 || passes < 1) return usage();
  const std::string peer_name = pos[1];
  if (peer_name == "torch" || peer_name == "torch_exp") ensure_torch_env(peer_name, argv);
  if (cap) {
    passes = 1;
    sample = false;
  }

  Trace t = load_trace(pos[0]);

  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  cuda_check(cudaFree(nullptr), "cudaFree(0) (context creation)");
  size_t free0 = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");

  std::vector<cudaStream_t> streams(t.stream_values.size(), nullptr);
  for (size_t k = 0; k < streams.size(); k++) {
    if (t.stream_values[k] == 0 || single_stream) continue;
    cuda_check(cudaStreamCreateWithFlags(&streams[k], cudaStreamNonBlocking), "cudaStreamCreate");
  }

  std::unique_ptr<Peer> peer;
  if (peer_name == "cudamalloc") {
    peer.reset(new CudaMallocPeer(cap));
  } else if (peer_name == "async") {
    peer.reset(new AsyncPeer(cap));
#ifdef REPLAY_WITH_TORCH
  } else if (peer_name == "torch" || peer_name == "torch_exp") {
    peer.reset(new TorchPeer(cap, total));
#endif
#ifdef REPLAY_WITH_GPUMEM
  } else if (peer_name == "gpumem") {
    peer.reset(new GpumemPeer(GPUMEM_POLICY_DEFAULT, cap));
  } else if (peer_name == "gpumem_pytorch") {
    peer.reset(new GpumemPeer(GPUMEM_POLICY_PYTORCH, cap));
#endif
  } else {
    fprintf(stderr, "replay_peers: peer '%s' unknown or not built in\n", peer_name.c_str());
    return usage();
  }

  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t baseline_free = 0;
  cuda_check(cudaMemGetInfo(&baseline_free, &total), "cudaMemGetInfo");

  std::vector<void*> ptr(t.slots, nullptr);
  std::vector<uint64_t> size(t.slots, 0);
  std::vector<uint32_t> owner(t.slots, 0);
  std::vector<double> ns_per_op;
  uint64_t peak_reserved = 0;
  std::string extra;
  PassResult first;
  for (int p = 0; p < passes; p++) {
    PassResult r = run_pass(t, *peer, streams, ptr, size, owner, nullptr);
    if (p == 0) {
      first = r;
      peak_reserved = peer->reserved_peak();
      extra = peer->extra_json();
    }
    if (r.oom) {
      if (!cap) die("out of memory at event %zu without a cap", r.oom_event);
      first = r;
      break;
    }
    ns_per_op.push_back(r.ops ? r.ns / (double)r.ops : 0);
  }

  Sampler sampler;
  if (sample && !first.oom) {
    peer->release_cache();
    peer->reset_peak();
    sampler.peer = peer.get();
    sampler.baseline_free = baseline_free;
    sampler.max_reserved = peer->reserved_current();
    run_pass(t, *peer, streams, ptr, size, owner, &sampler);
  }

  double cold = ns_per_op.empty() ? -1 : ns_per_op[0];
  double warm = -1;
  if (ns_per_op.size() > 1) {
    std::vector<double> w(ns_per_op.begin() + 1, ns_per_op.end());
    std::sort(w.begin(), w.end());
    size_t m = w.size();
    warm = m % 2 ? w[m / 2] : (w[m / 2 - 1] + w[m / 2]) / 2;
  }

  printf("{\"trace\":");
  json_string(pos[0]);
  printf(",\"peer\":\"%s\",\"events\":%zu,\"allocations\":%zu,\"frees\":%zu,\"streams\":%zu",
         peer_name.c_str(), t.events.size(), t.allocs, t.frees,
         single_stream ? (size_t)1 : t.stream_values.size());
  printf(",\"peak_live_bytes\":%" PRIu64 ",\"peak_reserved_bytes\":%" PRIu64
         ",\"reserved_ratio\":%.4f",
         t.peak_live, peak_reserved, (double)peak_reserved / (double)t.peak_live);
  if (sample && !first.oom)
    printf(",\"device_used_peak_bytes\":%" PRIu64 ",\"device_used_ratio\":%.4f,\"samples\":%d",
           sampler.device_used_peak, (double)sampler.device_used_peak / (double)t.peak_live,
           sampler.samples);
  else
    printf(",\"device_used_peak_bytes\":null");
  printf(",\"ns_per_op_cold\":%.1f", cold);
  if (warm >= 0)
    printf(",\"ns_per_op_warm\":%.1f", warm);
  else
    printf(",\"ns_per_op_warm\":null");
  printf(",\"passes\":%zu,\"device_total_bytes\":%zu,\"context_bytes\":%zu", ns_per_op.size(),
         total, free0 > baseline_free ? free0 - baseline_free : (size_t)0);
  if (cap)
    printf(",\"cap_bytes\":%" PRIu64 ",\"cap_mechanism\":\"%s\"", cap, peer->cap_mechanism());
  else
    printf(",\"cap_bytes\":null");
  if (first.oom)
    printf(",\"oom\":true,\"oom_event\":%zu", first.oom_event);
  else
    printf(",\"oom\":false");
  if (t.records) printf(",\"record_streams\":%zu", t.records);
  const char* conf = getenv("PYTORCH_CUDA_ALLOC_CONF");
  if (peer_name.rfind("torch", 0) == 0) {
    printf(",\"pytorch_cuda_alloc_conf\":");
    json_string(conf ? conf : "");
  }
  printf("%s}\n", extra.c_str());
  fflush(stdout);

  peer.reset();
  for (cudaStream_t s : streams)
    if (s) cudaStreamDestroy(s);
  return first.oom ? 3 : 0;
}
