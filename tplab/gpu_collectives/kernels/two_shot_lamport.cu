// tplab's peer-memory kernels, two_shot_lamport.cu: a two-shot whose data says itself whether it has landed.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- two-shot, Lamport-style: reduce-scatter, then all-gather, each without a barrier ---------------------
// two_shot moves the fewest bytes -- 2(p-1)/p of the input out of each rank, where a one-shot moves p-1 times
// the input -- but meets its peers twice (a barrier before the sums, one before the copies out), and each
// meeting is an NVLink round trip. Here both halves push into one_shot_lamport's area, kept full of the
// sentinel, so the data is its own flag: rank r waits for the packs themselves, never for a barrier
// (TensorRT-LLM's "two-shot Lamport" all-reduce). Thread i of every rank handles element i of every chunk:
//   send the signature;  for q != r: bufs[q] scatter slot r = sanitize(x chunk q)              (push)
//   wait for the peers' signatures and my first pack together (agree_as_packs_land)
//   s = sum in rank order of (sanitize(x chunk r) for me, my scatter slot q for q);  out chunk r = s
//   for q != r: bufs[q] gather slot r = s                                                     (push)
//   for q != r: out chunk q = my gather slot q, once it has landed
// and every slot read is set back to the sentinel behind the reader. The thread that reads x's chunk q[i]
// is the one that writes out's, so out may be x itself. The slots' places do not depend on the size (each
// of the 2p slots is ``slot_packs`` long, the scatter slots first), so a peer that disagrees on the size
// still pushes only into slots: the agreement fails, and the host sets the area back to the sentinel
// (PeerMemory._clean_after_failure), as after a failed one_shot_lamport. The area alternates between two
// halves by the call's parity, with one_shot_lamport's argument (one_shot_lamport.cu) for why a peer
// writes a half again only after this rank has set it back. Chunk r is summed once, by rank r, so every
// rank holds bitwise the same result.

// Arguments as two_shot's; ``base``: the area's first pack (one_shot_lamport's), ``slot_packs``: packs per slot.
template <typename T>
__global__ void two_shot_lamport(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                 unsigned int* epochs, int rank, int p, long long chunk, long long packs,
                                 long long base, long long slot_packs, Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    // (one_shot_ll's and one_shot_lamport's start, written out again on purpose: as one shared inlined helper
    //  the three kernels measured 0.02-0.3 us slower, data/gpu_peer_kernels_4x-h200_shared-prologue.csv)
    uint4* to[MAX_RANKS];                                   // to[step]: rank r + step's buffer (step 1 .. p-1)
#pragma unroll
    for (int step = 1; step < MAX_RANKS; step++) to[step] = step < p ? bufs[(rank + step) % p] : nullptr;
    uint4* my_buf = bufs[rank];
    const bool reads_signature = sig != 0 && threadIdx.x < p && threadIdx.x != rank;
    const bool signals = reads_signature && blockIdx.x == 0;
    unsigned int* their_flags = signals ? flags[threadIdx.x] : nullptr;
    const unsigned int* my_flags = reads_signature ? flags[rank] : nullptr;
    const Call this_call = begin_call(ctl, epochs);
    if (failed_before(this_call)) { finish(ctl, epochs, this_call, false); return; }
    if (signals) send_signature(their_flags, this_call.agreement, rank, sig);
    const unsigned int call = this_call.number;
    const long long scatter = base + (long long)(call & 1u) * 2 * p * slot_packs;   // p scatter slots, then
    const long long gather = scatter + (long long)p * slot_packs;                     //  p gather slots
    const long long mine_from = (long long)rank * chunk, mine = lmin(chunk, packs - mine_from);  // (may be <= 0)
    FOR_MY_PACKS(i, 0, chunk) {                             // push: chunk q to rank q
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {      // rank r starts at r+1: peers spread the load
            if (step >= p) break;
            const long long j = (long long)((rank + step) % p) * chunk + i;
            if (j < packs) store_line(to[step] + scatter + rank * slot_packs + i, sanitize(x[j]));
        }
    }
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    PacksLanding land{my_buf + scatter, slot_packs, rank, p};
    const int verdict = agree_as_packs_land(ctl, this_call, sig, my_flags, epochs, rank, p, first, mine, land);
    if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    const uint4 empty = make_uint4(SENTINEL, SENTINEL, SENTINEL, SENTINEL);
    FOR_MY_PACKS(i, 0, mine) {                              // my chunk: sum it, push the sum to everyone
        if (i != first) land.read(i);
        Pack<T> v[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) {
            if (q >= p) continue;
            if (q == rank) { v[q].raw = sanitize(x[mine_from + i]); continue; }
            uint4* pack = my_buf + scatter + q * slot_packs + i;
            v[q].raw = landed(land.v[q]) ? land.v[q] : wait_pack(pack, ctl, q, call);
            store_line(pack, empty);                        // (read: the sentinel back, for two calls on)
        }
        const uint4 s = sanitize(sum_packs<T>(v, p));      // (a sum is never the sentinel; kept safe anyway)
        out[mine_from + i] = s;
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {
            if (step >= p) break;
            store_line(to[step] + gather + rank * slot_packs + i, s);
        }
    }
    FOR_MY_PACKS(i, 0, chunk) {                             // the others' chunks, as their sums land
        uint4 got[MAX_RANKS];
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {      // every peer's pack read at once (one trip)
            const int q = (rank + step) % p;
            if (step < p && (long long)q * chunk + i < packs) got[step] = load_line(my_buf + gather + q * slot_packs + i);
        }
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {
            const int q = (rank + step) % p;
            if (step >= p || (long long)q * chunk + i >= packs) continue;
            uint4* pack = my_buf + gather + q * slot_packs + i;
            out[(long long)q * chunk + i] = landed(got[step]) ? got[step] : wait_pack(pack, ctl, q, call);
            store_line(pack, empty);
        }
    }
    finish(ctl, epochs, this_call, true, false, sig != 0 ? this_call.agreement : 0u);   // (counts the agreement)
}
