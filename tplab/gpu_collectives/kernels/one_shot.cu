// tplab's peer-memory kernels, one_shot.cu: one_shot and one_shot_ll: every rank reads all p buffers (small messages).
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

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

// Rank q's line never came, and this thread gives up (after the timeout, or at once once another thread
// has): reported as the agreement reports a peer that never came. The first to give up writes the status;
// a failed agreement's mark in Control::failed stays as it is.
__device__ __forceinline__ void give_up_on(Control* ctl, int q, unsigned int call) {
    if (atomicCAS(&ctl->failed, 0u, 1u) == 0u) {
        volatile unsigned int* s = ctl->status;
        s[1] = (unsigned int)q;
        s[4] = call;
        __threadfence_system();
        s[0] = TIMEOUT;
    }
}
__device__ __forceinline__ bool should_give_up(Control* ctl, unsigned long long start) {
    return *(volatile unsigned int*)&ctl->failed || waited_past_timeout(ctl, start); }

// Poll a line from rank q until it is this call's. A peer that agreed to the call then pushes its data, so
// waiting can only fail if its process died mid-call: give up (give_up_on).
__device__ __forceinline__ uint2 wait_line(const uint4* line, unsigned int call, Control* ctl, int q) {
    uint4 v = load_line(line);
    if (!line_has(v, call)) {
        const unsigned long long start = wait_clock();
        unsigned int spins = 0;
        do {
            v = load_line(line);
            if ((++spins & 1023u) == 0 && should_give_up(ctl, start)) { give_up_on(ctl, q, call); break; }
        } while (!line_has(v, call));
    }
    return make_uint2(v.x, v.z);
}

// How one_shot_ll's packs land: each as two lines per peer, {d0, call, d1, call} and {d2, call, d3, call}.
// ``read(i)`` loads pack i's lines from every peer at once (one trip to L2, not one per line), as they are
// now; ``missing()`` is the first peer whose lines of that pack are not yet this call's, or -1 once all are.
struct LinesLanding {
    const uint4* mine;                                   // this call's half of this rank's LL area
    long long slot_lines;                                // lines per sender
    unsigned int call;
    int rank, p;
    uint4 low[MAX_RANKS], high[MAX_RANKS];
    __device__ __forceinline__ void read(long long i) {
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++)
            if (q < p && q != rank) {
                low[q] = load_line(mine + q * slot_lines + 2 * i);
                high[q] = load_line(mine + q * slot_lines + 2 * i + 1);
            }
    }
    __device__ __forceinline__ int missing() const {
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++)
            if (q < p && q != rank && !(line_has(low[q], call) && line_has(high[q], call))) return q;
        return -1;
    }
};

