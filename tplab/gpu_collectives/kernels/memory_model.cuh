// All-reduce kernels over peer memory (CUDA IPC), one node, one process per GPU.  tplab.gpu_collectives.peer_memory
// compiles the files of this folder as one source, in the order of peer_kernels.KERNEL_FILES (this one first: the
// memory model and the helpers every kernel uses), with NVRTC (through CuPy), and launches the kernels; read its
// docstring first.
//
// Every rank owns one shared buffer that all the others have mapped (bufs[q] is rank q's, read over NVLink)
// and one array of flags that the others write to. Kernels synchronise with their peers through those flags,
// never through the host, so a whole all-reduce is one launch and can be captured in a CUDA graph.
//
// Work is split the same way on every rank: block b of every GPU handles the same elements, so block b
// only ever waits for block b of its peers (barrier below), and the blocks of one GPU never wait for each
// other. Elements are moved in 16-byte packs (8 bf16, 4 float, 2 double) for wide loads and stores.

struct bf16_bits { unsigned short b; };   // bfloat16: the top 16 bits of a float32
struct f16_bits { unsigned short b; };    // IEEE half

#define MAX_RANKS 8

// ---- accumulation: every type is summed in Acc (float for 16-bit floats) and rounded once on store ------
template <typename T> struct Num { typedef T Acc;
    static __device__ __forceinline__ Acc up(T v) { return v; }
    static __device__ __forceinline__ T down(Acc v) { return v; } };

template <> struct Num<bf16_bits> { typedef float Acc;
    static __device__ __forceinline__ float up(bf16_bits v) { return __uint_as_float(((unsigned int)v.b) << 16); }
    static __device__ __forceinline__ bf16_bits down(float v) {           // round to nearest even, NaN kept
        unsigned int u = __float_as_uint(v);
        bf16_bits r;
        r.b = ((u & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u >> 16) | 0x40u)
                                                : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        return r; } };

template <> struct Num<f16_bits> { typedef float Acc;
    static __device__ __forceinline__ float up(f16_bits v) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.b)); return f; }
    static __device__ __forceinline__ f16_bits down(float v) {
        f16_bits h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.b) : "f"(v)); return h; } };

template <typename T> union Pack {                 // 16 bytes seen as raw bits or as elements
    uint4 raw;
    T e[16 / sizeof(T)];
};

// ---- flags: release/acquire at system scope, so a peer that sees the flag also sees the data -----------
__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
    unsigned int v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }

// Data from a peer's buffer: cached in L2 only (.cg), never in this SM's L1, which does not see the peer's
// later writes. (Chunks are also whole multiples of 128 bytes, so no cache line spans two chunks.)
__device__ __forceinline__ uint4 load_peer(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v; }

__device__ __forceinline__ long long lmin(long long a, long long b) { return a < b ? a : b; }

// Block b of this rank meets block b of the ranks in `who` (a bit mask): each tells the others "I have
// passed barrier number e" by writing e into their flags[b][me], and waits until its own flags[b][q] >= e.
// e counts the barriers this block has passed; the count lives in device memory (epochs[b]) so that a
// graph replay goes on counting. All ranks pass the same barriers, so their counts agree.
// (No __threadfence_system: bar.sync orders the block's writes before thread q's release store, which is
// cumulative; the fence costs microseconds per barrier and is what a first version measured.)
__device__ void barrier_at(int slot, unsigned int* const* flags, unsigned int* epochs, int rank, unsigned int who) {
    __syncthreads();                                     // this block's writes happen before the signal
    const unsigned int e = epochs[slot] + 1;
    const int q = threadIdx.x;
    if (q < MAX_RANKS && q != rank && ((who >> q) & 1u)) {
        store_release(flags[q] + slot * MAX_RANKS + rank, e);
        const unsigned int* mine = flags[rank] + slot * MAX_RANKS + q;
        while ((int)(load_acquire(mine) - e) < 0) { }       // wrap-safe "mine < e"
    }
    __syncthreads();
    if (threadIdx.x == 0) epochs[slot] = e;
}


// ---- lines that carry their own "ready" mark (NCCL's LL protocol) ------------------------------------------
// A line is 16 bytes {lo, tag, hi, tag}: 8 bytes of payload, each 4-byte half beside the same tag. A 16-byte
// store reaches a peer as two 8-byte halves that are each whole, so a line whose two tags both read t holds
// the payload stored with tag t. No fence and no separate flag: the reader polls the line itself. (A
// release store would first wait until this thread's earlier stores had reached the peers: about a
// microsecond and a half over NVLink.) The agreement's signatures and one_shot_ll's data travel this way.
__device__ __forceinline__ void store_line(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
__device__ __forceinline__ uint4 load_line(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v; }
__device__ __forceinline__ bool line_has(uint4 v, unsigned int tag) { return v.y == tag && v.w == tag; }
// Where a line must also order other data (one_shot's staged input): a fence before sending it makes the
// release (acq_rel: what st.release does, not the costlier sequentially consistent __threadfence_system()),
// an acquire load of its tag once it has come makes the acquire.
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---- programmatic dependent launch (sm_90 and later) ------------------------------------------------------
// tplab launches the all-reduce kernels with it (peer_kernels.fast_launcher): the GPU may schedule the next
// kernel of the stream while this one still runs, and that kernel waits here, at its first line, until
// this one has ended and its writes are visible -- what a kernel boundary guarantees, without the gap
// between two launches (about a microsecond in a CUDA graph). Each block also lets the next kernel be
// scheduled at once (it still waits here). Launched without the attribute, both instructions do nothing.
__device__ __forceinline__ void after_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

extern "C" __global__ void pdl_probe() { after_previous_kernel(); }   // (programmatic_launch.works_here)

