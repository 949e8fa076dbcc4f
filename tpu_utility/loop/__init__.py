"""The training loops, built from small parts: batch.py (the batch protocol and the one
training step), hypers.py (the one lr and momentum writer), state.py (position, History,
loss guard), evaluate.py, resume.py (the checkpoint ordering), one_cycle.py, lr_find.py
and suggest.py (lr_find's pure suggestions)."""
from .evaluate import accuracy, gather, predict
from .lr_find import LRFindResult, lr_find
from .one_cycle import train_one_cycle
from .state import EpochStats, History

__all__ = ["train_one_cycle", "lr_find", "predict", "gather", "accuracy", "History",
           "EpochStats", "LRFindResult"]
