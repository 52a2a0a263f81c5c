"""Rank 0's evaluations: ``evaluate`` (retrieval on ``--val-data``), ``zeroshot`` (zero-shot classification).

Invariant: an evaluation reads the weights and changes nothing the run trains or keeps; its metrics are open_clip's."""
