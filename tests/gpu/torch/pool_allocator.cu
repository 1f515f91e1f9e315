// A CUDA allocator for torch.cuda.memory.CUDAPluggableAllocator, given to a
// torch.cuda.MemPool(allocator=...) by test_graphs.py: it takes its memory
// with cudaMalloc and keeps a record of what it handed out, so the test can
// ask whether a tensor's memory came from it and whether all of it came back.
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <sys/types.h>

#define MAX_SEGMENTS 1024

static uintptr_t seg_addr[MAX_SEGMENTS];
static size_t seg_size[MAX_SEGMENTS];
static int seg_live[MAX_SEGMENTS];
static int num_segs;
static long mallocs, frees;

extern "C" {
void* pool_test_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)device;
  (void)stream;
  void* p = nullptr;
  if (num_segs == MAX_SEGMENTS || cudaMalloc(&p, (size_t)size) != cudaSuccess) return nullptr;
  seg_addr[num_segs] = (uintptr_t)p;
  seg_size[num_segs] = (size_t)size;
  seg_live[num_segs++] = 1;
  mallocs++;
  return p;
}

void pool_test_free(void* p, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  for (int i = 0; i < num_segs; i++) {
    if (seg_live[i] && seg_addr[i] == (uintptr_t)p) seg_live[i] = 0;
  }
  frees++;
  cudaFree(p);
}

// 0: mallocs, 1: frees, 2: segments still live
long pool_test_count(int which) {
  if (which == 0) return mallocs;
  if (which == 1) return frees;
  long live = 0;
  for (int i = 0; i < num_segs; i++) live += seg_live[i];
  return live;
}

// Whether [p, p + n) lies in a live segment of this allocator.
int pool_test_owns(uintptr_t p, size_t n) {
  for (int i = 0; i < num_segs; i++) {
    if (seg_live[i] && p >= seg_addr[i] && p + n <= seg_addr[i] + seg_size[i]) return 1;
  }
  return 0;
}

// The size of the k-th segment handed out (in order), 0 past the last.
size_t pool_test_segment_size(int k) {
  return k >= 0 && k < num_segs ? seg_size[k] : 0;
}
}
