"""Predict, then run: write a guess before the cell that measures or computes the answer.

    guess = None          # your guess here, e.g. 1.5e6
    ...                   # the cell that computes `actual`
    check_prediction("bytes rank 0 sends", guess, actual)

prints whether the guess was within the tolerance (10% by default; ``factor=2``: within a factor of two;
strings must match), or just the answer while the guess is None. Returns True, False or None (no guess).
"""

from __future__ import annotations


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def check_prediction(name: str, guess, actual, tolerance: float = 0.1, *, factor: float | None = None,
                     unit: str = "") -> bool | None:
    unit = f" {unit}" if unit else ""
    if guess is None or guess is ...:
        print(f"{name}: {_show(actual)}{unit}  (write a guess first next time: guess = ...)")
        return None
    if actual is None:
        print(f"{name}: nothing to compare with in this run (your guess: {_show(guess)}{unit})")
        return None
    if isinstance(actual, str) or isinstance(guess, str):
        ok = str(guess).strip().lower() == str(actual).strip().lower()
        how = "right" if ok else "not quite"
    elif factor is not None:
        ok = actual / factor <= guess <= actual * factor if actual > 0 else guess == actual
        how = f"within a factor of {factor:g}" if ok else f"off by more than a factor of {factor:g}"
    else:
        ok = abs(guess - actual) <= tolerance * abs(actual) if actual else guess == 0
        how = f"within {tolerance:.0%}" if ok else f"off by {abs(guess - actual) / abs(actual):.0%}" if actual \
            else "not zero"
    print(f"{name}: {_show(actual)}{unit}; your guess {_show(guess)}{unit} is {how}" + ("" if ok else ". Why?"))
    return ok
