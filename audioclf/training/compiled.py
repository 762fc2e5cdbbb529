"""train.compile: torch.compile of the embedder for training, every compilation logged.

    compilations = compile_embedder(net)   # in place: the state dict keeps its keys
    compilations.count                     # compilations so far (1 after the first step)
    compilations.per_frame                 # {frame: its compilations}; graph breaks add frames

The first step compiles for its shapes (static). A batch of another size later (files skipped
as unreadable, the empty-batch placeholder) or another crop length (train.final_epochs)
compiles once more with the dimension that changed dynamic (torch's automatic dynamic shapes),
and further sizes reuse that graph. With static shapes every new batch size compiled anew (on a
GPU each holds the DDP peers for tens of seconds) until torch's recompile limit (8), past which
the embedder ran eagerly without a word; here each compilation is a line in train.log, and
reaching the limit a warning. Compilations are counted per code object (torch's frame_id), as
torch's limit is: a graph break's resume function is a frame of its own, logged as a graph break
(the code after it compiled apart), not as a recompilation for a new batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger("audioclf")

Backend = Callable[[torch.fx.GraphModule, list], Callable]


class Compilations:
    """A torch.compile backend that counts and logs each compilation of the frame it compiles,
    then hands the graph to `backend` (torch's "inductor" by default, or any torch.compile
    backend callable). Graphs that DDP's optimizer splits out of one compilation count once.
    `count`: every compilation; `per_frame`: {frame_id: compilations of that code object};
    `graph_breaks`: frames compiled beyond the first (each a resume after a graph break)."""

    def __init__(self, backend: str | Backend = "inductor"):
        self.backend = (
            torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        )
        self.compiler_name = backend if isinstance(backend, str) else "audioclf"
        self.count = 0
        self.per_frame: dict[int | None, int] = {}
        self.graph_breaks = 0
        self._last = None

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is None or compile_id != self._last:
            self._last = compile_id
            self.count += 1
            frame = None if compile_id is None else compile_id.frame_id
            self.per_frame[frame] = self.per_frame.get(frame, 0) + 1
            self._log(frame, _inputs(graph))
        return self.backend(graph, example_inputs)

    def _log(self, frame: int | None, inputs: str) -> None:
        times = self.per_frame[frame]
        if times == 1 and len(self.per_frame) == 1:
            log.info("train.compile: compiling the embedder for %s", inputs)
            return
        if times == 1:
            self.graph_breaks += 1
            log.info(
                "train.compile: a graph break in the embedder: the code after it compiles as a "
                "graph of its own (frame %s, %d frames so far) for %s",
                frame,
                len(self.per_frame),
                inputs,
            )
            return
        log.info(
            "train.compile: the embedder compiles again (compilation %d) for %s: a new batch "
            "size or crop length; the dimensions that changed are dynamic from now on",
            times,
            inputs,
        )
        limit = torch._dynamo.config.recompile_limit
        if times >= limit:
            log.warning(
                "train.compile: %d compilations of the embedder, torch's recompile limit "
                "(torch._dynamo.config.recompile_limit): inputs of yet other shapes run it "
                "eagerly",
                times,
            )


def compile_embedder(net: nn.Module, backend: str | Backend = "inductor") -> Compilations:
    """Compile `net.embedder` in place (its parameters keep their names), dynamic=None: static
    for the first shapes, a dimension that changes made dynamic. Returns the counter."""
    compilations = Compilations(backend)
    net.embedder.compile(backend=compilations, dynamic=None)
    return compilations


def _inputs(graph: torch.fx.GraphModule) -> str:
    """The graph's input tensors and their shapes ("feats [s0, 300, 80], lengths [s0]"), the
    parameters and buffers left out."""
    shown = []
    for node in graph.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            name = node.name.removeprefix("l_").removesuffix("_")
            if not name.startswith("self_"):
                shown.append(f"{name} [{', '.join(map(str, value.shape))}]")
    return ", ".join(shown) or "its inputs"
