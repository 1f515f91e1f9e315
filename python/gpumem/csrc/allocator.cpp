// gpumem's full PyTorch allocator (CUDA graphs, MemPool, cuDNN benchmark,
// IPC, stack frames), compiled by gpumem/torch.py against the installed
// torch at first use. torch.py puts the GM_* and GPUMEM_SHIM_OOM_STATUS
// definitions in front, from what the installed headers declare.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {
using c10::cuda::MempoolId_t;
namespace CA = c10::cuda::CUDACachingAllocator;

typedef int (*gm_filter_fn)(uintptr_t stream, void* arg);
struct PoolInfo {  // gpumem_pool_info_t
  uint32_t struct_size;
  int exists, use_count, routed;
  uint64_t allocations, allocated_bytes, reserved_bytes;
};
// gpumem_segment_source_t: where a pool's segments come from.
struct SegmentSource {
  int (*alloc)(void* ctx, size_t size, uintptr_t stream, uintptr_t* out);
  void (*free)(void* ctx, uintptr_t addr, size_t size, uintptr_t stream);
  void (*release)(void* ctx);
  void* ctx;
};

struct Api {
  void* (*malloc)(ssize_t, int, void*);
  void (*free)(void*, ssize_t, int, void*);
  const char* (*report)();
  int (*status)();
  void* (*allocator)(int);
  int (*begin)(void*, uint64_t, gm_filter_fn, void*);
  int (*end)(void*, uint64_t);
  int (*release)(void*, uint64_t);
  int (*retain)(void*, uint64_t);
  int (*info)(void*, uint64_t, PoolInfo*);
  size_t (*live)(void*, uint64_t, void**, size_t);
  const char* (*last_error)();
  uint64_t (*largest_free)(int);
  void (*init)(int);
  void (*reset)();
  void (*fraction)(double, int);
  void* (*base_alloc)(void*, size_t*);
  void (*record_stream)(void*, void*);
  int (*checkpoint)(void*, uint64_t, void**);
  size_t (*state_count)(const void*);
  void (*state_free)(void*);
  int (*restore)(void*, uint64_t, const void*, void**, size_t, size_t*, void**, size_t, size_t*);
  int (*ipc_export)(void*, char*, size_t, size_t*);
  int (*ipc_open)(int, const char*, size_t, void**);
  int (*ipc_close)(int, void*);
  int (*set_use_on_oom)(void*, uint64_t, int);
  int (*set_no_split)(void*, uint64_t, int);
  int (*set_segment_source)(void*, uint64_t, const SegmentSource*);
  void (*set_last_error)(const char*, ...);
};
Api g;

// torch.cuda.MemPool(allocator=...): the pool's segments come from that
// allocator (raw_alloc / raw_delete), as under PyTorch's own allocator,
// which caches and splits blocks inside them (ncclMemAlloc-backed pools for
// NCCL's buffer registration are the common case). gpumem keeps the
// allocator (a shared_ptr copy where torch passes one) until the pool's
// last segment went back.
struct PoolAllocator {
  GM_POOL_ALLOCATOR_ARG allocator;
};
int pool_segment_alloc(void* ctx, size_t size, uintptr_t stream, uintptr_t* out) {
  auto* a = static_cast<PoolAllocator*>(ctx);
  try {
    void* p = a->allocator->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream));
    if (p == nullptr) return GPUMEM_SHIM_OOM_STATUS;
    *out = reinterpret_cast<uintptr_t>(p);
    return 0;
  } catch (const std::exception& e) {
    // (an exception must not cross the C library; its words go in gpumem's report)
    g.set_last_error("the MemPool's own allocator failed to give %zu bytes: %s", size, e.what());
    return GPUMEM_SHIM_OOM_STATUS;
  }
}
void pool_segment_free(void* ctx, uintptr_t addr, size_t, uintptr_t) {
  auto* a = static_cast<PoolAllocator*>(ctx);
  try {
    a->allocator->raw_delete(reinterpret_cast<void*>(addr));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpumem: the MemPool's own allocator failed to free 0x%lx: %s\n",
                 (unsigned long)addr, e.what());
  }
}
void pool_segment_release(void* ctx) { delete static_cast<PoolAllocator*>(ctx); }

// Stack frames for snapshots (torch.cuda.memory._record_memory_history with
// stacks): while on, each allocation keeps the traceback torch's own
// unwinder gathers (CapturedTraceback, as PyTorch's allocator does: Python
// frames, and with stacks="all" TorchScript and C++ frames too), until the
// allocation is freed. Symbolized only when a snapshot asks.
std::atomic<int> g_stacks{0};    // gather for new allocations: 1 Python frames, 2 C++ too
std::atomic<int> g_tracking{0};  // some allocation may have a traceback
std::mutex g_tb_mu;
std::unordered_map<void*, std::shared_ptr<torch::CapturedTraceback>> g_tb;

