// Duet's CUDA kernels, compiled by NVRTC when a CUDA worker starts (see kernels.rs).
//
// Conventions, the CPU engine's exactly (engine/src/kernels), so a CUDA step computes what a
// CPU step does up to float reassociation:
// - activations f32, row-major [tokens][features]; weights f16 (dequantized once at upload);
// - RoPE rotates adjacent pairs (x[2i], x[2i+1]) with the CPU's cos/sin tables, uploaded, not
//   recomputed (device cosf/powf differ from the host's by ulps);
// - the KV pool has the CPU pool's layout (gpu/src/kv.rs): page-major, then layer, K then V,
//   then slot, then head, then head_dim; so a page, a run of pages and one layer of a page are
//   contiguous ranges and the transports copy them as they are.
//
// No headers: NVRTC without the toolkit's include directory must compile this, so halves are
// u16 converted with PTX instructions.

typedef unsigned short half_bits;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_bits f2h(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < warps) ? partial[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    float total = partial[0];
    __syncthreads();
    return total;
}

// out[t] = table[tokens[t]] (f16 rows to f32). Grid: tokens; block: any.
extern "C" __global__ void embed(const half_bits* table, const int* tokens, float* out, int dim) {
    int t = blockIdx.x;
    const half_bits* row = table + (long long)tokens[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(long long)t * dim + i] = h2f(row[i]);
}

// out[t] = x[t] / rms(x[t]) * w. Grid: tokens; block: a multiple of 32.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    const float* row = x + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += row[i] * row[i];
    ss = block_sum(ss);
    float scale = rsqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[(long long)blockIdx.x * dim + i] = row[i] * scale * w[i];
}

// Rotates every head of x[t] (n_heads * head_dim) at position pos[t]. Grid: tokens.
extern "C" __global__ void rope(float* x, const int* pos, const float* cos_t, const float* sin_t,
                                int n_heads, int head_dim, int half) {
    int t = blockIdx.x;
    int pairs = n_heads * (head_dim / 2);
    const float* c = cos_t + (long long)pos[t] * half;
    const float* s = sin_t + (long long)pos[t] * half;
    float* row = x + (long long)t * n_heads * head_dim;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / (head_dim / 2), i = p % (head_dim / 2);
        if (i >= half) continue;
        float* h = row + head * head_dim;
        float a = h[2 * i], b = h[2 * i + 1];
        h[2 * i] = a * c[i] - b * s[i];
        h[2 * i + 1] = a * s[i] + b * c[i];
    }
}

// gate = silu(gate) * up.
extern "C" __global__ void silu_mul(float* gate, const float* up, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y.
extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// y[t][o] = sum_i x[t][i] * w[o][i] (w: [out][in] f16, as GGUF stores linear layers).
// Grid: (out / 8, ceil(tokens / TOK)); block: 256 = 8 warps, one output row per warp; each
// warp reads its weight row once for TOK tokens, so batch decode reads weights once per step.
#define TOK 8
extern "C" __global__ void matmul_f16(const float* x, const half_bits* w, float* y, int tokens,
                                      int in, int out) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = blockIdx.x * 8 + warp;
    int t0 = blockIdx.y * TOK;
    if (o >= out) return;
    const half_bits* row = w + (long long)o * in;
    float acc[TOK];
    for (int k = 0; k < TOK; k++) acc[k] = 0.0f;
    for (int i = lane; i < in; i += 32) {
        float wi = h2f(row[i]);
        for (int k = 0; k < TOK; k++) {
            int t = t0 + k;
            if (t < tokens) acc[k] += wi * x[(long long)t * in + i];
        }
    }
    for (int k = 0; k < TOK; k++) {
        float v = warp_sum(acc[k]);
        int t = t0 + k;
        if (lane == 0 && t < tokens) y[(long long)t * out + o] = v;
    }
}

// Element offset of (page, layer, k-or-v, slot) in the pool (gpu/src/kv.rs slot_offset).
__device__ __forceinline__ long long slot_offset(int page, int layer, int v, int slot, int n_layers,
                                                 int page_size, int kv_dim) {
    long long block = (long long)page_size * kv_dim;
    long long page_elems = block * 2 * n_layers;
    return (long long)page * page_elems + (long long)(layer * 2 + v) * block +
           (long long)slot * kv_dim;
}

template <typename T> __device__ __forceinline__ T store_kv(float x);
template <> __device__ __forceinline__ half_bits store_kv<half_bits>(float x) { return f2h(x); }
template <> __device__ __forceinline__ float store_kv<float>(float x) { return x; }

