"""A stand-in for NVIDIA apex (not installable here): only what audioclf touches, with apex's
exact signatures, so tests catch calls that the real package would reject."""
