// All-reduce kernels over peer memory (CUDA IPC), one node, one process per GPU.  tplab.gpu_collectives.peer_memory
// compiles this file with NVRTC (through CuPy) and launches the kernels; read its docstring first.
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

// ---- agreement: every collective call starts with the ranks comparing what they were asked to do --------
// Block 0 of every rank sends every peer's block 0 a line holding a 64-bit signature of its arguments
// (count, element type, a hash of op and algorithm), or REFUSED ("my input is bad: I only came to say so"),
// tagged with the agreement's number e, and polls its own lines until every peer's of number e is there.
// All equal: the kernel goes on. Not all equal: every rank sees it (each compares with all), every rank's
// kernel returns before it touches any data, and each writes what it saw into host memory (`status`),
// from where tplab raises on every rank. A peer that never comes (a program whose ranks diverged) is given
// up on after ctl->timeout_ns: status TIMEOUT, and this peer memory is unusable from then on.
// The other blocks of the grid wait for block 0's verdict, tagged with the call's number so that an older
// verdict is never taken for this call's. The verdict is a plain store (one_shot: a release), and none at all
// in a grid of one block: a release would first wait until block 0's pushes to the peers had landed,
// about a microsecond over NVLink, and the verdict orders no data (one_shot's staged input excepted). Signature 0 skips the step: the caller ran agree_only first (each
// call agrees exactly once on every rank, whatever path it takes). The lines alternate between two rows (the
// parity of e): a peer can be at most one call ahead, so it never overwrites the row still being read.
#define MAX_SLOTS 1024                                   // flag slots per rank (MAX_BLOCKS in peer_memory.py)
#define AGREE_SLOT (MAX_SLOTS - 3)
#define SIGNATURES (MAX_SLOTS * MAX_RANKS)               // words: the signature lines (2 rows) follow the flags
#define REFUSED 0xffffffffffffffffULL
enum { AGREED = 0, MISMATCH = 1, PEER_REFUSED = 2, TIMEOUT = 3, SELF_REFUSED = 4, FAILED_BEFORE = 5 };

struct Control {                      // this rank's own (device memory; peers never see it)
    unsigned int calls;               // collective calls finished here: bumped by the last block to finish
    unsigned int finished;            // blocks of the running call that have finished
    unsigned long long verdict;       // (call << 32) | code, published by block 0
    unsigned long long timeout_ns;
    unsigned int* status;             // host memory, mapped: code, peer, its signature (2 words), call, mine (2)
    unsigned int failed;              // an agreement failed here and the host has not raised it yet: the
                                      //  failed call's mark (failure_mark), 1 after a peer timed out
    unsigned int written;             // blocks of a one_shot that have written their part of the input
};

// What a kernel reads of this rank's counts, once, at its start: four independent loads in flight together
// (thread 0's), then one __syncthreads, instead of a load wherever a count is needed. Each load is a trip
// to L2 (a few hundred nanoseconds), and one after another on the path of every call they cost about as
// much as the agreement's NVLink crossing itself.
struct Call {
    unsigned int failed;              // Control::failed as the call started (failed_before says what it means)
    unsigned int number;              // this call's number: calls finished here + 1 (the same on every rank)
    unsigned int agreement;           // this call's agreement: agreements passed + 1 (block 0's to use: block 0
                                      //  moves the count once it has agreed)
    unsigned int barriers;            // barriers this block has passed (epochs[blockIdx.x]; finish writes it back)
};
__device__ __forceinline__ Call begin_call(const Control* ctl, const unsigned int* epochs) {
    __shared__ Call shared;
    if (threadIdx.x == 0) {
        Call c;
        c.failed = *(const volatile unsigned int*)&ctl->failed;
        c.number = *(const volatile unsigned int*)&ctl->calls + 1;
        c.agreement = *(const volatile unsigned int*)(epochs + AGREE_SLOT) + 1;
        c.barriers = *(const volatile unsigned int*)(epochs + blockIdx.x);
        shared = c;
    }
    __syncthreads();
    return shared;
}

// What Control::failed holds once call `number`'s agreement has failed (never 0, which means "none").
__device__ __forceinline__ unsigned int failure_mark(unsigned int number) { return number != 0u ? number : 1u; }

// Whether an earlier call failed: then this kernel stops without meeting anyone (its peers raised). A block
// that starts after block 0 of its own kernel has found this call's agreement failed sees this call's mark
// instead: it goes on to the verdict, and counts the call as every peer does. (Marking with a plain 1, such a
// block used to return uncounted, and this rank's call numbers then lagged its peers' by one.)
__device__ __forceinline__ bool failed_before(const Call& c) {
    return c.failed != 0u && c.failed != failure_mark(c.number);
}

