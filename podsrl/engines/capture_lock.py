"""The one lock a CUDA graph capture holds, and so does device work that could run beside one.

PyTorch's constraints on a capture (CUDA semantics, "CUDA Graphs", Constraints) include two that a process with
two threads on one device can break: only one capture may be underway at a time, and no non-captured CUDA work may
run in the process, on any thread, while one is (silent numerical errors or undefined behaviour). train.async has
such a pair: the generator thread's engine captures decode-step graphs (engines/decode_step.CudaGraphs) on first use
of each bucket while the learner updates. So every capture holds this lock, and so does the learner's device work
while a generator thread runs (the update, the weight snapshot it publishes); eval and checkpoints run with the
generator quiesced. They take turns only there: replays and eager work on both threads overlap as before.

The capture mode stays PyTorch's default, "global": with the lock held, another thread's potentially unsafe call
during a capture (a cudaMalloc as the caching allocator grows) can only be device work the lock missed, and "global"
makes that an error instead of the silent corruption "thread_local" would allow.
"""

from __future__ import annotations

import threading

# re-entrant: a thread holding it for its device work may capture inside (an engine on the learner's own thread)
CAPTURE_LOCK = threading.RLock()
