// tplab's peer-memory kernels, agreement.cuh: the agreement every collective call starts with, the call's counters, the barriers.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- agreement: every collective call starts with the ranks comparing what they were asked to do --------
// Block 0 of every rank sends every peer's block 0 a line holding a 64-bit signature of its arguments
// (count, element type, a hash of op and algorithm), or REFUSED ("my input is bad: I only came to say so"),
// tagged with the agreement's number e, and polls its own lines until every peer's of number e is there.
// All equal: the kernel goes on. Not all equal: every rank sees it (each compares with all), every rank's
// kernel returns before it writes any output (one_shot_ll, and two_shot after a two_shot, have pushed into the
// peers' shared buffers by then: two_shot.cu), and each writes what it saw into host memory (`status`),
// from where tplab raises on every rank. A peer that never comes (a program whose ranks diverged) is given
// up on after the timeout: status TIMEOUT, and this peer memory is unusable from then on.
// The other blocks of the grid wait for block 0's verdict, tagged with the call's number so that an older
// verdict is never taken for this call's (one_shot_ll's blocks read the lines themselves where they agree:
// one_shot.cu). The verdict is a plain store (one_shot: a release), and none at all
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
    unsigned long long timeout_cycles;   // (waited_past_timeout)
    unsigned int* status;             // host memory, mapped: code, peer, its signature (2 words), call, mine (2)
    unsigned int failed;              // an agreement failed here and the host has not raised it yet: the
                                      //  failed call's mark (failure_mark), 1 after a peer timed out
    unsigned int written;             // blocks of a one_shot that have written their part of the input
    unsigned int two_shot_call;       // the number of the last call here that was an agreed two_shot (its
                                      //  next call, if a two_shot, may push before it agrees: two_shot.cu)
    unsigned int unused;
};

