"""Embedding a collection with a trained model (`python -m audioclf.embed`): every row of an
index sheet into resumable part files across ranks (index.py, parts.py), and the classes of a
gallery sheet ranked for some audio files (gallery.py)."""
