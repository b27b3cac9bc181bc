// tplab's peer-memory kernels, two_shot.cu: two_shot and two_shot_pull: reduce-scatter, then all-gather (large messages).
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- two-shot: reduce-scatter by pushing, allgather by pushing (large messages) -------------------------
// Rank r's buffer holds two areas of p slots, one chunk each: slot q of `partial` (from the buffer's start)
// receives chunk r of rank q's input, slot q of `result` (from its middle, ``results`` packs in, whatever the
// size) receives rank q's finished chunk q. Inputs larger than the areas go through in rounds of p chunks.
// Every byte crosses NVLink as a write (no round trip), and the results land where they are needed, so a
// rank only copies its own memory at the end.
//   agreement (every peer has finished its previous call: the start barrier)
//   for each round:
//     for q != r: bufs[q] partial slot r = x chunk q                                  (push)
//     barrier(all)
//     s = sum in rank order of (x for me, partial slot q for q), chunk r;  out chunk r = s
//     for q != r: bufs[q] result slot r = s                                           (push)
//     barrier(all)
//     for q != r: out chunk q = result slot q                                         (my own memory)
// No barrier at the end: a peer writes into my partial slots again only after a barrier I pass once I
// have summed them, and into my result slots only after the next round's first barrier, which I reach once I
// have copied them out. So after an agreed two_shot, the next two_shot need not meet its peers before it
// pushes: every peer has summed its partial slots (we met at the end of the sums), and the result slots,
// which a peer may still be copying out, lie apart. That call sends its signature, pushes, and takes the
// agreement's answer in its first barrier (agree_at_first_barrier): one meeting fewer, 0.7-1.3 us a call
// on 4x H100. It pushes before it knows that its peers agree: if they do not, the pushes land at the start of
// their buffers (scratch, or an input a peer registered there), every rank raises as always, and the raise
// queues a barrier (PeerMemory._barrier_on) so that no such push lands after the peer has gone on. After any
// other call the kernel agrees first: the ring's barriers meet only its neighbours, so a peer further away
// may still be reading its slots. Signature 0 ("agreed already", by agree_only just before) does not say
// when the peers arrived, so the kernel then meets its peers first. Chunk r is summed once, by rank r.
// ---- the agreement in the first barrier (two_shot after an agreed two_shot) ------------------------------
// Block 0 has sent its signature lines at the kernel's start; here, once its pushes are out, it takes the
// peers' lines (collect_signatures), and then every block meets its peers' block b at a flag of its own
// (EARLY_FLAGS), set to the call's number -- the same on every rank whatever came before, so a flag left by
// a call that failed never passes a later one, and a block that stopped early leaves no barrier count
// behind its peers'. A block other than 0 also watches block 0's verdict while it waits: a peer in
// another kernel never comes, and the verdict then says so. Returns the verdict in every thread.
#define EARLY_FLAGS (SIGNATURES + 2 * MAX_RANKS * 4)        // words: MAX_SLOTS x MAX_RANKS after the lines
#define EARLY_BIT (1ULL << 41)                              // (PULLED, peer_memory.py, is 1 << 40)
__device__ int agree_at_first_barrier(Control* ctl, const Call& c, unsigned long long sig,
                                      unsigned int* const* flags, unsigned int* epochs, int rank, int p) {
    __shared__ int verdict;
    __syncthreads();                                     // this block's pushes happen before the signal
    if (blockIdx.x == 0) {
        const int v = collect_signatures(ctl, c, sig, flags, epochs, rank, p, false);
        if (v != AGREED) return v;
    }
    const unsigned int n = c.number;
    const int q = threadIdx.x;
    if (q < p && q != rank) {
        store_release(flags[q] + EARLY_FLAGS + blockIdx.x * MAX_RANKS + rank, n);
        const unsigned int* mine = flags[rank] + EARLY_FLAGS + blockIdx.x * MAX_RANKS + q;
        unsigned int spins = 0;
        while ((int)(load_acquire(mine) - n) < 0) {        // wrap-safe "mine < n"
            if (blockIdx.x != 0 && (++spins & 15u) == 0) {
                const unsigned long long v = *(volatile unsigned long long*)&ctl->verdict;
                if ((unsigned int)(v >> 32) == n && (unsigned int)v != AGREED) break;
            }
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) return AGREED;
    if (threadIdx.x == 0) verdict = await_verdict(ctl, n, false);
    __syncthreads();
    return verdict;
}

template <typename T>
__global__ void two_shot(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                         unsigned int* epochs, int rank, int p, long long chunk, long long packs,
                         long long results, Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    Call this_call = begin_call(ctl, epochs);
    const bool early = sig != 0 && this_call.two_shot_call != 0u && this_call.two_shot_call == this_call.number - 1u
                       && !failed_before(this_call);      // (0: no two_shot yet)
    const bool agreed_before = sig == 0;
    if (early) {                                            // (the early bit: a peer that is not early, with
        sig ^= EARLY_BIT;                                   //  the same arguments, disagrees instead of waiting)
        if (blockIdx.x == 0 && threadIdx.x < p && threadIdx.x != rank)
            send_signature(flags[threadIdx.x], this_call.agreement, rank, sig);
    } else {
        const int verdict = agree(ctl, this_call, sig, flags, epochs, rank, p);
        if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    }
    const unsigned int all = (1u << p) - 1;
    if (agreed_before) barrier(flags, this_call, rank, all);   // (maybe long before: see above)
    const long long round_packs = (long long)p * chunk;
    uint4* partial = bufs[rank];
    uint4* result = bufs[rank] + results;
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
        if (early && first == 0) {
            const int verdict = agree_at_first_barrier(ctl, this_call, sig, flags, epochs, rank, p);
            if (verdict != AGREED) { finish(ctl, epochs, this_call); return; }
        } else {
            barrier(flags, this_call, rank, all);
        }
        const long long f = first + rank * chunk, l = lmin(f + chunk, last);
        const uint4* in[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) in[q] = q == rank ? x : partial + (long long)q * chunk - f;
        FOR_MY_PACKS(i, f, l) {
            const uint4 s = sum_in_rank_order<T>(in, p, i);
            out[i] = s;
            for (int step = 1; step < p; step++)             // rank r starts at r+1: peers spread the load
                (bufs[(rank + step) % p] + results + (long long)rank * chunk - f)[i] = s;
        }
        barrier(flags, this_call, rank, all);
        for (int step = 1; step < p; step++) {
            const int q = (rank + step) % p;
            const long long g = first + q * chunk, h = lmin(g + chunk, last);
            copy_packs<T>(out, result + (long long)q * chunk - g, g, h);
        }
    }
    // (after a call that agreed before -- signature 0, maybe long before -- the next does not push first:
    //  such a call may have run on a copy of an input that lies in the shared buffer, whose result is
    //  copied back into it after this kernel, where the next call's early pushes would land)
    finish(ctl, epochs, this_call, true, !agreed_before);
}

