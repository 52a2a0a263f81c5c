"""Pairwise test grids: every pair of values of any two factors in at least one case, not every combination.

The equivalence grids (step mode x loss x loss scale x split, ...) are products of independent factors; a
bug in how two of them meet (a scale mode on an uneven split, a loss in one step mode) shows in every case
holding that pair, which this covers, at a fraction of the product's cases (21 of 84 for 2 x 2 x 3 x 7).
``pairwise`` is deterministic (IPO order: the two largest factors in full, each further factor chosen per
case to cover the most pairs not yet covered); ``shift`` rotates the tie-breaks, so that two grids over the
same factors (plain and stochastic) cover different combinations beyond their pairs.
"""
import itertools

import pytest


def pairwise(shift: int = 0, **factors):
    """``pytest.param`` cases, in the order of ``factors``' keys, ids like ``replay-clip-linear-(1, 2)``."""
    names = sorted(factors, key=lambda name: -len(factors[name]))  # stable: equal sizes keep their order
    first, second = names[:2]
    rows = [{first: a, second: b} for a, b in itertools.product(factors[first], factors[second])]
    for done, name in enumerate(names[2:], start=2):
        values = list(factors[name])
        uncovered = {(prev, v, w) for prev in names[:done] for v in factors[prev] for w in values}
        for i, row in enumerate(rows):
            order = values[(i + shift) % len(values):] + values[:(i + shift) % len(values)]
            best = max(order, key=lambda w: sum((prev, row[prev], w) in uncovered for prev in row))
            row[name] = best
            uncovered -= {(prev, row[prev], best) for prev in names[:done]}
        for prev, v, w in sorted(uncovered, key=repr):  # pairs no case could take: a case each
            rows.append({**{n: factors[n][0] for n in names[:done]}, prev: v, name: w})
    keys = list(factors)
    return [pytest.param(*(row[k] for k in keys), id="-".join(str(row[k]) for k in keys)) for row in rows]


def pairs_covered(cases, **factors) -> bool:
    """Whether ``cases`` (from ``pairwise``) hold every pair of values of every two factors."""
    keys = list(factors)
    seen = {(a, x, b, y) for case in cases for (a, x), (b, y) in itertools.combinations(zip(keys, case.values), 2)}
    return all((a, x, b, y) in seen for a, b in itertools.combinations(keys, 2)
               for x in factors[a] for y in factors[b])
