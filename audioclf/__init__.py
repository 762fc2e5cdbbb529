"""audioclf: audio embedding classifiers (CNN / Conformer) trained with triplet loss under DDP."""

__version__ = "0.2.0"