void note_alloc(void* p) {
  if (p == nullptr || !g_stacks.load(std::memory_order_relaxed)) return;
  // outside every lock: the Python unwinder takes the GIL
  int what = g_stacks.load(std::memory_order_relaxed);
  auto tb = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/what == 2, /*cpp=*/what == 2);
  std::lock_guard<std::mutex> lock(g_tb_mu);
  g_tb[p] = std::move(tb);
}
// Before the free: once freed, p may be handed out (and noted) again.
void note_free(void* p) {
  if (!g_tracking.load(std::memory_order_relaxed)) return;
  std::shared_ptr<torch::CapturedTraceback> old;  // released after the lock
  std::lock_guard<std::mutex> lock(g_tb_mu);
  auto it = g_tb.find(p);
  if (it != g_tb.end()) {
    old = std::move(it->second);
    g_tb.erase(it);
  }
}

// Every DataPtr this allocator makes carries the pointer as its context and
// this deleter (as PyTorch's own allocator does), so that the ones a pool
// restore makes are like any other: torch compares deleters with
// raw_deleter() when it hands storages between them.
void gm_delete(void* p) {
  if (p == nullptr) return;
  note_free(p);
  g.free(p, 0, -1, nullptr);
}

// A pool checkpoint (gpumem_pool_checkpoint), freed with the last reference.
struct GmPoolState : c10::cuda::CUDACachingAllocator::AllocatorState {
  GmPoolState(void* s, uint64_t p) : state(s), pool(p) {}
  ~GmPoolState() override { g.state_free(state); }
  void* state;
  uint64_t pool;
};

void* shim_malloc(size_t size, int device, cudaStream_t stream) {
  void* p = g.malloc((ssize_t)size, device, stream);
  if (p == nullptr && size > 0) {
    const char* report = g.report();
    if (g.status() == GPUMEM_SHIM_OOM_STATUS) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, report);
    }
    TORCH_CHECK(false, report);
  }
  note_alloc(p);
  return p;
}
void shim_free(void* p, size_t size, int device, cudaStream_t stream) {
  note_free(p);
  g.free(p, (ssize_t)size, device, stream);
}

// A field of the frames text: control characters (its separators) become '?'.
void put_field(std::string& out, const std::string& text) {
  for (char c : text) out.push_back((unsigned char)c < 0x20 ? '?' : c);
}

int call_filter(uintptr_t stream, void* arg) {
  return (*static_cast<std::function<bool(cudaStream_t)>*>(arg))(reinterpret_cast<cudaStream_t>(stream)) ? 1 : 0;
}

class GpumemAllocator : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
  GpumemAllocator() : Base(shim_malloc, shim_free) {}

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto f = std::make_unique<std::function<bool(cudaStream_t)>>(std::move(filter));
    uint64_t pid = pool_id(device, id);
    check(g.begin(g.allocator(device), pid, call_filter, f.get()), "beginAllocateToPool");
    filters_[pid] = std::move(f);
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t pid = pool_id(device, id);
    check(g.end(g.allocator(device), pid), "endAllocateToPool");
    filters_.erase(pid);
  }
  void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    check(g.release(g.allocator(device), pool_id(device, id)), "releasePool");
  }
#if GM_HAVE_createOrIncrefPool
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id,
                          GM_POOL_ALLOCATOR_ARG allocator) override {
    std::lock_guard<std::mutex> lock(mu_);
    void* gm = g.allocator(device);
    uint64_t pid = pool_id(device, id);
    check(g.retain(gm, pid), "createOrIncrefPool");
    // (gpumem itself as the pool's allocator: an ordinary pool)
    if (allocator == nullptr || &*allocator == this) return;
    PoolInfo info{};
    info.struct_size = sizeof info;
    check(g.info(gm, pid, &info), "createOrIncrefPool");
    if (info.use_count > 1) return;  // the allocator is the pool's from its creation on
    auto* a = new PoolAllocator{allocator};
    SegmentSource source{pool_segment_alloc, pool_segment_free, pool_segment_release, a};
    int status = g.set_segment_source(gm, pid, &source);
    if (status != 0) {
      delete a;  // (refused: gpumem kept nothing)
      std::string why = g.last_error();
      g.release(gm, pid);
      TORCH_CHECK(false, "gpumem: createOrIncrefPool: ", why);
    }
  }