// ---- two-shot for inputs that already lie in the shared buffers ("registered") ----------------------------
//   agreement (the start barrier: every peer's input is in its buffer, written before its kernel began)
//   [x is not mine: mine = x;  barrier(all)]
//   s = sum in rank order over q of bufs[q] chunk r (pulled);  out chunk r = s;  for q != r: bufs[q] chunk r = s
//   barrier(all)
//   [out is not mine: out chunk q = mine chunk q, for q != r]                      (my own memory)
// Two meetings in place, as torch's symmetric-memory two-shot. Writing the sums over the peers' inputs is
// safe: chunk r of a peer's buffer is read by rank r alone, and rank r's thread reads it before it writes it.
// No barrier at the end: a peer reads my buffer only before the barrier that I pass, and the next call's
// pulls wait for its agreement, which comes after whatever my program writes into my buffer next. Chunk r is
// summed once, by rank r, so every rank holds bitwise the same result.
template <typename T>
__global__ void two_shot_pull(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                              unsigned int* epochs, int rank, int p, long long chunk, long long packs,
        Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    BEGIN_CALL_AND_AGREE();
    const unsigned int all = (1u << p) - 1;
    uint4* mine = bufs[rank];
    if (x != mine || sig == 0) {                            // (signature 0: agreed before, maybe long before)
        if (x != mine)
            for (int c = 0; c < p; c++)                     // chunk by chunk: block b copies what the peers'
                copy_packs<T>(mine, x, c * chunk, lmin((c + 1) * chunk, packs));   // block b will read
        barrier(flags, this_call, rank, all);
    }
    const long long first = rank * chunk, last = lmin(first + chunk, packs);
    FOR_MY_PACKS(i, first, last) {
        const uint4 s = sum_in_rank_order<T>((const uint4* const*)bufs, p, i);
        out[i] = s;                                         // (in place: my own buffer)
        for (int step = 1; step < p; step++)                // rank r starts at r+1: peers spread the load
            bufs[(rank + step) % p][i] = s;
    }
    barrier(flags, this_call, rank, all);
    if (out != mine)
        for (int step = 1; step < p; step++) {
            const int q = (rank + step) % p;
            const long long f = q * chunk, l = lmin(f + chunk, packs);
            copy_packs<T>(out, mine, f, l);
        }
    finish(ctl, epochs, this_call);
}
