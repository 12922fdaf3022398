"""Plan a run before submitting it: parameters, memory per GPU and step time from the config alone.

The figures follow what megalite allocates (checked against measured tensors in tests/test_plan.py),
not a generic transformer, read from the model each rank builds, built on the meta device (`built`): its
parameters, and what each module declares it costs beside its code (model/costs.py); nothing here describes a
layer's shapes. `parameters` counts each rank's tensors, `activations` the tensors autograd keeps per micro
batch, `memory` adds the optimizer's state and the pipeline schedule's
in-flight micro batches, and `plan` turns that into a verdict for a GPU. `measure` takes the same figures from
real tensors (for tools/ and tests/), so that the two can be held against each other.
"""