// Stores k[t], v[t] (kv_dim each) of one layer at token slot (page[t], slot[t]) of the pool.
template <typename T>
__device__ void kv_write(const float* k, const float* v, T* pool, const int* page,
                         const int* slot, int layer, int n_layers, int page_size, int kv_dim) {
    int t = blockIdx.x;
    long long ko = slot_offset(page[t], layer, 0, slot[t], n_layers, page_size, kv_dim);
    long long vo = slot_offset(page[t], layer, 1, slot[t], n_layers, page_size, kv_dim);
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        pool[ko + i] = store_kv<T>(k[(long long)t * kv_dim + i]);
        pool[vo + i] = store_kv<T>(v[(long long)t * kv_dim + i]);
    }
}

extern "C" __global__ void kv_write_f16(const float* k, const float* v, half_bits* pool,
                                        const int* page, const int* slot, int layer, int n_layers,
                                        int page_size, int kv_dim) {
    kv_write<half_bits>(k, v, pool, page, slot, layer, n_layers, page_size, kv_dim);
}

// The same into an f32 pool (the exact dtype).
extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* pool,
                                        const int* page, const int* slot, int layer, int n_layers,
                                        int page_size, int kv_dim) {
    kv_write<float>(k, v, pool, page, slot, layer, n_layers, page_size, kv_dim);
}

template <typename T> __device__ __forceinline__ float load_kv(const T* p);
template <> __device__ __forceinline__ float load_kv<half_bits>(const half_bits* p) { return h2f(*p); }
template <> __device__ __forceinline__ float load_kv<float>(const float* p) { return *p; }

// Causal attention of each query token over its sequence's pages, for prefill chunks and decode
// steps alike. Query t attends positions 0..=pos[t] of the sequence whose page table starts at
// tables[table_start[t]]. Grid: (tokens, n_heads); block: 32 (one warp per head: head_dim <= 256).
// Online softmax in f32, as the CPU kernel does.
template <typename T>
__device__ void attention(const float* q, const T* pool, const int* tables, const int* table_start,
                          const int* pos, float* out, int n_heads, int n_kv_heads, int head_dim,
                          int layer, int n_layers, int page_size, float scale) {
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    int kv_dim = n_kv_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + (long long)t * n_heads * head_dim + h * head_dim;
    const int* table = tables + table_start[t];
    float qr[8], acc[8];
    int per = (head_dim + 31) / 32;
    for (int j = 0; j < per; j++) {
        int d = lane + 32 * j;
        qr[j] = d < head_dim ? qh[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int p = 0; p <= pos[t]; p++) {
        int page = table[p / page_size], slot = p % page_size;
        const T* kp = pool + slot_offset(page, layer, 0, slot, n_layers, page_size, kv_dim) + kvh * head_dim;
        const T* vp = pool + slot_offset(page, layer, 1, slot, n_layers, page_size, kv_dim) + kvh * head_dim;
        float dot = 0.0f;
        for (int j = 0; j < per; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) dot += qr[j] * load_kv<T>(kp + d);
        }
        float s = warp_sum(dot) * scale;
        float m2 = fmaxf(m, s);
        float corr = expf(m - m2), e = expf(s - m2);
        l = l * corr + e;
        for (int j = 0; j < per; j++) {
            int d = lane + 32 * j;
            acc[j] = acc[j] * corr + (d < head_dim ? e * load_kv<T>(vp + d) : 0.0f);
        }
        m = m2;
    }
    float* oh = out + (long long)t * n_heads * head_dim + h * head_dim;
    for (int j = 0; j < per; j++) {
        int d = lane + 32 * j;
        if (d < head_dim) oh[d] = acc[j] / l;
    }
}

extern "C" __global__ void attention_f16(const float* q, const half_bits* pool, const int* tables,
                                         const int* table_start, const int* pos, float* out,
                                         int n_heads, int n_kv_heads, int head_dim, int layer,
                                         int n_layers, int page_size, float scale) {
    attention<half_bits>(q, pool, tables, table_start, pos, out, n_heads, n_kv_heads, head_dim,
                         layer, n_layers, page_size, scale);
}

extern "C" __global__ void attention_f32(const float* q, const float* pool, const int* tables,
                                         const int* table_start, const int* pos, float* out,
                                         int n_heads, int n_kv_heads, int head_dim, int layer,
                                         int n_layers, int page_size, float scale) {
    attention<float>(q, pool, tables, table_start, pos, out, n_heads, n_kv_heads, head_dim, layer,
                     n_layers, page_size, scale);
}

// Greedy sampling: out[r] = the first index of the largest logit of row r (ties to the lowest
// index, as the CPU sampler). Grid: rows; block: 256.
extern "C" __global__ void argmax(const float* logits, int vocab, int* out) {
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = best_v[threadIdx.x + s];
            int i = best_i[threadIdx.x + s];
            if (v > best_v[threadIdx.x] || (v == best_v[threadIdx.x] && i < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0];
}
