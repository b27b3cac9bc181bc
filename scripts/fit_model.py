"""Fit alpha, beta, gamma on this machine and hold the model against measured allreduce times.

    mpiexec -n 4 python scripts/fit_model.py OUT.csv "machine description"

Writes one row per (algorithm, size) with the measured time, the prediction of the fitted model (pure
alpha-beta-gamma plus the measured cost of entering a call) and of the same model calibrated with a
per-step overhead (tplab.cost.fit_step), and prints how many points land within 25%.
"""

import csv
import sys

import numpy as np

from tplab.bench import sweep
from tplab.comm import world
from tplab.cost import compare, fit_on, fit_step

comm = world()
out, machine_name = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
sizes = [8 << (2 * i) for i in range(11)]  # 8 B .. 8 MiB: fit over the sizes it must predict (caches!)
machine, _, _ = fit_on(comm, sizes=sizes, name=machine_name)
algorithms = ["ring", "recursive_doubling", "rabenseifner"]

rows = sweep("allreduce", algorithms + ["builtin"], sizes, iters=20, warmup=3, comm=comm)
calibrated = fit_step(rows, machine)
plain, tuned = compare(rows, machine), compare(rows, calibrated)
if comm.rank == 0:
    with open(out, "w", newline="") as f:
        fields = ["machine", "ranks", "algorithm", "size", "time_us", "predicted_us", "error",
                  "calibrated_us", "calibrated_error", "alpha", "beta", "gamma", "entry", "entry_per_byte", "step",
                  "switch_bytes", "alpha_large", "beta_large"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for a, b in zip(plain, tuned):
            writer.writerow({"machine": machine_name, "ranks": a["ranks"], "algorithm": a["algorithm"],
                             "size": a["size"], "time_us": a["time_us"], "predicted_us": a["predicted_us"],
                             "error": a["error"], "calibrated_us": b["predicted_us"], "calibrated_error": b["error"],
                             "alpha": machine.alpha, "beta": machine.beta, "gamma": machine.gamma,
                             "entry": machine.entry, "entry_per_byte": machine.entry_per_byte,
                             "step": calibrated.step, "switch_bytes": machine.switch_bytes,
                             "alpha_large": machine.alpha_large, "beta_large": machine.beta_large})
    print(f"p={comm.size}: alpha {machine.alpha * 1e6:.2f} us, 1/beta {1 / machine.beta / 1e9:.2f} GB/s, "
          f"1/gamma {1 / machine.gamma / 1e9:.2f} GB/s, entry {machine.entry * 1e6:.2f} us, "
          f"step {calibrated.step * 1e6:.2f} us")
    if machine.alpha_large is not None:
        print(f"  above {machine.switch_bytes:.0f} B per message: alpha {machine.alpha_large * 1e6:.2f} us, "
              f"1/beta {1 / machine.beta_large / 1e9:.2f} GB/s")
    for algorithm in algorithms:
        e = np.array([r["error"] for r in plain if r["algorithm"] == algorithm])
        c = np.array([r["calibrated_error"] if "calibrated_error" in r else r["error"]
                      for r in tuned if r["algorithm"] == algorithm])
        print(f"  {algorithm:>20}: within 25%: {np.sum(np.abs(e) <= 0.25)}/{len(e)} "
              f"(calibrated {np.sum(np.abs(c) <= 0.25)}/{len(c)}), median |error| {np.median(np.abs(e)):.2f} "
              f"(calibrated {np.median(np.abs(c)):.2f})")