// What a kernel reads of this rank's counts, once, at its start: five independent loads in flight together
// (thread 0's), then one __syncthreads, instead of a load wherever a count is needed. Each load is a trip
// to L2 (a few hundred nanoseconds), and one after another on the path of every call they cost about as
// much as the agreement's NVLink crossing itself.
struct Call {
    unsigned int failed;              // Control::failed as the call started (failed_before says what it means)
    unsigned int number;              // this call's number: calls finished here + 1 (the same on every rank)
    unsigned int agreement;           // this call's agreement: agreements passed + 1 (block 0's to use, and
                                      //  every block's in one_shot_ll: block 0 moves the count once it has
                                      //  decided, one_shot_ll's last block to finish once all have agreed)
    unsigned int barriers;            // barriers this block has passed (epochs[blockIdx.x]; finish writes it back)
    unsigned int two_shot_call;       // Control::two_shot_call as the call started
};
__device__ __forceinline__ Call begin_call(const Control* ctl, const unsigned int* epochs) {
    __shared__ Call shared;
    if (threadIdx.x == 0) {
        Call c;
        c.failed = *(const volatile unsigned int*)&ctl->failed;
        c.number = *(const volatile unsigned int*)&ctl->calls + 1;
        c.agreement = *(const volatile unsigned int*)(epochs + AGREE_SLOT) + 1;
        c.barriers = *(const volatile unsigned int*)(epochs + blockIdx.x);
        c.two_shot_call = *(const volatile unsigned int*)&ctl->two_shot_call;
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

// How long a rank has waited for a peer (Control::timeout_cycles: when to give up on it) is counted in the SM's
// own cycles, not by %globaltimer: the global timer is the host's wall clock (it read within 0.03 ms of it on
// 4x H200), which a time service may step by seconds at any moment, and a wait of microseconds across such a
// step would look like one past the timeout. The host converts the timeout at the GPU's peak clock
// (cudaDevAttrClockRate), so a slower clock only waits longer. (A waiting thread reads its own SM's clock.)
__device__ __forceinline__ unsigned long long wait_clock() { return clock64(); }
__device__ __forceinline__ bool waited_past_timeout(const Control* ctl, unsigned long long start) {
    return wait_clock() - start > ctl->timeout_cycles; }
__device__ __forceinline__ void store_release_gpu(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
    unsigned long long v; asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ unsigned int load_acquire_gpu(const unsigned int* p) {
    unsigned int v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }

// Rank r's signature line in the row e & 1 of a rank's flags (``their_flags``: flags[q]); sending it tells q
// "I am at agreement e, with this signature". one_shot_ll sends it first, pushes its data, then waits for
// the peers' lines and its data together (agree_as_packs_land).
__device__ __forceinline__ uint4* signature_line(unsigned int* their_flags, unsigned int e, int r) {
    return (uint4*)(their_flags + SIGNATURES) + (e & 1u) * MAX_RANKS + r; }
__device__ __forceinline__ void send_signature(unsigned int* their_flags, unsigned int e, int rank,
                                               unsigned long long sig) {
    store_line(signature_line(their_flags, e, rank), make_uint4((unsigned int)sig, e, (unsigned int)(sig >> 32), e)); }

// Block 0's thread 0, once every peer's line has been compared (outcome[q], seen[q]: what came from q):
// the call's verdict, the agreement counted, a failure written where the host finds it (status) and marked
// in Control::failed, and the verdict published to the grid's other blocks. ``release``: one_shot's
// verdict also orders its staged input (a release store); any other is a plain store, none in a grid of
// one block.
__device__ int decide(Control* ctl, const Call& c, unsigned long long sig, unsigned int* epochs, int p,
                      const int* outcome, const unsigned long long* seen, bool release) {
    int code = sig == REFUSED ? SELF_REFUSED : AGREED, peer = -1;
    for (int r = 0; r < p; r++)
        if (outcome[r] > (peer < 0 ? AGREED : outcome[peer])) peer = r;
    if (peer >= 0 && code == AGREED) code = outcome[peer];
    epochs[AGREE_SLOT] = c.agreement;
    if (code != AGREED && code != SELF_REFUSED) {
        ctl->failed = failure_mark(c.number);
        volatile unsigned int* s = ctl->status;
        s[1] = (unsigned int)peer;
        s[2] = (unsigned int)(seen[peer] & 0xffffffffu);
        s[3] = (unsigned int)(seen[peer] >> 32);
        s[4] = c.number;
        s[5] = (unsigned int)(sig & 0xffffffffu);
        s[6] = (unsigned int)(sig >> 32);
        __threadfence_system();
        s[0] = (unsigned int)code;
    }
    const unsigned long long v = ((unsigned long long)c.number << 32) | (unsigned int)code;
    if (gridDim.x > 1 && release) store_release_gpu(&ctl->verdict, v);
    else if (gridDim.x > 1) *(volatile unsigned long long*)&ctl->verdict = v;
    return code;
}

// Thread 0 of another block: block 0's verdict of this call (tagged with the call's number, so that an
// older verdict is never taken for this one's).
__device__ int await_verdict(Control* ctl, unsigned int call, bool acquire) {
    unsigned long long v;
    do { v = acquire ? load_acquire_gpu(&ctl->verdict) : *(volatile unsigned long long*)&ctl->verdict; }
    while ((unsigned int)(v >> 32) != call);
    return (int)(v & 0xffffffffu);
}

// Peer q's signature line against mine: AGREED, MISMATCH or PEER_REFUSED (``seen``: what q sent).
__device__ __forceinline__ int compare_signature(uint4 line, unsigned long long sig, unsigned long long* seen) {
    const unsigned long long theirs = line.x | ((unsigned long long)line.z << 32);
    *seen = theirs;
    if (theirs == sig || sig == 0) return AGREED;
    return theirs == REFUSED ? PEER_REFUSED : MISMATCH;
}

// Block 0, once its signature lines are out: wait for every peer's line of this call's agreement (a peer that
// never comes: TIMEOUT once the timeout has passed), compare, decide (thread 0) and publish the verdict. Returns it
// in every thread of the block. ``acquire``: the line also orders the peer's data before it (one_shot).
__device__ int collect_signatures(Control* ctl, const Call& c, unsigned long long sig, unsigned int* const* flags,
                                  unsigned int* epochs, int rank, int p, bool acquire) {
    __shared__ int outcome[MAX_RANKS];
    __shared__ unsigned long long seen[MAX_RANKS];
    __shared__ int verdict;
    const unsigned int e = c.agreement;
    const int q = threadIdx.x;
    if (q < MAX_RANKS) { outcome[q] = AGREED; seen[q] = 0; }       // (seen: 0 for a peer that never came)
    if (q < p && q != rank) {
        const uint4* mine = signature_line(flags[rank], e, q);
        unsigned long long start = 0;                       // (the clock is read only when waiting)
        unsigned int spins = 0;
        int o = AGREED;
        uint4 line = load_line(mine);
        while (!line_has(line, e)) {
            if (start == 0) start = wait_clock();
            if ((++spins & 1023u) == 0 && waited_past_timeout(ctl, start)) { o = TIMEOUT; break; }
            line = load_line(mine);
        }
        if (o == AGREED) {
            if (acquire) load_acquire((const unsigned int*)mine + 3);   // (acquire: the peer's staged input
                                                                        //  after its line)
            o = compare_signature(line, sig, &seen[q]);
        }
        outcome[q] = o;
    }
    __syncthreads();
    if (threadIdx.x == 0) verdict = decide(ctl, c, sig, epochs, p, outcome, seen, acquire);
    __syncthreads();
    return verdict;
}

// The verdict of this call (AGREED or an error code), the same in every thread of every block.
// ``after_writes`` (one_shot): the agreement is also the kernel's data barrier. Every block has written its
// part of the input into this rank's buffer; block 0 waits for them all (a counter in local memory), then
// meets its peers' block 0 once -- one NVLink crossing for the whole call, whatever the grid. (Ordering:
// each block's writes, its fence and counter increment, block 0's acquire of the counter, a system-scope
// fence before the signature line goes out, and one after the peers' lines came in -- the fence-based
// release and acquire -- form one causality chain.) Signature 0 then still meets the peers but compares
// nothing.
__device__ int agree(Control* ctl, const Call& c, unsigned long long sig, unsigned int* const* flags,
                     unsigned int* epochs, int rank, int p, bool after_writes = false) {
    // After a failed agreement, kernels queued before the host has raised it (a rank whose call did not wait)
    // stop at once without meeting anyone: the peers raised and are not coming (PeerMemory.raise_pending
    // clears the flag on the stream when it raises). Signature 0 too: a persistent launch or a graph replay
    // agreed long before, and pushing now would land in areas the peers have cleaned up after the failure.
    if (failed_before(c)) return FAILED_BEFORE;
    if (sig == 0 && !after_writes) return AGREED;        // agreed already, by agree_only before this kernel
    __shared__ int verdict;
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
        const int q = threadIdx.x;
        if (q < p && q != rank) {
            if (after_writes) fence_acq_rel_sys();          // (release: the staged input before the line)
            send_signature(flags[q], c.agreement, rank, sig);
        }
        return collect_signatures(ctl, c, sig, flags, epochs, rank, p, after_writes);
    } else if (threadIdx.x == 0) {
        verdict = await_verdict(ctl, c.number, after_writes);
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
// ``two_shot_agreed``: an agreed two_shot ends here, which its next call may count on (Control::two_shot_call;
// written by the last block, so that every block of the next kernel reads the same). ``agreement``: one_shot_ll's
// agreement, counted here, by the last block, since every block of it reads Call::agreement (a block that
// started late, after block 0 had ended, would otherwise read the next call's; 0: none to count).
__device__ void finish(Control* ctl, unsigned int* epochs, const Call& c, bool counted = true,
                       bool two_shot_agreed = false, unsigned int agreement = 0u) {
    __syncthreads();
    if (threadIdx.x == 0) epochs[blockIdx.x] = c.barriers;
    if (!counted) return;
    if (threadIdx.x == 0 && (gridDim.x == 1 || atomicAdd(&ctl->finished, 1u) == gridDim.x - 1)) {
        ctl->finished = 0;
        if (two_shot_agreed) ctl->two_shot_call = c.number;
        if (agreement != 0u) epochs[AGREE_SLOT] = agreement;
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

// The barrier every rank queues once after a call that failed (PeerMemory._barrier_on): flag_barrier's, but a
// peer that never comes -- its program went elsewhere -- ends the wait after the agreement's timeout, as an
// agreement would: status TIMEOUT (the host raises CommTimeoutError) and every later kernel stops at once
// (Control::failed 1), instead of this rank's stream waiting forever.
extern "C" __global__ void failure_barrier(Control* ctl, unsigned int* const* flags, unsigned int* epochs,
                                           int rank, unsigned int who, int slot) {
    __shared__ int late;
    if (threadIdx.x == 0) late = -1;
    __syncthreads();
    const unsigned int e = epochs[slot] + 1;
    const int q = threadIdx.x;
    if (q < MAX_RANKS && q != rank && ((who >> q) & 1u)) {
        store_release(flags[q] + slot * MAX_RANKS + rank, e);
        const unsigned int* mine = flags[rank] + slot * MAX_RANKS + q;
        unsigned long long start = 0;
        unsigned int spins = 0;
        while ((int)(load_acquire(mine) - e) < 0) {           // wrap-safe "mine < e"
            if (start == 0) start = wait_clock();
            if ((++spins & 1023u) == 0 && waited_past_timeout(ctl, start)) { late = q; break; }
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    epochs[slot] = e;
    if (late < 0) return;
    ctl->failed = 1u;
    volatile unsigned int* s = ctl->status;
    s[1] = (unsigned int)late;
    s[2] = s[3] = s[5] = s[6] = 0u;
    s[4] = ctl->calls;
    __threadfence_system();
    s[0] = (unsigned int)TIMEOUT;
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

