"""The NCCL-rule verifier: record the communication that gloo ranks really perform (record.py), then replay it
under NCCL's rules (replay.py).

gloo forgives what NCCL does not: a gloo send never blocks another rank's call, and tags
route messages. NCCL (user guide, "Point-to-point communication"; ncclSend/ncclRecv) runs
every call on a GPU stream:

- a send or receive blocks its stream until the peer's matching call runs; only the calls
  of one group (one `batch_isend_irecv`) progress together;
- messages match in the order they were posted per communicator and direction; tags are
  ignored;
- calls on one stream run in the order they were posted; a batch and every collective use
  the process group's communicator and stream; a single `isend`/`irecv` uses a two-rank
  communicator of its own ("pair" communicators), or the group's one when the group was bound
  to a device ("group" communicators); both are replayed;
- every call waits for the compute queued before it, which waits for every call already
  waited on (`work.wait()` does not block the host; it orders the compute stream).

`CommRecorder` observes the process groups of one process (parallel/observed.py: the backend
that tools, tests and the dry run create their groups with) and records, in order, each call
it posts (communicator, peers, sizes, a digest of the bytes sent or received) and each wait
on it. `replay` runs all ranks' records as NCCL would and reports
every call that could never finish (a hang), every message NCCL would deliver to another
receive than gloo did (a silent swap), and every size or collective mismatch.

It verifies, it does not communicate; it lives in megalite, not only in the tests, because the dry run records
the calls of ranks it simulates on fake tensors (no bytes to digest: sizes and order are checked, not contents).
"""
