"""Plan a run before submitting it: parameters, memory per GPU and step time from the config alone.

The figures follow what megalite allocates (checked against measured tensors in tests/test_plan.py),
not a generic transformer: `parameters` counts each rank's tensors, `activations` the tensors
autograd keeps per micro batch, `memory` adds the optimizer's state and the pipeline schedule's
in-flight micro batches, and `plan` turns that into a verdict for a GPU. `measure` takes the same figures from
real tensors (for tools/ and tests/), so that the two can be held against each other.
"""