// barrier_at for block b at its own slot, with the count in a register (Call::barriers): no load on the way.
__device__ __forceinline__ void barrier(unsigned int* const* flags, Call& c, int rank, unsigned int who) {
    __syncthreads();                                     // this block's writes happen before the signal
    const unsigned int e = ++c.barriers;
    const int q = threadIdx.x;
    if (q < MAX_RANKS && q != rank && ((who >> q) & 1u)) {
        store_release(flags[q] + blockIdx.x * MAX_RANKS + rank, e);
        const unsigned int* mine = flags[rank] + blockIdx.x * MAX_RANKS + q;
        while ((int)(load_acquire(mine) - e) < 0) { }       // wrap-safe "mine < e"
    }
    __syncthreads();
}

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void store_release_gpu(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
    unsigned long long v; asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ unsigned int load_acquire_gpu(const unsigned int* p) {
    unsigned int v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }

// Rank r's signature line in the row e & 1 of a rank's flags (``their_flags``: flags[q]); sending it tells q
// "I am at agreement e, with this signature". A kernel may send it first and meet the peers later
// (agree(..., signalled = true)): one_shot_ll pushes its data in between.
__device__ __forceinline__ uint4* signature_line(unsigned int* their_flags, unsigned int e, int r) {
    return (uint4*)(their_flags + SIGNATURES) + (e & 1u) * MAX_RANKS + r; }
__device__ __forceinline__ void send_signature(unsigned int* their_flags, unsigned int e, int rank,
                                               unsigned long long sig) {
    store_line(signature_line(their_flags, e, rank), make_uint4((unsigned int)sig, e, (unsigned int)(sig >> 32), e)); }

// The verdict of this call (AGREED or an error code), the same in every thread of every block.
// ``after_writes`` (one_shot): the agreement is also the kernel's data barrier. Every block has written its
// part of the input into this rank's buffer; block 0 waits for them all (a counter in local memory), then
// meets its peers' block 0 once -- one NVLink crossing for the whole call, whatever the grid. (Ordering:
// each block's writes, its fence and counter increment, block 0's acquire of the counter, a system-scope
// fence before the signature line goes out, and one after the peers' lines came in -- the fence-based
// release and acquire -- form one causality chain.) Signature 0 then still meets the peers but compares
// nothing.
__device__ int agree(Control* ctl, const Call& c, unsigned long long sig, unsigned int* const* flags,
                     unsigned int* epochs, int rank, int p, bool after_writes = false, bool signalled = false) {
    if (sig == 0 && !after_writes) return AGREED;        // agreed already, by agree_only before this kernel
    // After a failed agreement, kernels queued before the host has raised it (a rank whose call did not wait)
    // stop at once without meeting anyone: the peers raised and are not coming (PeerMemory.raise_pending
    // clears the flag on the stream when it raises).
    if (failed_before(c)) return FAILED_BEFORE;
    __shared__ int outcome[MAX_RANKS];
    __shared__ unsigned long long seen[MAX_RANKS];
    __shared__ int verdict;
    const unsigned int call = c.number;
    if (threadIdx.x < MAX_RANKS) outcome[threadIdx.x] = AGREED;
    __syncthreads();
    const bool count_writes = after_writes && gridDim.x > 1;   // (one block: __syncthreads orders its writes)
    if (count_writes && threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&ctl->written, 1u);
    }
    if (blockIdx.x == 0) {
        if (count_writes && threadIdx.x == 0) {
            while (load_acquire_gpu(&ctl->written) < gridDim.x) { }
            ctl->written = 0;                            // (the next kernel on this stream starts after this one)
        }
        __syncthreads();
        const unsigned int e = c.agreement;
        const int q = threadIdx.x;
        if (q < p && q != rank) {
            if (!signalled) {
                if (after_writes) fence_acq_rel_sys();      // (release: the staged input before the line)
                send_signature(flags[q], e, rank, sig);
            }
            const uint4* mine = signature_line(flags[rank], e, q);
            unsigned long long start = 0;                       // (the clock is read only when waiting)
            unsigned int spins = 0;
            int o = AGREED;
            uint4 line = load_line(mine);
            while (!line_has(line, e)) {
                if (start == 0) start = globaltimer();
                if ((++spins & 1023u) == 0 && globaltimer() - start > ctl->timeout_ns) { o = TIMEOUT; break; }
                line = load_line(mine);
            }
            if (o == AGREED) {
                if (after_writes) load_acquire((const unsigned int*)mine + 3);   // (acquire: the peer's staged
                                                                                 //  input after its line)
                const unsigned long long theirs = line.x | ((unsigned long long)line.z << 32);
                seen[q] = theirs;
                if (theirs != sig && sig != 0) o = theirs == REFUSED ? PEER_REFUSED : MISMATCH;
            }
            outcome[q] = o;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int code = sig == REFUSED ? SELF_REFUSED : AGREED, peer = -1;
            for (int r = 0; r < p; r++)
                if (outcome[r] > (peer < 0 ? AGREED : outcome[peer])) peer = r;
            if (peer >= 0 && code == AGREED) code = outcome[peer];
            epochs[AGREE_SLOT] = e;
            if (code != AGREED && code != SELF_REFUSED) {
                ctl->failed = failure_mark(call);
                volatile unsigned int* s = ctl->status;
                s[1] = (unsigned int)peer;
                s[2] = (unsigned int)(seen[peer] & 0xffffffffu);
                s[3] = (unsigned int)(seen[peer] >> 32);
                s[4] = call;
                s[5] = (unsigned int)(sig & 0xffffffffu);
                s[6] = (unsigned int)(sig >> 32);
                __threadfence_system();
                s[0] = (unsigned int)code;
            }
            const unsigned long long v = ((unsigned long long)call << 32) | (unsigned int)code;
            if (gridDim.x > 1 && after_writes) store_release_gpu(&ctl->verdict, v);
            else if (gridDim.x > 1) *(volatile unsigned long long*)&ctl->verdict = v;
            verdict = code;
        }
    } else if (threadIdx.x == 0) {
        unsigned long long v;
        do { v = after_writes ? load_acquire_gpu(&ctl->verdict) : *(volatile unsigned long long*)&ctl->verdict; }
        while ((unsigned int)(v >> 32) != call);
        verdict = (int)(v & 0xffffffffu);
    }
    __syncthreads();
    return verdict;
}

