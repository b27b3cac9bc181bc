// tplab's peer-memory kernels, one_shot_lamport.cu: a one-shot whose data says itself whether it has landed.
// Compiled as one source with the files before it (tplab.gpu_collectives.peer_kernels.KERNEL_FILES,
// in that order; memory_model.cuh explains the whole).

// ---- one-shot, Lamport-style: the data is its own flag (TensorRT-LLM's "Lamport" all-reduce) --------------
// one_shot_ll sends every 8 bytes of data beside a 4-byte tag twice over, so it pushes twice the bytes. Here
// the area is kept full of a value no input can hold -- the SENTINEL word, all ones -- and a rank pushes its
// packs as they are: a pack whose four words are all unlike the sentinel has landed. (A 16-byte store may
// reach a peer in pieces, but never a torn 4-byte word, so each word is checked.) No input holds the
// sentinel because the sender swaps it for a neighbouring value first (sanitize): for float32 the all-ones
// word is a NaN, swapped for another NaN; for bfloat16 and float16 it is two NaNs, of which the first is
// swapped for another NaN. So a NaN in stays a NaN out, and only these three types can go this way (an
// int32 -1 or a float64's low word may be all ones).
//   send the signature;  for q != r: bufs[q] slot r = sanitize(x)
//   wait for the peers' signatures and my first pack together (agree_as_packs_land)
//   out = sum in rank order of (sanitize(x) for me, my slot q for q);  my slot q = sentinel again
// The area alternates between two halves by the call's parity, as one_shot_ll's. A rank reads its half of
// this call and writes the sentinel back behind itself; a peer writes that half again only two calls on.
// Every call meets every peer, whatever its algorithm (an agreement, a barrier, data it waits for, or the
// ring's neighbours' barriers passed on around the ring), and this rank's next call starts only once this
// kernel has ended (after_previous_kernel): so a peer can start the call after next only after this rank's
// write-backs. The area is all sentinel between calls. A call that fails leaves pushes nobody read: the host
// then sets the whole area to the sentinel again between two barriers (PeerMemory._clean_after_failure).
#define SENTINEL 0xffffffffu

__device__ __forceinline__ unsigned int sanitize(unsigned int w) { return w == SENTINEL ? SENTINEL - 1u : w; }
__device__ __forceinline__ uint4 sanitize(uint4 v) {
    return make_uint4(sanitize(v.x), sanitize(v.y), sanitize(v.z), sanitize(v.w)); }
__device__ __forceinline__ bool landed(uint4 v) {
    return v.x != SENTINEL && v.y != SENTINEL && v.z != SENTINEL && v.w != SENTINEL; }

// How one_shot_lamport's packs land (agree_as_packs_land): as themselves, one 16-byte pack per peer.
struct PacksLanding {
    const uint4* mine;                                   // this call's half of this rank's area
    long long slot_packs;                                // packs per sender
    int rank, p;
    uint4 v[MAX_RANKS];
    __device__ __forceinline__ void read(long long i) {
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++)
            if (q < p && q != rank) v[q] = load_line(mine + q * slot_packs + i);
    }
    __device__ __forceinline__ int missing() const {
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++)
            if (q < p && q != rank && !landed(v[q])) return q;
        return -1;
    }
};

// Poll peer q's pack until it has landed (wait_line's twin: a peer that agreed pushes it, so waiting can
// only fail if its process died mid-call).
__device__ __forceinline__ uint4 wait_pack(const uint4* pack, Control* ctl, int q, unsigned int call) {
    uint4 v = load_line(pack);
    if (!landed(v)) {
        const unsigned long long start = wait_clock();
        unsigned int spins = 0;
        do {
            v = load_line(pack);
            if ((++spins & 1023u) == 0 && should_give_up(ctl, start)) { give_up_on(ctl, q, call); break; }
        } while (!landed(v));
    }
    return v;
}

// Arguments as one_shot_ll's; ``slot_packs``: packs per sender, ``p`` senders per half, from uint4 index ``base``.
template <typename T>
__global__ void one_shot_lamport(const uint4* x, uint4* out, uint4* const* bufs, unsigned int* const* flags,
                                 unsigned int* epochs, int rank, int p, long long packs, long long base,
                                 long long slot_packs, Control* ctl, unsigned long long sig) {
    after_previous_kernel();
    // Loaded before this rank's counts, in the same trip to L2 (one_shot_ll says why).
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 x_first = make_uint4(0u, 0u, 0u, 0u);
    if (first < packs) x_first = sanitize(x[first]);
    uint4* to[MAX_RANKS];                                   // to[step]: rank r + step's buffer (step 1 .. p-1)
#pragma unroll
    for (int step = 1; step < MAX_RANKS; step++) to[step] = step < p ? bufs[(rank + step) % p] : nullptr;
    const uint4* my_buf = bufs[rank];
    const bool reads_signature = sig != 0 && threadIdx.x < p && threadIdx.x != rank;
    const bool signals = reads_signature && blockIdx.x == 0;
    unsigned int* their_flags = signals ? flags[threadIdx.x] : nullptr;
    const unsigned int* my_flags = reads_signature ? flags[rank] : nullptr;
    const Call this_call = begin_call(ctl, epochs);
    if (failed_before(this_call)) { finish(ctl, epochs, this_call, false); return; }
    if (signals) send_signature(their_flags, this_call.agreement, rank, sig);
    const unsigned int call = this_call.number;
    const long long area = base + (long long)(call & 1u) * p * slot_packs;
    FOR_MY_PACKS(i, 0, packs) {                              // push: one pack to every peer, as it is
        const uint4 v = i == first ? x_first : sanitize(x[i]);
#pragma unroll
        for (int step = 1; step < MAX_RANKS; step++) {      // rank r starts at r+1: peers spread the load
            if (step >= p) break;
            store_line(to[step] + area + rank * slot_packs + i, v);
        }
    }
    uint4* mine = (uint4*)my_buf + area;
    PacksLanding land{mine, slot_packs, rank, p};
    const int verdict = agree_as_packs_land(ctl, this_call, sig, my_flags, epochs, rank, p, first, packs, land);
    if (verdict != AGREED) { finish(ctl, epochs, this_call, verdict != FAILED_BEFORE); return; }
    const uint4 empty = make_uint4(SENTINEL, SENTINEL, SENTINEL, SENTINEL);
    FOR_MY_PACKS(i, 0, packs) {
        if (i != first) land.read(i);
        const uint4 own = i == first ? x_first : sanitize(x[i]);
        Pack<T> v[MAX_RANKS];
#pragma unroll
        for (int q = 0; q < MAX_RANKS; q++) {
            if (q >= p) continue;
            uint4 got = own;
            if (q != rank) {
                uint4* pack = mine + q * slot_packs + i;
                got = landed(land.v[q]) ? land.v[q] : wait_pack(pack, ctl, q, call);
                store_line(pack, empty);                    // (read: the sentinel back, for two calls on)
            }
            v[q].raw = got;
        }
        out[i] = sum_packs<T>(v, p);
    }
    finish(ctl, epochs, this_call, true, false, sig != 0 ? this_call.agreement : 0u);   // (counts the agreement)
}
