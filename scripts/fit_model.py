"""Fit alpha, beta, gamma on this machine and hold the model against measured allreduce times.

    mpiexec -n 4 python scripts/fit_model.py OUT.csv "machine description"

Writes one row per (algorithm, size) with the measured time and three predictions: the model fitted on
micro-benchmarks (alpha-beta-gamma plus the measured cost of entering a call; tplab.cost.fit_on), the
same calibrated with a per-step overhead (fit_step), and the five parameters fitted to the algorithms'
own timings (fit_on_timings); prints how many points land within 25% for each. The sweep runs twice;
the second run's times (time_us_repeat) show how much the measurement itself moves between runs.
"""

import csv
import sys

import numpy as np

from tplab.lab.bench import sweep
from tplab.comm import world
from tplab.cost import compare, fit_on, fit_on_timings, fit_step

comm = world()
out, machine_name = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
sizes = [8 << (2 * i) for i in range(11)]  # 8 B .. 8 MiB: fit over the sizes it must predict (caches!)
machine, _, _ = fit_on(comm, sizes=sizes, name=machine_name)
algorithms = ["ring", "recursive_doubling", "rabenseifner"]

rows = sweep("allreduce", algorithms + ["builtin"], sizes, iters=50, warmup=5, comm=comm)
# the same sweep again: how far one measurement is from the next (no model can be closer than that)
again = sweep("allreduce", algorithms + ["builtin"], sizes, iters=50, warmup=5, comm=comm)
calibrated = fit_step(rows, machine)
on_timings = fit_on_timings(rows, name=machine_name, algorithms=algorithms)
plain, tuned, timed = compare(rows, machine), compare(rows, calibrated), compare(rows, on_timings)
if comm.rank == 0:
    with open(out, "w", newline="") as f:
        fields = ["machine", "ranks", "algorithm", "size", "time_us", "predicted_us", "error",
                  "calibrated_us", "calibrated_error", "alpha", "beta", "gamma", "entry", "entry_per_byte", "step",
                  "switch_bytes", "alpha_large", "beta_large", "timings_fit_us", "timings_fit_error", "time_us_repeat"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for a, b, c, d in zip(plain, tuned, timed, again):
            writer.writerow({"machine": machine_name, "ranks": a["ranks"], "algorithm": a["algorithm"],
                             "size": a["size"], "time_us": a["time_us"], "predicted_us": a["predicted_us"],
                             "error": a["error"], "calibrated_us": b["predicted_us"], "calibrated_error": b["error"],
                             "alpha": machine.alpha, "beta": machine.beta, "gamma": machine.gamma,
                             "entry": machine.entry, "entry_per_byte": machine.entry_per_byte,
                             "step": calibrated.step, "switch_bytes": machine.switch_bytes,
                             "alpha_large": machine.alpha_large, "beta_large": machine.beta_large,
                             "timings_fit_us": c["predicted_us"], "timings_fit_error": c["error"],
                             "time_us_repeat": d["time_us"]})
    print(f"p={comm.size}: alpha {machine.alpha * 1e6:.2f} us, 1/beta {1 / machine.beta / 1e9:.2f} GB/s, "
          f"1/gamma {1 / machine.gamma / 1e9:.2f} GB/s, entry {machine.entry * 1e6:.2f} us, "
          f"step {calibrated.step * 1e6:.2f} us")
    if machine.alpha_large is not None:
        print(f"  above {machine.switch_bytes:.0f} B per message: alpha {machine.alpha_large * 1e6:.2f} us, "
              f"1/beta {1 / machine.beta_large / 1e9:.2f} GB/s")
    print(f"  fitted on the timings: {on_timings}")
    for algorithm in algorithms:
        line = f"  {algorithm:>20}:"
        for label, table in [("micro-benchmarks", plain), ("+ step", tuned), ("on timings", timed)]:
            e = np.abs([r["error"] for r in table if r["algorithm"] == algorithm])
            line += f"  {label} {np.sum(e <= 0.25)}/{len(e)} within 25% (median {np.median(e):.2f})"
        print(line)
    drift = np.array([abs(d["time_us"] / a["time_us"] - 1) for a, d in zip(plain, again) if a["algorithm"] in algorithms])
    print(f"  the same sweep repeated: median {np.median(drift):.2f}, max {drift.max():.2f} relative difference")
