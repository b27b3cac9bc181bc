"""Notebook 04's exercises: a column-parallel and a row-parallel linear layer, with the right f and g.

    report = cluster.run(check_column_parallel, column_forward)[0]  # fn(x, weight, bias, comm) -> my columns of Y
    report = cluster.run(check_row_parallel, row_forward)[0]        # fn(x_mine, weight, bias, comm) -> all of Y
    print(format_report(report))

Y = X Aᵀ + b as torch.nn.Linear computes it (weight: out_features × in_features), in float64, against the
unsplit layer on every rank: the output, and the gradient with respect to the input after a backward pass
(which is where f shows). The all-reduces each pass runs are counted (``tplab.layers.mappings.calls``):
column-parallel needs none forward and one backward (f); row-parallel one forward (g) and none backward.
"""

from __future__ import annotations

from tplab.comm import world
from tplab.lab.exercises.runner import Case, run_cases

SHAPES = [("2 x 3 tokens", (2, 3), 4, 6), ("1 token", (1, 1), 2, 2), ("5 x 7 tokens, wider", (5, 7), 8, 4)]


def _tensors(lead, h_in, h_out, seed):
    import torch

    g = torch.Generator().manual_seed(seed)  # the same on every rank
    x = torch.randn(*lead, h_in, generator=g, dtype=torch.float64)
    weight = torch.randn(h_out, h_in, generator=g, dtype=torch.float64)
    bias = torch.randn(h_out, generator=g, dtype=torch.float64)
    grad = torch.randn(*lead, h_out, generator=g, dtype=torch.float64)  # dLoss/dY for the backward pass
    return x, weight, bias, grad


def _run(fn, x, weight, bias, grad_out, comm):
    """The reader's forward pass, then a backward pass; what came out and how many all-reduces each ran."""
    from tplab.layers import mappings

    x = x.clone().requires_grad_(True)
    before = mappings.calls["allreduce"]
    y = fn(x, weight, bias, comm)
    forward = mappings.calls["allreduce"] - before
    grad = None
    if y is not None and getattr(y, "requires_grad", False) and getattr(y, "shape", None) == grad_out.shape:
        y.backward(grad_out)
        grad = x.grad
    return {"y": None if y is None else y.detach(), "grad": grad,
            "forward": forward, "backward": mappings.calls["allreduce"] - before - forward}


def _close(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12))


def _counts(got, want_forward, want_backward, f_or_g) -> str | None:
    if got["forward"] != want_forward or got["backward"] != want_backward:
        return (f"right values, but {got['forward']} all-reduce(s) in the forward pass and {got['backward']} in the "
                f"backward pass, where {f_or_g} needs {want_forward} and {want_backward}")
    return None


def _diagnose_column(got, case, p):
    y_want, grad_want, _ = case.expected
    y = got["y"]
    if y is None:
        return "returned None (return this rank's columns of Y)"
    if y.shape != y_want.shape:
        return (f"returned shape {tuple(y.shape)}, expected {tuple(y_want.shape)}: this rank's h_out/p output "
                "features (a column-parallel layer does not gather them)")
    if not _close(y, y_want):
        if got["forward"] > 0:
            return ("wrong output, after an all-reduce in the forward pass: the ranks hold different columns of Y, "
                    "there is nothing to add up. Column-parallel needs f (identity forward), not g")
        return "wrong output: rank r computes X A_rᵀ + b_r with its own rows of the weight and its slice of the bias"
    if got["grad"] is None:
        return ("the output carries no gradient back to x: use tplab.layers.mappings' autograd ops (not "
                ".detach() or the plain all_reduce)")
    if not _close(got["grad"], grad_want):
        return ("right output, but x.grad holds only this rank's share of dX: put f (copy_to_tensor_parallel_region) "
                "in front of the matmul; its backward pass all-reduces the gradient")
    return _counts(got, 0, 1, "a column-parallel layer")


def check_column_parallel(fn, comm=None, *, timeout: float = 5.0, progress=True):
    """``fn(x, weight, bias, comm)``: x (..., h_in) the same on every rank; weight (h_out/p, h_in) and bias
    (h_out/p,) this rank's rows of the full layer's (rank r: block r). Must return this rank's output
    features, (..., h_out/p), with f in front. Call it on every rank."""
    base = comm or world()
    p, r = base.size, base.rank
    cases = []
    for i, (name, lead, h_in, h_out) in enumerate(SHAPES):
        x, weight, bias, grad = _tensors(lead, h_in * p, h_out * p, seed=i)
        mine = slice(r * h_out, (r + 1) * h_out)
        y_full = x @ weight.T + bias
        cases.append(Case(f"{name}, {h_in * p} -> {h_out * p}",
                          (x, weight[mine].clone(), bias[mine].clone(), grad[..., mine].clone()),
                          (y_full[..., mine], grad @ weight, None)))
    run = lambda x, w, b, g, c: _run(fn, x, w, b, g, c)
    return run_cases(run, cases, _diagnose_column, comm=base, timeout=timeout, title="column-parallel: ",
                     progress=progress)


def _diagnose_row(got, case, p):
    y_want, grad_want, bias = case.expected
    y = got["y"]
    if y is None:
        return "returned None (return Y, all h_out features, the same on every rank)"
    if y.shape != y_want.shape:
        return f"returned shape {tuple(y.shape)}, expected {tuple(y_want.shape)}: all h_out output features"
    if not _close(y, y_want):
        if p > 1 and _close(y - (p - 1) * bias, y_want):
            return "the bias was added p times: add it once, after the all-reduce (g), not to every partial sum"
        if got["forward"] == 0:
            return ("wrong output: each rank holds only its partial product X_r A_rᵀ; add them up over the ranks with "
                    "g (reduce_from_tensor_parallel_region), then add the bias")
        if p > 1 and _close(y, y_want * p):
            return "the output is p times too large: one all-reduce of the partial products, not of a full product"
        return f"wrong output (after {got['forward']} all-reduce(s) in the forward pass)"
    if got["grad"] is None:
        return ("the output carries no gradient back to x: use g = reduce_from_tensor_parallel_region (an autograd "
                "op), not the plain mappings.all_reduce, which detaches")
    if not _close(got["grad"], grad_want):
        return "right output, wrong x.grad: g's backward pass is the identity (no all-reduce of the gradient)"
    return _counts(got, 1, 0, "a row-parallel layer")


def check_row_parallel(fn, comm=None, *, timeout: float = 5.0, progress=True):
    """``fn(x, weight, bias, comm)``: x (..., h_in/p) this rank's slice of the input features (block r),
    weight (h_out, h_in/p) the matching columns of the full weight, bias (h_out,) the whole bias. Must return
    Y = X Aᵀ + b, all of it, on every rank, with g after the partial products. Call it on every rank."""
    base = comm or world()
    p, r = base.size, base.rank
    cases = []
    for i, (name, lead, h_in, h_out) in enumerate(SHAPES):
        x, weight, bias, grad = _tensors(lead, h_in * p, h_out * p, seed=100 + i)
        mine = slice(r * h_in, (r + 1) * h_in)
        y_full = x @ weight.T + bias
        cases.append(Case(f"{name}, {h_in * p} -> {h_out * p}",
                          (x[..., mine].clone(), weight[:, mine].clone(), bias.clone(), grad),
                          (y_full, (grad @ weight)[..., mine], bias)))
    run = lambda x, w, b, g, c: _run(fn, x, w, b, g, c)
    return run_cases(run, cases, _diagnose_row, comm=base, timeout=timeout, title="row-parallel: ",
                     progress=progress)
