"""audioclf: audio embedding classifiers (CNN / Conformer) trained with triplet loss under DDP."""

__version__ = "0.2.0"

__all__ = ["Model", "load"]


def __getattr__(name: str):
    """`audioclf.load` and `audioclf.Model` (audioclf.api), imported on first use: importing a
    submodule (audioclf.config, the tools) does not load the whole stack."""
    if name in __all__:
        from audioclf import api  # noqa: PLC0415 - lazy: the API needs torch, search, embedding

        return getattr(api, name)
    raise AttributeError(f"module 'audioclf' has no attribute {name!r}")