// The end of every collective kernel, also one that stopped at a failed agreement: the last block to
// finish counts the call (so the next kernel's blocks all read the same call number). No fence: the next
// kernel on the stream starts after this one has ended and sees all it wrote, and every block read the
// call's number before it came here. (A fence would wait for the block's pushes to the peers to land.)
// ``counted`` is false for a kernel that stopped without meeting anyone (FAILED_BEFORE: queued after a
// failure, before the host raised it). A rank that queued more of them than its peers must still count the
// calls as they do: one_shot_ll tags its lines, and picks its area, by the call's number.
// The call's number is stored, not added to: it was read at the start (begin_call), and a load here would
// be one more trip to L2 before the kernel can end. This block's barrier count goes back to memory.
__device__ void finish(Control* ctl, unsigned int* epochs, const Call& c, bool counted = true) {
    __syncthreads();
    if (threadIdx.x == 0) epochs[blockIdx.x] = c.barriers;
    if (!counted) return;
    if (threadIdx.x == 0 && gridDim.x == 1) {
        ctl->calls = c.number;
    } else if (threadIdx.x == 0 && atomicAdd(&ctl->finished, 1u) == gridDim.x - 1) {
        ctl->finished = 0;
        ctl->calls = c.number;
    }
}

// An agreement alone: what a collective that runs by other means (NCCL, tplab's hand-written algorithms)
// does first on a communicator with peer memory, so that ranks on different paths still meet.
extern "C" __global__ void agree_only(Control* ctl, unsigned long long sig, unsigned int* const* flags,
                                      unsigned int* epochs, int rank, int p) {
    const Call this_call = begin_call(ctl, epochs);
    finish(ctl, epochs, this_call, agree(ctl, this_call, sig, flags, epochs, rank, p) != FAILED_BEFORE);
}

// How every other collective kernel starts (after after_previous_kernel): read the counts, agree or stop.
#define BEGIN_CALL_AND_AGREE() \
    Call this_call = begin_call(ctl, epochs); \
    { const int verdict_ = agree(ctl, this_call, sig, flags, epochs, rank, p); \
      if (verdict_ != AGREED) { finish(ctl, epochs, this_call, verdict_ != FAILED_BEFORE); return; } }

// The whole kernel is one barrier, at a slot of its own: what the copy-engine all-reduce (copy_engine.py)
// puts between its copies, so that its stream waits for the peers' streams without the host and without
// more than one block of one multiprocessor.
extern "C" __global__ void flag_barrier(unsigned int* const* flags, unsigned int* epochs, int rank,
                                        unsigned int who, int slot) {
    barrier_at(slot, flags, epochs, rank, who);
}

// The packs [first, last) of an array, split over the grid: block b takes the same packs on every rank.
#define FOR_MY_PACKS(i, first, last) \
    for (long long i = (first) + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (last); \
         i += (long long)gridDim.x * blockDim.x)

template <typename T>
__device__ __forceinline__ void copy_packs(uint4* dst, const uint4* src, long long first, long long last) {
    FOR_MY_PACKS(i, first, last) dst[i] = load_peer(src + i);
}

