"""The feature matrix for blockwise backends, sampled so every pair of values meets.

All-pairs (pairwise) coverage: for any two parameters, every combination of
their values appears in at least one case. A greedy construction over a fixed
seed keeps the list deterministic and about as long as the two largest value
lists multiplied, instead of their full product.
"""

from __future__ import annotations

import itertools
import random

import torch

from numerics import Case

PARAMETERS = {
    "lengths": [(1, 1), (7, 7), (113, 113), (128, 128), (129, 129), (1000, 1000),
                (7, 129), (129, 7), (113, 1000), (1, 128)],
    "head_dim": [32, 64, 80, 128, 256],
    "heads": [(2, 2), (8, 2), (8, 1)],  # MHA, GQA 8:2, MQA 8:1
    "dtype": [torch.float32, torch.bfloat16],
    "causal": [False, True],
    "window": [None, (16, 0), (None, 8), (5, 5)],
    "segments": [None, "padding", "packed", "unmatched"],
    "softcap": [None, 20.0],
    "bias": [None, "full", "broadcast"],
    "dropout_p": [0.0, 0.1],
}


def pairwise_cases(seed: int = 0, candidates: int = 40) -> list[Case]:
    return [case_of(values) for values in pairwise(PARAMETERS, seed, candidates)]


def this_stacks_share(cases: list) -> list:
    """A matrix split between the two stacks: .venv (torch_xla) takes the even cases, .venv-current the odd ones.
    Every case runs once, on one stack, and each value of every parameter appears on both."""
    from torchattn import _versions

    return cases[::2] if _versions.installed_stack() == "xla" else cases[1::2]


def pairwise(parameters: dict[str, list], seed: int = 0, candidates: int = 40) -> list[dict]:
    """Picks of one value per parameter (name -> value) in which every pair of values of two parameters meets."""
    names = list(parameters)
    uncovered = {((a, i), (b, j)) for a, b in itertools.combinations(names, 2)
                 for i in range(len(parameters[a])) for j in range(len(parameters[b]))}
    rng = random.Random(seed)
    chosen = []
    while uncovered:
        # Seed each candidate with one uncovered pair so every round makes progress.
        (a, i), (b, j) = min(uncovered)
        best, best_gain = None, -1
        for _ in range(candidates):
            pick = {n: rng.randrange(len(parameters[n])) for n in names}
            pick[a], pick[b] = i, j
            gain = sum(((x, pick[x]), (y, pick[y])) in uncovered for x, y in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = pick, gain
        uncovered -= {((x, best[x]), (y, best[y])) for x, y in itertools.combinations(names, 2)}
        chosen.append(best)
    return [{n: parameters[n][k] for n, k in pick.items()} for pick in chosen]


def drawn_cases(seed: int, count: int, **fixed) -> list[Case]:
    """``count`` cases with every parameter drawn at random with ``seed`` (those in ``fixed`` set): shapes and
    features no kernel change was measured or tuned on, for checking a change of arithmetic on held-out calls."""
    rng = random.Random(seed)
    return [case_of({name: fixed[name] if name in fixed else rng.choice(values) for name, values in PARAMETERS.items()})
            for _ in range(count)]


def case_of(values: dict) -> Case:
    (q_len, kv_len), (q_heads, kv_heads) = values.pop("lengths"), values.pop("heads")
    batch = 1 if max(q_len, kv_len) >= 1000 else 2  # keeps the long cases cheap on CPU
    return Case(batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads, kv_heads=kv_heads, **values)


def tpu_generations() -> list[str]:
    """The generations this environment's compile sweeps cover: in .venv every one its libtpu compiles for; in
    .venv-current only those no other stack's libtpu compiles for (v7x): the others are swept in .venv."""
    from torchattn import _versions
    from torchattn.tpu import generations

    here = generations.compile_targets()
    if _versions.installed_stack() == "xla":
        return here
    return [name for name in here if "xla" not in generations.get(name).stacks]


# The generation the whole feature matrix is compiled for in this environment (tests/test_tpu_compile.py): v5e,
# the chip every comparison is made on, where its libtpu compiles it, else the newest generation swept here.
MATRIX_GENERATION = "v5e" if "v5e" in tpu_generations() else tpu_generations()[-1]