#endif
#if GM_HAVE_setUseOnOOM
  // MemPool(use_on_oom=True): a request outside every pool that finds no
  // memory may take the pool's cached memory before out of memory.
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(mu_);
    check(g.set_use_on_oom(g.allocator(device), pool_id(device, id), use_on_oom ? 1 : 0),
          "setUseOnOOM");
  }
#endif
#if GM_HAVE_setNoSplit
  // MemPool(no_split=True): each allocation of the pool a segment of its own.
  void setNoSplit(c10::DeviceIndex device, MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    check(g.set_no_split(g.allocator(device), pool_id(device, id), 1), "setNoSplit");
  }
#endif
#if GM_HAVE_getPoolUseCount
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    PoolInfo info{};
    check(g.info(g.allocator(device), pool_id(device, id), &info), "getPoolUseCount");
    return info.use_count;
  }
#endif
#if GM_HAVE_checkPoolLiveAllocations
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    uint64_t pid;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pid = pool_id(device, id);
    }
    void* gm = g.allocator(device);
    size_t n = g.live(gm, pid, nullptr, 0);
    std::vector<void*> ptrs(n + 16);
    n = g.live(gm, pid, ptrs.data(), ptrs.size());
    if (n != expected.size() || n > ptrs.size()) return false;
    for (size_t i = 0; i < n; i++)
      if (!expected.count(ptrs[i])) return false;
    return true;
  }
#endif
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    // What one allocation can get without the device refusing: gpumem maps
    // pages under a block on demand, so free device memory counts too.
    *largestBlock = (size_t)g.largest_free(device);
  }
  // CUDA IPC (torch.multiprocessing): the pages under the allocation go to
  // the other process as file descriptors (gpumem_ipc_export); that
  // process must run gpumem too, whose getIpcDevPtr maps them.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    std::vector<char> buf(1024);
    size_t need = 0;
    int st = g.ipc_export(ptr, buf.data(), buf.size(), &need);
    if (st == 0 && need > buf.size()) {
      buf.resize(need);
      st = g.ipc_export(ptr, buf.data(), buf.size(), &need);
    }
    TORCH_CHECK(st == 0 && need > 0 && need <= buf.size(),
                "gpumem: sharing a CUDA tensor with another process (CUDA IPC) failed: ",
                g.last_error());
    c10::cuda::CUDACachingAllocator::ShareableHandle handle;
    handle.offset = 0;
    handle.handle = std::string(buf.data(), need - 1);
    return handle;
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = nullptr;
    int st = g.ipc_open((int)device, handle.data(), handle.size(), &p);
    TORCH_CHECK(st == 0,
                "gpumem: opening a CUDA tensor shared by another process (CUDA IPC) failed: ",
                g.last_error(),
                " (the sending process must run gpumem too: gpumem shares its memory as file "
                "descriptors, not as cudaIpcGetMemHandle handles)");
    int dev = (int)device;
    return std::shared_ptr<void>(p, [dev](void* q) { g.ipc_close(dev, q); });
  }
  std::string name() override { return "gpumem"; }

  c10::DataPtr allocate(size_t size) GM_ALLOCATE_CONST override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = size ? shim_malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream()) : nullptr;
    return {p, p, &gm_delete, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &gm_delete; }
  void* raw_alloc(size_t size) override {
    return raw_alloc_with_stream(size, c10::cuda::getCurrentCUDAStream().stream());
  }
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return size ? shim_malloc(size, device, stream) : nullptr;
  }
  void raw_delete(void* p) override { gm_delete(p); }

  // torch.compile's CUDA graph trees: a checkpoint of a pool's live
  // allocations after each recorded graph, and the pool put back to one
  // before a new branch is recorded.
  std::shared_ptr<CA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                         MempoolId_t id) override {
    uint64_t pid;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pid = pool_id(device, id);
    }
    void* state = nullptr;
    check(g.checkpoint(g.allocator(device), pid, &state), "getCheckpointState");
    return std::make_shared<GmPoolState>(state, pid);
  }
  CA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                             std::shared_ptr<CA::AllocatorState> pps) override {
    auto* s = dynamic_cast<GmPoolState*>(pps.get());
    TORCH_CHECK(s != nullptr, "gpumem: setCheckpointPoolState was given a state gpumem did not make");
    void* gm = g.allocator(device);
    PoolInfo info{};
    info.struct_size = sizeof info;
    check(g.info(gm, s->pool, &info), "setCheckpointPoolState");
    std::vector<void*> freed(info.allocations + 1), made(g.state_count(s->state) + 1);
    size_t num_freed = 0, num_made = 0;
    int status = g.restore(gm, s->pool, s->state, freed.data(), freed.size(), &num_freed, made.data(),
                           made.size(), &num_made);
    CA::CheckpointDelta delta;
    delta.ptrs_freed.assign(freed.begin(), freed.begin() + num_freed);
    for (size_t i = 0; i < num_made; i++)
      delta.dataptrs_allocd.emplace_back(made[i], made[i], &gm_delete,
                                         c10::Device(c10::DeviceType::CUDA, device));
    // (on failure the allocations made so far are freed with delta)
    check(status, "setCheckpointPoolState");
    return delta;
  }

 private:
  // torch's (first, second) pool ids, per device, as gpumem's numbers.
  uint64_t pool_id(c10::DeviceIndex device, MempoolId_t id) {
    auto key = std::make_pair((int)device, id);
    auto it = ids_.find(key);
    if (it != ids_.end()) return it->second;
    uint64_t n = ++next_id_;
    ids_.emplace(key, n);
    return n;
  }
  static void check(int status, const char* what) {
    TORCH_CHECK(status == 0, "gpumem: ", what, ": ", g.last_error());
  }
  std::mutex mu_;
  std::map<std::pair<int, MempoolId_t>, uint64_t> ids_;
  std::map<uint64_t, std::unique_ptr<std::function<bool(cudaStream_t)>>> filters_;
  uint64_t next_id_ = 0;
};
}  // namespace