// ((v[0] + v[1]) + v[2]) + ...  in rank order, in Acc, rounded once.
template <typename T>
__device__ __forceinline__ uint4 sum_packs(const Pack<T>* v, int p) {
    typedef typename Num<T>::Acc Acc;
    const int N = 16 / sizeof(T);
    Acc acc[N];
#pragma unroll
    for (int k = 0; k < N; k++) acc[k] = Num<T>::up(v[0].e[k]);
#pragma unroll
    for (int q = 1; q < MAX_RANKS; q++)
        if (q < p) {
#pragma unroll
            for (int k = 0; k < N; k++) acc[k] += Num<T>::up(v[q].e[k]);
        }
    Pack<T> out;
#pragma unroll
    for (int k = 0; k < N; k++) out.e[k] = Num<T>::down(acc[k]);
    return out.raw;
}

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ...  in rank order, in Acc, rounded once.
template <typename T>
__device__ __forceinline__ uint4 sum_in_rank_order(const uint4* const* in, int p, long long i) {
    Pack<T> v[MAX_RANKS];
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++) if (q < p) v[q].raw = load_peer(in[q] + i);     // p loads in flight
    return sum_packs<T>(v, p);
}

// a + b elementwise, rounded to T (one step of the ring)
template <typename T>
__device__ __forceinline__ uint4 add_packs(uint4 a, uint4 b) {
    Pack<T> x, y, z; x.raw = a; y.raw = b;
#pragma unroll
    for (int k = 0; k < 16 / (int)sizeof(T); k++) z.e[k] = Num<T>::down(Num<T>::up(x.e[k]) + Num<T>::up(y.e[k]));
    return z.raw;
}

// Two packs per thread per trip (i and i + grid size): twice the loads in flight. The same packs fall to
// the same block as in FOR_MY_PACKS, so the two loops can meet across ranks.
#define FOR_MY_PACK_PAIRS(i, j, first, last) \
    for (long long i = (first) + (long long)blockIdx.x * blockDim.x + threadIdx.x, \
         j = i + (long long)gridDim.x * blockDim.x; i < (last); \
         i += 2LL * gridDim.x * blockDim.x, j += 2LL * gridDim.x * blockDim.x)

// ---- one-shot: every rank reads all p buffers and sums them (small messages: one round) ------------------
//   mine = x;  agree(all) -- the agreement is the barrier;  out = sum over q of bufs[q] in rank order
// The staging area alternates between two halves (the parity of the agreement count, which every call on
// every path advances once): before a rank writes a half again it has passed another agreement with every
// peer, which the peer could only reach after finishing the kernel that read that half. So one barrier is
// enough, not two.
template <typename T>
__global__ void one_shot(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                         unsigned int* epochs, int rank, int p, long long packs, long long base, long long half,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    // Loaded before this rank's counts, in the same trip to L2: the first pack of the input and the buffers'
    // addresses (one_shot_ll says why).
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 x_first = make_uint4(0u, 0u, 0u, 0u);
    if (first < packs) x_first = x[first];
    const uint4* in[MAX_RANKS];
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++) in[q] = q < p ? bufs[q] : bufs[0];
    uint4* mine = bufs[rank];
    const Call this_call = begin_call(ctl, epochs);
    const long long at = base + (long long)(this_call.agreement & 1u) * half;  // (all read before block 0 moves it)
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++) in[q] += at;
    mine += at;
    FOR_MY_PACKS(i, 0, packs) mine[i] = i == first ? x_first : x[i];
    const int verdict = agree(ctl, this_call, sig, flags, epochs, rank, p, true);                   // also the barrier
    if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    FOR_MY_PACKS(i, 0, packs) out[i] = sum_in_rank_order<T>(in, p, i);
    finish(ctl, epochs, this_call);
}

// Poll a line from rank q until it is this call's. A peer that agreed to the call then pushes its data, so
// waiting can only fail if its process died mid-call: give up after ctl->timeout_ns (or at once once
// another thread has), and report it as the agreement reports a peer that never came.
__device__ __forceinline__ uint2 wait_line(const uint4* line, unsigned int call, Control* ctl, int q) {
    uint4 v = load_line(line);
    if (!line_has(v, call)) {
        const unsigned long long start = globaltimer();
        unsigned int spins = 0;
        do {
            v = load_line(line);
            if ((++spins & 1023u) == 0 && (*(volatile unsigned int*)&ctl->failed
                                           || globaltimer() - start > ctl->timeout_ns)) {
                if (atomicExch(&ctl->failed, 1u) == 0u) {   // the first thread to give up reports it
                    volatile unsigned int* s = ctl->status;
                    s[1] = (unsigned int)q;
                    s[4] = call;
                    __threadfence_system();
                    s[0] = TIMEOUT;
                }
                break;
            }
        } while (!line_has(v, call));
    }
    return make_uint2(v.x, v.z);
}

