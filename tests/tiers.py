"""The two tiers of the test suite.

The default run keeps, of each parametrised test, a representative subset: every value of every
parameter at least once (each-choice coverage), chosen greedily in collection order, so that
every kernel path a parameter selects still runs forward and backward. ``--exhaustive`` runs the
whole cross product as well (CI does). Tests without parameters always run.
"""

from __future__ import annotations

from collections import defaultdict


def _choices(item) -> frozenset:
    """The (parameter, value) pairs of a parametrised item (empty for a plain test). A value is
    known by identity: the items of one parametrisation share the objects of its list."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return frozenset()
    return frozenset((name, id(value)) for name, value in spec.params.items())


def representative(items) -> set:
    """The items of the default tier (of ``items``): per test function, a greedy cover of its
    parameter choices."""
    groups = defaultdict(list)
    for item in items:
        groups[(item.path, item.cls, getattr(item, "originalname", item.name))].append(item)
    keep = set()
    for members in groups.values():
        choices = [_choices(m) for m in members]
        uncovered = set().union(*choices)
        if not uncovered:
            keep.update(members)
            continue
        while uncovered:
            best = max(range(len(members)), key=lambda i: len(choices[i] & uncovered))
            keep.add(members[best])
            uncovered -= choices[best]
    return keep