extern "C" {
// Turns the gathering of stack frames for new allocations on (1: Python
// frames; 2: Python, TorchScript and C++ frames, stacks="all") or off (0).
__attribute__((visibility("default"))) void gpumem_graphs_stacks(int what) {
  if (what) g_tracking.store(1);
  g_stacks.store(what == 2 ? 2 : what ? 1 : 0);
}

// The frames (Python; C++ too where gathered) of the live allocations at
// ptrs[0..n), innermost first,
// as text: one line per pointer (empty: none), frames separated by 0x1e,
// each "filename 0x1f line 0x1f name". Written to out when it fits in cap
// (with a NUL); returns the bytes needed, NUL included. Called with the GIL
// held (ctypes.PyDLL): symbolizing reads Python code objects.
__attribute__((visibility("default"))) size_t gpumem_graphs_frames(void* const* ptrs, size_t n, char* out,
                                                                    size_t cap) {
  std::vector<std::shared_ptr<torch::CapturedTraceback>> held(n);
  std::vector<torch::CapturedTraceback*> todo;
  std::vector<size_t> which;
  {
    std::lock_guard<std::mutex> lock(g_tb_mu);
    for (size_t i = 0; i < n; i++) {
      auto it = g_tb.find(ptrs[i]);
      if (it == g_tb.end()) continue;
      held[i] = it->second;
      todo.push_back(held[i].get());
      which.push_back(i);
    }
  }
  std::vector<std::string> lines(n);
  if (!todo.empty()) {
    torch::SymbolizedTracebacks s = torch::symbolize(todo);
    for (size_t k = 0; k < s.tracebacks.size() && k < which.size(); k++) {
      std::string& line = lines[which[k]];
      for (uint64_t f : s.tracebacks[k]) {
        if (f >= s.all_frames.size()) continue;
        const auto& fr = s.all_frames[f];
        if (!line.empty()) line.push_back('\x1e');
        put_field(line, fr.filename);
        line.push_back('\x1f');
        line += std::to_string((unsigned long long)fr.lineno);
        line.push_back('\x1f');
        put_field(line, fr.funcname);
      }
    }
  }
  std::string text;
  for (size_t i = 0; i < n; i++) {
    text += lines[i];
    text.push_back('\n');
  }
  if (text.size() + 1 <= cap) std::memcpy(out, text.c_str(), text.size() + 1);
  return text.size() + 1;
}

// fns: the entry points of libgpumem, in Api's order. Installs the
// allocator as PyTorch's; 0, or -1 with the reason in err.
__attribute__((visibility("default"))) int gpumem_graphs_install(void** fns, char* err, size_t cap) {
  try {
    std::memcpy(&g, fns, sizeof g);
    auto a = std::make_shared<GpumemAllocator>();
    a->set_init_fn([](int n) { g.init(n); });
    a->set_reset_fn([]() { g.reset(); });
    a->set_memory_fraction_fn([](double f, int d) { g.fraction(f, d); });
    a->set_base_alloc_fn([](void* p, size_t* size) { return g.base_alloc(p, size); });
    a->set_record_stream_fn([](void* p, cudaStream_t s) { g.record_stream(p, s); });
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, cap, "%s", e.what());
    return -1;
  }
}
}