// Pack i's two lines from every peer q, as they are now (polled again by wait_line where not yet this call's).
__device__ __forceinline__ void read_lines(uint4* low, uint4* high, const uint4* mine, long long slot_lines,
                                           long long i, int rank, int p) {
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++)
        if (q < p && q != rank) {
            low[q] = load_line(mine + q * slot_lines + 2 * i);
            high[q] = load_line(mine + q * slot_lines + 2 * i + 1);
        }
}

// ---- one-shot, low latency: the data travels with its flag (NCCL's "LL" protocol) -----------------------
// Every rank pushes its input straight into every peer's LL area, 8 bytes of data per 16-byte store with
// the call's number beside each 4-byte half: {d0, call, d1, call}. A 16-byte store reaches the peer as two
// 8-byte halves that are each whole, so a line whose two numbers both say "this call" holds this call's
// data. The reader polls its own (local) memory for that: no barrier, no fence, no remote read -- one
// NVLink crossing per call, where one_shot needs a barrier and then a round of remote reads.
//   signal the agreement;  for q != r: bufs[q] LL slot r = x with the call's number;  agree (wait only)
//   out = sum in rank order of (x for me, my LL slot q for q), each line polled until it is this call's
// The area alternates between two halves by the call's parity (a peer is at most one call ahead), and a
// line left over from an older call carries an older number: nothing is ever cleared. Call numbers are
// the same on every rank (every call on every path finishes once everywhere) and start at 1 over a zeroed
// area. Lines: ``slot_lines`` per sender, ``p`` senders per half, from uint4 index ``base``.
template <typename T>
__global__ void one_shot_ll(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                            unsigned int* epochs, int rank, int p, long long packs, long long base,
                            long long slot_lines, Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    // What does not depend on this rank's counts is loaded before them, in the same trip to L2: the first
    // pack of the input, the buffers' addresses, and the signature line's destination. (Read after them,
    // each would be one more trip, a few hundred nanoseconds, on the way to the peers.)
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 x_first = make_uint4(0u, 0u, 0u, 0u);
    if (first < packs) x_first = x[first];
    uint4* to[MAX_RANKS];                                   // to[step]: rank r + step's buffer (step 1 .. p-1)
#pragma unroll
    for (int step = 1; step < MAX_RANKS; step++) to[step] = step < p ? bufs[(rank + step) % p] : nullptr;
    const uint4* my_buf = bufs[rank];
    const bool signals = sig != 0 && blockIdx.x == 0 && threadIdx.x < p && threadIdx.x != rank;
    unsigned int* their_flags = signals ? flags[threadIdx.x] : nullptr;
    const Call this_call = begin_call(ctl, epochs);
    if (sig != 0 && failed_before(this_call)) { finish(ctl, epochs, this_call, false); return; }   // (as agree)
    if (signals) send_signature(their_flags, this_call.agreement, rank, sig);   // (its address loaded already)
    const unsigned int call = this_call.number;
    const long long area = base + (long long)(call & 1u) * p * slot_lines;
    FOR_MY_PACKS(i, 0, packs) {                              // push: two lines per 16-byte pack, to every peer
        const uint4 v = i == first ? x_first : x[i];
        const uint4 low = make_uint4(v.x, call, v.y, call), high = make_uint4(v.z, call, v.w, call);
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {      // rank r starts at r+1: peers spread the load
            if (step >= p) break;
            uint4* line = to[step] + area + rank * slot_lines + 2 * i;
            store_line(line, low);
            store_line(line + 1, high);
        }
    }
    // Every peer's two lines of a pack are read at once (one trip to L2, not one per line); the first pack's
    // even before the agreement is checked, so that the two trips overlap.
    const uint4* mine = my_buf + area;
    uint4 low[MAX_RANKS], high[MAX_RANKS];
    if (first < packs) read_lines(low, high, mine, slot_lines, first, rank, p);
    const int verdict = agree(ctl, this_call, sig, flags, epochs, rank, p, false, true);
    if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    FOR_MY_PACKS(i, 0, packs) {
        if (i != first) read_lines(low, high, mine, slot_lines, i, rank, p);
        Pack<T> v[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) {
            if (q >= p) continue;
            if (q == rank) { v[q].raw = i == first ? x_first : x[i]; continue; }
            const uint2 a = line_has(low[q], call) ? make_uint2(low[q].x, low[q].z)
                                                   : wait_line(mine + q * slot_lines + 2 * i, call, ctl, q);
            const uint2 b = line_has(high[q], call) ? make_uint2(high[q].x, high[q].z)
                                                    : wait_line(mine + q * slot_lines + 2 * i + 1, call, ctl, q);
            v[q].raw = make_uint4(a.x, a.y, b.x, b.y);
        }
        out[i] = sum_packs<T>(v, p);
    }
    finish(ctl, epochs, this_call);
}

