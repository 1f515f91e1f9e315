/* Does the size of the physical allocations behind a range change how fast
 * kernels run over it? The default policy maps one 2 MiB physical page per
 * mapping; cudaMalloc and PyTorch's segments are one allocation each. If
 * the GPU's translation (TLB reach, fragment sizes) depends on it, kernels
 * over gpumem's memory run slower, and a training step with them.
 *
 * The same span is backed three ways: cudaMalloc; one cuMemCreate per 2 MiB
 * page, each mapped and made accessible on its own (what gpumem does); and
 * one cuMemCreate per 1 GiB. Over each, three kernels: a streaming copy
 * (bandwidth), 4-byte loads at random places over the whole span (every
 * load a translation), and 64 KiB chunks at random places (a tensor-sized
 * access). Prints the median of the repetitions, ms, per layout.
 *
 *   nvcc -O2 -o vmm_tlb bench/gpu/vmm_tlb.cu -lcuda
 *   ./vmm_tlb [span_gib] [reps]
 *
 * Needs a GPU; it only times. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

static void drv(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = "?";
  cuGetErrorName(r, &name);
  fprintf(stderr, "%s: %s\n", what, name);
  exit(1);
}

static void rt(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  fprintf(stderr, "%s: %s\n", what, cudaGetErrorName(e));
  exit(1);
}

__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* Streaming: the second half of the span from the first. */
__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

/* One 4-byte load per iteration at a random place in the span. */
__global__ void gather_kernel(const float* __restrict__ data, size_t words, int loads,
                              float* sink) {
  uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  float acc = 0.f;
  for (int k = 0; k < loads; k++) acc += data[mix(t * 1315423911ull + k) % words];
  if (acc == 12345.f) *sink = acc; /* keeps the loads */
}

/* Each block reads one 64 KiB chunk at a random place per iteration. */
__global__ void chunk_kernel(const float4* __restrict__ data, size_t chunks, int iters,
                             float* sink) {
  float acc = 0.f;
  for (int k = 0; k < iters; k++) {
    size_t c = mix(blockIdx.x * 7919ull + k) % chunks;
    const float4* p = data + c * (64 * 1024 / sizeof(float4));
    for (int i = threadIdx.x; i < 64 * 1024 / (int)sizeof(float4); i += blockDim.x) {
      float4 v = p[i];
      acc += v.x + v.w;
    }
  }
  if (acc == 12345.f) *sink = acc;
}

static int cmp_float(const void* a, const void* b) {
  float x = *(const float*)a, y = *(const float*)b;
  return (x > y) - (x < y);
}

static void run(const char* layout, char* base, size_t span, int reps, float* sink) {
  cudaEvent_t e0, e1;
  rt(cudaEventCreate(&e0), "event");
  rt(cudaEventCreate(&e1), "event");
  rt(cudaMemset(base, 1, span), "memset"); /* touch every page once */
  rt(cudaDeviceSynchronize(), "sync");
  const char* names[3] = {"copy", "gather", "chunks"};
  float* times = (float*)malloc(sizeof(float) * reps);
  printf("%-12s", layout);
  for (int kind = 0; kind < 3; kind++) {
    for (int r = 0; r < reps + 1; r++) {
      rt(cudaEventRecord(e0), "record");
      if (kind == 0)
        copy_kernel<<<1056, 512>>>((const float4*)base, (float4*)(base + span / 2),
                                   span / 2 / sizeof(float4));
      else if (kind == 1)
        gather_kernel<<<1056, 512>>>((const float*)base, span / sizeof(float), 64, sink);
      else
        chunk_kernel<<<1056, 256>>>((const float4*)base, span / (64 * 1024), 16, sink);
      rt(cudaEventRecord(e1), "record");
      rt(cudaEventSynchronize(e1), "sync");
      float ms = 0.f;
      rt(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
      if (r > 0) times[r - 1] = ms; /* the first run warms up */
    }
    qsort(times, reps, sizeof(float), cmp_float);
    printf("  %s %.3f ms (min %.3f)", names[kind], times[reps / 2], times[0]);
  }
  printf("\n");
  fflush(stdout);
  free(times);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

/* Reserves span bytes and backs them with physical allocations of piece
 * bytes, each mapped and given access on its own. */
static CUdeviceptr map_pieces(size_t span, size_t piece, CUmemGenericAllocationHandle* handles) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va;
  drv(cuMemAddressReserve(&va, span, 0, 0, 0), "reserve");
  for (size_t i = 0; i < span / piece; i++) {
    drv(cuMemCreate(&handles[i], piece, &prop, 0), "create");
    drv(cuMemMap(va + i * piece, piece, 0, handles[i], 0), "map");
    drv(cuMemSetAccess(va + i * piece, piece, &access, 1), "access");
  }
  return va;
}

static void unmap_pieces(CUdeviceptr va, size_t span, size_t piece,
                         CUmemGenericAllocationHandle* handles) {
  for (size_t i = 0; i < span / piece; i++) {
    drv(cuMemUnmap(va + i * piece, piece), "unmap");
    drv(cuMemRelease(handles[i]), "release");
  }
  drv(cuMemAddressFree(va, span), "address free");
}

int main(int argc, char** argv) {
  size_t span = (argc > 1 ? (size_t)atoi(argv[1]) : 8) * GIB;
  int reps = argc > 2 ? atoi(argv[2]) : 15;
  rt(cudaSetDevice(0), "device");
  rt(cudaFree(0), "context");
  float* sink;
  rt(cudaMalloc(&sink, sizeof(float)), "sink");
  cudaDeviceProp p;
  rt(cudaGetDeviceProperties(&p, 0), "props");
  printf("%s, span %zu GiB, median of %d runs per kernel\n", p.name, span / GIB, reps);
  CUmemGenericAllocationHandle* handles =
      (CUmemGenericAllocationHandle*)calloc(span / (2 * MIB), sizeof *handles);
  for (int round = 0; round < 2; round++) { /* twice, to see the spread */
    char* plain;
    rt(cudaMalloc(&plain, span), "cudaMalloc");
    run("cudaMalloc", plain, span, reps, sink);
    rt(cudaFree(plain), "cudaFree");
    size_t pieces[2] = {2 * MIB, GIB};
    const char* names[2] = {"vmm 2 MiB", "vmm 1 GiB"};
    for (int k = 0; k < 2; k++) {
      CUdeviceptr va = map_pieces(span, pieces[k], handles);
      run(names[k], (char*)va, span, reps, sink);
      unmap_pieces(va, span, pieces[k], handles);
    }
  }
  free(handles);
  return 0;
}
