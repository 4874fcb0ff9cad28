"""A batched Python op for python/tests/test_metrics.py (the gpuq_batch_* histograms, and the
batching settings in the status): its pool imports this module beside pyops_mod."""

import numpy as np

import gpuq


@gpuq.op("scale_rows", max_batch_size=8, max_queue_delay_us=500)
def scale_rows(x):
    """x times 2, row by row (batched: x holds the rows of every job gathered)."""
    return np.asarray(x) * 2