// ---- two-shot: reduce-scatter by pushing, allgather by pushing (large messages) -------------------------
// Rank r's buffer holds two areas of p slots, one chunk each: slot q of `partial` receives chunk r of rank
// q's input, slot q of `result` receives rank q's finished chunk q. Inputs larger than the areas go through
// in rounds of p chunks. Every byte crosses NVLink as a write (no round trip), and the results land where
// they are needed, so a rank only copies its own memory at the end.
//   agreement (every peer has finished its previous call: the start barrier)
//   for each round:
//     for q != r: bufs[q] partial slot r = x chunk q                                  (push)
//     barrier(all)
//     s = sum in rank order of (x chunk r for me, partial slot q for q);  out chunk r = s
//     for q != r: bufs[q] result slot r = s                                           (push)
//     barrier(all)
//     for q != r: out chunk q = result slot q                                         (my own memory)
// No barrier at the end: a peer writes into my partial slots again only after a barrier I pass once I
// have summed them, and into my result slots only after the next round's first barrier, which I reach once I
// have copied them out. The next call must start with a meeting before it writes into a peer: its agreement
// (every kernel's, or agree_only's just before it on the stream). Signature 0 ("agreed already") does not
// say when, so the kernel then meets its peers first. Chunk r is summed once, by rank r.
template <typename T>
__global__ void two_shot(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                         unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    if (sig == 0) barrier(flags, this_call, rank, all);        // (agreed before, maybe long before: see below)
    const long long round_packs = (long long)p * chunk;
    uint4* partial = bufs[rank];
    uint4* result = bufs[rank] + round_packs;
    for (long long first = 0; first < packs; first += round_packs) {
        const long long last = lmin(first + round_packs, packs);
        for (int step = 1; step < p; step++) {              // rank r starts at r+1: peers spread the load
            const int q = (rank + step) % p;
            const long long f = first + q * chunk, l = lmin(f + chunk, last);
            uint4* slot = bufs[q] + (long long)rank * chunk - f;  // slot[i] for i in chunk q
            FOR_MY_PACK_PAIRS(i, j, f, l) {
                const uint4 a = x[i];
                if (j < l) { const uint4 b = x[j]; slot[j] = b; }
                slot[i] = a;
            }
        }
        barrier(flags, this_call, rank, all);
        const long long f = first + rank * chunk, l = lmin(f + chunk, last);
        const uint4* in[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) in[q] = q == rank ? x : partial + (long long)q * chunk - f;
        FOR_MY_PACKS(i, f, l) {
            const uint4 s = sum_in_rank_order<T>(in, p, i);
            out[i] = s;
            for (int step = 1; step < p; step++)             // rank r starts at r+1: peers spread the load
                (bufs[(rank + step) % p] + round_packs + (long long)rank * chunk - f)[i] = s;
        }
        barrier(flags, this_call, rank, all);
        for (int step = 1; step < p; step++) {
            const int q = (rank + step) % p;
            const long long g = first + q * chunk, h = lmin(g + chunk, last);
            copy_packs<T>(out, result + (long long)q * chunk - g, g, h);
        }
    }
    finish(ctl, epochs, this_call);
}

// ---- two-shot by pulling only: for inputs that already lie in the shared buffers ("registered") ----------
//   mine = x (skipped when x is mine);  barrier(all)
//   chunk r of mine = sum over q of chunk r of bufs[q];  out chunk r = the same;  barrier(all)
//   for every q != r: out chunk q = chunk q of bufs[q];  barrier(all)
// Chunk r is summed once, by rank r, so every rank holds bitwise the same result.
template <typename T>
__global__ void two_shot_pull(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                              unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    uint4* mine = bufs[rank];
    if (x != mine)                                          // skipped when the input already lives there
        for (int c = 0; c < p; c++)                         // chunk by chunk: block b copies what the peers'
            copy_packs<T>(mine, x, c * chunk, lmin((c + 1) * chunk, packs));   // block b will read
    barrier(flags, this_call, rank, all);
    const long long first = rank * chunk, last = lmin(first + chunk, packs);
    FOR_MY_PACKS(i, first, last) {
        uint4 s = sum_in_rank_order<T>((const uint4* const*)bufs, p, i);
        mine[i] = s;
        out[i] = s;
    }
    barrier(flags, this_call, rank, all);
    for (int step = 1; step < p; step++) {                  // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;
        const long long f = q * chunk, l = lmin(f + chunk, packs);
        copy_packs<T>(out, bufs[q], f, l);
    }
    barrier(flags, this_call, rank, all);
    finish(ctl, epochs, this_call);
}

