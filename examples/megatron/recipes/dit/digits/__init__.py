"""The digits demonstration: scikit-learn's 8x8 digits through preparation, training and scoring.

Demo and test code, not part of the library: run from this recipe folder (``digits_demo.py``) or
import with the folder on ``sys.path`` (tests/learning/conftest.py).
"""
