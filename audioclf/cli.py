"""The `audioclf` command (`audioclf <tool> ...`, installed by `pip install .`): each tool's
own options, as `python -m audioclf.<tool>`. Nothing in the package imports it.

    audioclf train --config cpu_small data.index=my/index.xlsx     # = python -m audioclf.train
    audioclf evaluate --checkpoint runs/mine/best.pt --out runs/mine/eval
"""

from __future__ import annotations

import importlib
import runpy
import sys

# tool -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "train": ("audioclf.train", "train a model (recipes by name: --config cpu_small)"),
    "evaluate": ("audioclf.evaluate", "offline evaluation of a checkpoint: metrics and a report"),
    "export": ("audioclf.export", "export a model: TorchScript, ONNX or a state dict"),
    "embed": ("audioclf.embed", "embed files against a gallery, or a whole index sheet"),
    "prepare": ("audioclf.prepare", "precompute log-mel features for a sheet"),
    "search": ("audioclf.search.cli", "build or query a nearest-neighbour index"),
    "serve": ("audioclf.serve.cli", "a model behind an HTTP server, with a page to try it"),
    "demo": ("audioclf.data.demo", "generate the demo dataset"),
    "config": ("audioclf.config", "print the configuration reference"),
}


def main(argv: list[str] | None = None) -> int:
    """`audioclf <tool> [options]`: the tool's own options, as `python -m audioclf.<tool>`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
        print("usage: audioclf <tool> [options]   (audioclf <tool> --help for its options)\n")
        print("\n".join(["tools:", *lines]))
        print("\nmulti-GPU training: torchrun --nproc_per_node=N -m audioclf.train --config ...")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"audioclf: unknown tool {name!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    if name == "config":  # a module that runs as __main__
        sys.argv = [f"audioclf {name}", *rest]
        runpy.run_module(module, run_name="__main__")
        return 0
    return int(importlib.import_module(module).main(rest) or 0)