// ---- ring_pull: reduce-scatter then allgather with the left neighbour only, p-1 steps each -------------
// Read-based ring (also for inputs already in the shared buffer): at reduce-scatter step s rank r reads the left neighbour's partial sum of chunk
// c = r-s-1 and adds its own x[c]; at allgather step s it copies the finished chunk r-s from the left.
// Neighbour barriers (left and right) after each step keep every rank within one step of its neighbours,
// so nobody overwrites a chunk the right neighbour has not read yet. Each chunk is summed once, in the
// order x[c+1], x[c+2], ..., x[c] (rounded to T after each step, like NCCL's ring).
template <typename T>
__global__ void ring_pull(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                          unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const int left = (rank + p - 1) % p, right = (rank + 1) % p;
    const unsigned int neighbours = (1u << left) | (1u << right);
    uint4* mine = bufs[rank];
    const uint4* from_left = bufs[left];
#define CHUNK_RANGE(c, f, l) const long long f = (long long)(c) * chunk, l = lmin(f + chunk, packs)
    {   CHUNK_RANGE(rank, f, l);                                  // my own chunk: what the right reads first
        if (x != mine) copy_packs<T>(mine, x, f, l); }
    barrier(flags, this_call, rank, neighbours);
    for (int s = 0; s < p - 1; s++) {                            // reduce-scatter
        const int c = (rank - s - 1 + 2 * p) % p;
        CHUNK_RANGE(c, f, l);
        const bool finished = (s == p - 2);                      // chunk r+1 is complete here
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            const uint4 a = load_peer(from_left + i), xa = x[i];
            uint4 b, xb;
            if (two) { b = load_peer(from_left + j); xb = x[j]; }
            const uint4 u = add_packs<T>(a, xa);
            mine[i] = u;
            if (finished) out[i] = u;
            if (two) {
                const uint4 v = add_packs<T>(b, xb);
                mine[j] = v;
                if (finished) out[j] = v;
            }
        }
        barrier(flags, this_call, rank, neighbours);
    }
    for (int s = 0; s < p - 1; s++) {                            // allgather
        const int c = (rank - s + p) % p;
        CHUNK_RANGE(c, f, l);
        const bool pass_on = (s < p - 2);                        // the right neighbour still needs it
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            const uint4 a = load_peer(from_left + i);
            uint4 b;
            if (two) b = load_peer(from_left + j);
            out[i] = a;
            if (pass_on) mine[i] = a;
            if (two) { out[j] = b; if (pass_on) mine[j] = b; }
        }
        barrier(flags, this_call, rank, neighbours);
    }
#undef CHUNK_RANGE
    finish(ctl, epochs, this_call);
}

// ---- ring: the textbook ring, pushing: every step writes into the right neighbour's buffer -------------
// Rank r's buffer holds one slot per chunk (slot c at c·chunk, like x). The right neighbour is R.
//   reduce-scatter, step s = 0 .. p-2:  c = r - s
//       v = x[c] (s = 0)  or  slot c + x[c];  R's slot c = v;  barrier(neighbours)
//   last sum:  c = r + 1:  v = slot c + x[c]  -- chunk c is complete here;  out[c] = v
//   allgather, step t = 0 .. p-2:  push v to R's slot c;  barrier(neighbours);  c = c - 1;  v = slot c;  out[c] = v
//   barrier(neighbours)   (before the next call pushes into R's slots, R has read them)
// Like NCCL's ring, the bytes cross NVLink as writes (no round trip), and nothing is copied in first.
// Chunk c is summed in the order x[c], x[c+1], ..., x[c-1], once, so every rank gets the same bits.
template <typename T>
__global__ void ring(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                     unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const int left = (rank + p - 1) % p, right = (rank + 1) % p;
    const unsigned int neighbours = (1u << left) | (1u << right);
    if (sig == 0) barrier(flags, this_call, rank, neighbours);  // (the right neighbour has left its last call:
    const uint4* slot = bufs[rank];                          //  a two_shot's results may still be read there)
    uint4* to_right = bufs[right];
#define CHUNK_RANGE(c, f, l) const long long f = (long long)(c) * chunk, l = lmin(f + chunk, packs)
    for (int s = 0; s < p - 1; s++) {                            // reduce-scatter: add, pass on
        const int c = (rank - s + p) % p;
        CHUNK_RANGE(c, f, l);
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            uint4 a = x[i], b;
            if (two) b = x[j];
            if (s > 0) {
                a = add_packs<T>(load_peer(slot + i), a);       // what the left sent, then mine
                if (two) b = add_packs<T>(load_peer(slot + j), b);
            }
            to_right[i] = a;
            if (two) to_right[j] = b;
        }
        barrier(flags, this_call, rank, neighbours);
    }
    {   const int c = (rank + 1) % p;                            // the last addition: chunk r+1 complete
        CHUNK_RANGE(c, f, l);
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            const uint4 a = add_packs<T>(load_peer(slot + i), x[i]);
            uint4 b;
            if (two) b = add_packs<T>(load_peer(slot + j), x[j]);
            out[i] = a;
            if (p > 1) to_right[i] = a;                          // allgather step 0: pass it on
            if (two) { out[j] = b; if (p > 1) to_right[j] = b; }
        }
        barrier(flags, this_call, rank, neighbours);
    }
    for (int t = 1; t < p; t++) {                                // allgather: take, pass on
        const int c = (rank + 1 - t + p) % p;
        CHUNK_RANGE(c, f, l);
        const bool pass_on = (t < p - 1);                        // R still lacks it
        FOR_MY_PACK_PAIRS(i, j, f, l) {
            const bool two = j < l;
            const uint4 a = load_peer(slot + i);
            uint4 b;
            if (two) b = load_peer(slot + j);
            out[i] = a;
            if (pass_on) to_right[i] = a;
            if (two) { out[j] = b; if (pass_on) to_right[j] = b; }
        }
        barrier(flags, this_call, rank, neighbours);
    }
