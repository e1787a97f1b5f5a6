"""Training steps replayed from captured CUDA graphs.

A step of a small model launches a few hundred kernels, and on a GPU each takes longer to
launch from Python than to run: the GPU waits on the launches (docs/performance.md, "GPU").
Where a step is the same computation on the same tensors every time, only the contents of
its inputs changing, CUDA can record it once as a graph and replay it with one launch
(``torch.cuda.CUDAGraph``). Replaying runs the same kernels on the same memory, so the
results are the eager step's, bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

from p2pfl.core.collector import collector_paused

_SIDE: dict[int, torch.cuda.Stream] = {}
"""One side stream per GPU for every warm-up and capture, so that a capture finds the
cuBLAS and cuDNN state its warm-up set up for that stream."""


class Replayed:
    """``run()``, a step whose inputs are fixed tensors (refilled before each call), run
    as it is on a CPU and replayed from a CUDA graph on a GPU.

    On CUDA the first call runs the step on the side stream (the warm-up a capture needs:
    cuBLAS and cuDNN set up their workspaces, an optimizer its buffers), the second
    captures it there and replays it, and later calls replay it. Every call is one real
    step. A step that cannot be captured runs as it is from then on, with a warning. The
    graph keeps what was in force at its capture (cuDNN's flags, TF32 among them).
    """

    def __init__(self, run: Callable[[], None], device: torch.device) -> None:
        self.run, self.device = run, device
        self.eager = device.type != "cuda"  # on a CPU, or once a capture has failed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False

    def __call__(self) -> None:
        if self.eager:
            self.run()
            return
        if self.graph is not None:
            self.graph.replay()
            return
        main = torch.cuda.current_stream(self.device)  # cuda:N's, whichever is current
        if main.device_index not in _SIDE:
            _SIDE[main.device_index] = torch.cuda.Stream(main.device)
        side = _SIDE[main.device_index]
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):  # (which makes the stream's device current)
                if self.warm:
                    self.graph = self._capture()
                else:
                    self.run()
                    self.warm = True
        finally:  # the main stream goes on after the side stream's work, even a failed one
            main.wait_stream(side)
        if self.graph is not None:  # capturing recorded the step without running it
            self.graph.replay()
        elif self.eager:  # the capture failed: nothing ran, so run it as it is
            self.run()

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """The step captured as a graph (torch.cuda.graph's steps, less its synchronizing
        and its emptying of the allocator's cache); None, and no more tries, if CUDA
        refuses to capture it.

        Python's cyclic garbage collector is held off meanwhile: a collection could free
        another graph and its memory, which CUDA forbids during a capture (the capture
        then fails)."""
        graph = torch.cuda.CUDAGraph()
        with collector_paused():
            graph.capture_begin()
            try:
                self.run()
            except BaseException as e:
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()  # leave the stream capturing no more
                if not isinstance(e, RuntimeError):  # an interruption: not the capture's
                    raise
                warnings.warn(f"a training step is not captured as a CUDA graph: {e}", stacklevel=2)
                self.eager = True
                return None
            graph.capture_end()
        return graph
