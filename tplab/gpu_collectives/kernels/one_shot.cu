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
                if (atomicCAS(&ctl->failed, 0u, 1u) == 0u) {   // the first to give up reports it (a failed
                                                               //  agreement's mark stays as it is)
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