#undef CHUNK_RANGE
    finish(ctl, epochs, this_call);
}

// ---- allgather: every rank's x, in rank order, on every rank (pulled from all peers at once) ------------
//   mine = x;  out part r = x;  barrier(all);  for q != r: out part q = bufs[q];  barrier(all)
extern "C" __global__ void allgather(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                     unsigned int* epochs, int rank, int p, long long packs,
        Control* ctl, unsigned long long sig) {
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    uint4* mine = bufs[rank];
    uint4* own_part = out + (long long)rank * packs;
    FOR_MY_PACKS(i, 0, packs) { const uint4 v = x[i]; mine[i] = v; own_part[i] = v; }
    barrier(flags, this_call, rank, all);
    for (int step = 1; step < p; step++) {                  // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;
        const uint4* theirs = bufs[q];
        uint4* part = out + (long long)q * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = load_peer(theirs + i);
            if (j < packs) { const uint4 b = load_peer(theirs + j); part[j] = b; }
            part[i] = a;
        }
    }
    barrier(flags, this_call, rank, all);                      // nobody overwrites a buffer still being read
    finish(ctl, epochs, this_call);
}

// ---- the reduction step of the copy-engine all-reduce (copy_engine.py) ----------------------------------
// The copy engines have pushed block r of every rank q's input into slot q of this rank's shared half
// (`slots`, `stride` packs apart; slot r holds this rank's own block r); sum them in rank order into slot r,
// which the peers then copy out.
template <typename T>
__global__ void sum_slots(uint4* slots, long long stride, int rank, int p, long long packs) {
    const uint4* in[MAX_RANKS];
#pragma unroll
    for (int q = 0; q < MAX_RANKS; q++) in[q] = slots + (long long)(q < p ? q : 0) * stride;
    uint4* mine = slots + (long long)rank * stride;
    FOR_MY_PACKS(i, 0, packs) mine[i] = sum_in_rank_order<T>(in, p, i);
}

// ---- all-to-all: block q of rank r's x goes to rank q (pushed into every peer's buffer at once) ---------
// Rank r's buffer holds p slots of one block each; slot q receives rank q's block for r.
//   for q != r: bufs[q] slot r = x block q;   out block r = x block r;   barrier(all)
//   for q != r: out block q = my slot q;                                 barrier(all)
// (The second barrier: a peer's next call pushes into a slot only after this rank has read it.)
extern "C" __global__ void alltoall(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                    unsigned int* epochs, int rank, int p, long long packs,
        Control* ctl, unsigned long long sig) {
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    for (int step = 1; step <= p; step++) {                 // rank r starts at r+1: peers spread the load
        const int q = (rank + step) % p;                    // (the last step: q = r, the block that stays)
        const uint4* block = x + (long long)q * packs;
        uint4* to = (q == rank ? out : bufs[q]) + (long long)rank * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = block[i];
            if (j < packs) { const uint4 b = block[j]; to[j] = b; }
            to[i] = a;
        }
    }
    barrier(flags, this_call, rank, all);
    const uint4* mine = bufs[rank];
    for (int step = 1; step < p; step++) {
        const int q = (rank + step) % p;
        const long long at = (long long)q * packs;
        FOR_MY_PACK_PAIRS(i, j, 0, packs) {
            const uint4 a = load_peer(mine + at + i);       // written by peer q over NVLink: L2, not L1
            if (j < packs) { const uint4 b = load_peer(mine + at + j); out[at + j] = b; }
            out[at + i] = a;
        }
    }
    barrier(flags, this_call, rank, all);
    finish(ctl, epochs, this_call);
}