// one_shot_ll's agreement, waited for in the same trips as the data it guards. In every block, threads q < p
// poll peer q's signature line (in this rank's own memory, as agree does) while every thread polls its first
// pack's lines from every peer: once the last line has landed, one trip to L2 sees it. (Waiting for the
// agreement first and then for the data took two trips after the last line landed: about a microsecond, as
// much as the rest of the call.) A block that finds every line matching goes on by itself: every block reads
// the same lines, so they find the same. (Blocks other than 0 used to wait for block 0's verdict, one more
// store and load through L2 after the last line: about 0.3 µs a call at 16-64 KiB on 4x H100. The one way
// they can differ: a peer's line that lands after block 0 gave up on it, the timeout late, may still be
// seen by a block that has not yet seen Control::failed; that block sums, and the host raises TIMEOUT as
// for any failed call.) Only where a line does not match, or never comes, does block 0 decide (decide: the
// status, the failure mark) and the other blocks take its verdict -- at once where this rank refuses its
// input, whose other blocks never agree and so do not read the lines. Data may never come where the call
// fails (a peer that disagrees pushes other packs, or none): a thread stops waiting for it as soon as the
// failure is known -- from its own block's signature threads (shared memory), or from Control::failed,
// which block 0 marks before it publishes the verdict. The agreement is counted by the last block to finish
// (finish), since every block reads Call::agreement at its start. ``my_flags``: flags[rank] (loaded early by
// the caller). ``Landing``: how a pack lands (LinesLanding; one_shot_lamport.cu's PacksLanding). On return,
// ``land`` holds the first pack as last read (the caller polls again for any peer's not yet landed).
template <typename Landing>
__device__ __forceinline__ int agree_as_packs_land(Control* ctl, const Call& c, unsigned long long sig, const unsigned int* my_flags,
                                   unsigned int* epochs, int rank, int p, long long first, long long packs,
                                   Landing& land) {
    __shared__ int outcome[MAX_RANKS];
    __shared__ unsigned long long seen[MAX_RANKS];
    __shared__ int doomed;                               // a peer disagreed, refused or never came
    __shared__ int verdict;
    const int t = threadIdx.x;
    if (t < MAX_RANKS) { outcome[t] = AGREED; seen[t] = 0; }      // (seen: 0 for a peer that never came)
    if (t == 0) doomed = 0;
    __syncthreads();
    const unsigned int e = c.agreement, call = c.number;
    const bool lead = blockIdx.x == 0;
    bool signature_due = sig != 0 && (lead || sig != REFUSED) && t < p && t != rank;
    bool data_due = first < packs;
    const uint4* their_signature = signature_due ? signature_line((unsigned int*)my_flags, e, t) : nullptr;
    unsigned long long start = 0;                        // (the clock is read only when waiting)
    unsigned int spins = 0;
    while (signature_due || data_due) {
        uint4 line;
        if (signature_due) line = load_line(their_signature);
        if (data_due) land.read(first);                  // (both loads in flight)
        if (signature_due && line_has(line, e)) {
            const int o = compare_signature(line, sig, &seen[t]);
            outcome[t] = o;
            if (o != AGREED) *(volatile int*)&doomed = 1;
            signature_due = false;
        }
        if (data_due && land.missing() < 0) data_due = false;
        if (!signature_due && !data_due) break;
        if (start == 0) start = wait_clock();
        ++spins;                                         // (Control::failed is a trip to L2: every 8th spin)
        const bool failed = !lead && (spins & 7u) == 0 && *(volatile unsigned int*)&ctl->failed;
        if (!signature_due && (*(volatile int*)&doomed || failed)) break;
        if (signature_due && failed) {                   // the call failed (block 0 decided, or a data wait
            outcome[t] = TIMEOUT;                        // gave up): not agreed here either; the verdict decides
            *(volatile int*)&doomed = 1;
            break;
        }
        if ((spins & 1023u) == 0) {
            if (signature_due && waited_past_timeout(ctl, start)) {            // as agree: a peer that never came
                outcome[t] = TIMEOUT;                                          // (its own clock only, so that
                *(volatile int*)&doomed = 1;                                   //  the status names that peer)
                break;
            }
            if (!signature_due && should_give_up(ctl, start)) {               // a peer that died mid-call
                give_up_on(ctl, land.missing(), call);
                break;
            }
        }
    }
    __syncthreads();
    if (sig == 0) return AGREED;                         // agreed already, by agree_only before this kernel
    // All agreed (every thread reads its block's outcomes itself): go on at once. Block 0 still publishes the
    // verdict (a block whose signature thread saw Control::failed reads it), and the agreement is counted at
    // the kernel's end (finish: a return between here and there would leave this rank's count behind its
    // peers') -- thread 0 deciding for the block between two more barriers cost half a microsecond a call on
    // 4x H100. (A rank that only came to refuse its input never agrees: decide says SELF_REFUSED.)
    bool agreed = sig != REFUSED;
    for (int r = 0; r < p; r++) agreed = agreed && outcome[r] == AGREED;
    if (agreed) {
        if (lead && t == 0 && gridDim.x > 1)
            *(volatile unsigned long long*)&ctl->verdict = ((unsigned long long)call << 32) | AGREED;
        return AGREED;
    }
    if (t == 0) verdict = lead ? decide(ctl, c, sig, epochs, p, outcome, seen, false)
                               : await_verdict(ctl, call, false);
    __syncthreads();
    return verdict;
}

// ---- one-shot, low latency: the data travels with its flag (NCCL's "LL" protocol) -----------------------
// Every rank pushes its input straight into every peer's LL area, 8 bytes of data per 16-byte store with
// the call's number beside each 4-byte half: {d0, call, d1, call}. A 16-byte store reaches the peer as two
// 8-byte halves that are each whole, so a line whose two numbers both say "this call" holds this call's
// data. The reader polls its own (local) memory for that: no barrier, no fence, no remote read -- one
// NVLink crossing per call, where one_shot needs a barrier and then a round of remote reads.
//   send the signature;  for q != r: bufs[q] LL slot r = x with the call's number
//   wait for the peers' signatures and my first pack's lines together (agree_as_packs_land)
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
    const bool reads_signature = sig != 0 && threadIdx.x < p && threadIdx.x != rank;   // (every block)
    const bool signals = reads_signature && blockIdx.x == 0;                             // (block 0 sends)
    unsigned int* their_flags = signals ? flags[threadIdx.x] : nullptr;
    const unsigned int* my_flags = reads_signature ? flags[rank] : nullptr;
    const Call this_call = begin_call(ctl, epochs);
    if (failed_before(this_call)) { finish(ctl, epochs, this_call, false); return; }   // (as agree)
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
    // in the same trips as the agreement's lines.
    const uint4* mine = my_buf + area;
    LinesLanding land{mine, slot_lines, call, rank, p};
    const int verdict = agree_as_packs_land(ctl, this_call, sig, my_flags, epochs, rank, p, first, packs, land);
    if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    FOR_MY_PACKS(i, 0, packs) {
        if (i != first) land.read(i);
        Pack<T> v[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) {
            if (q >= p) continue;
            if (q == rank) { v[q].raw = i == first ? x_first : x[i]; continue; }
            const uint2 a = line_has(land.low[q], call) ? make_uint2(land.low[q].x, land.low[q].z)
                                                        : wait_line(mine + q * slot_lines + 2 * i, call, ctl, q);
            const uint2 b = line_has(land.high[q], call) ? make_uint2(land.high[q].x, land.high[q].z)
                                                         : wait_line(mine + q * slot_lines + 2 * i + 1, call, ctl, q);
            v[q].raw = make_uint4(a.x, a.y, b.x, b.y);
        }
        out[i] = sum_packs<T>(v, p);
    }
    finish(ctl, epochs, this_call, true, false, sig != 0 ? this_call.agreement : 0u);   // (counts the agreement)
}

